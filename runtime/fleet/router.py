"""``FleetRouter``: Ray Serve's request router for the fleet's engines.

Owns: the choice of a replica for each call, on Ray Serve's custom request-router API
(``ray.serve.request_router.RequestRouter``: ``choose_replicas`` returns ranks of
candidates; Serve then takes, rank by rank, the least loaded replica of a rank whose
queue is under the deployment's ``max_ongoing_requests``, and backs off and asks again
when none is). The ranks:

1. **A call that names a session** (``Call.session``): the replica that last served it
   (``Call.prefer``, the ingress's table of live overrides), then every replica in
   rendezvous-hash order of ``(session, replica id)``. So a session stays on one replica;
   when that one is full or gone the next in its order takes it, and every router picks the
   same next one. The session's snapshot follows through the shared folder.
2. **A call with a prompt** (``Call.tokens``): the replica holding the longest prefix of its
   full pages (``runtime.fleet.prefix``, from KV events), then the less loaded of two
   random others.
3. **Anything else**: the less loaded of two random replicas (Serve's default policy).

Replicas in ``Call.avoid`` (one that just failed this call) are ranked last. The time
each choice takes is kept (``view.ROUTING_MS``) for ``GET /fleet/stats`` and the
benchmark; what replicas report goes into ``view.VIEW``, which the ingress in the same
process reads for ``/fleet/replicas`` and the aggregated ``/metrics``.
"""

from __future__ import annotations

import logging
import random
import time
from typing import Any

import xxhash
from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from runtime.fleet import view

__all__ = ["FleetRouter", "rendezvous"]

log = logging.getLogger("pie_ctx.fleet")


def rendezvous(session: str, replicas: list[str]) -> list[str]:
    """``replicas`` in the session's rendezvous-hash order (highest score first): the same
    order in every process, and removing a replica moves only the sessions it had."""
    return sorted(replicas, key=lambda r: xxhash.xxh3_64_intdigest(f"{session}\0{r}".encode()),
                  reverse=True)


class FleetRouter(RequestRouter):
    """See the module docstring."""

    def initialize_state(self, **kwargs: Any) -> None:
        self.index = view.INDEX  # every handle's router in this process shares it

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self._observe(replicas)
        self.index.forget({r.replica_id.unique_id for r in replicas})
        for gone in [r for r in view.VIEW if r not in {x.replica_id.unique_id for x in replicas}]:
            view.VIEW.pop(gone, None)

    def _observe(self, replicas: list[RunningReplica]) -> None:
        """Follow the KV events of replicas whose stats name them; note their stats."""
        for r in replicas:
            stats = r.routing_stats or {}
            rid = r.replica_id.unique_id
            if stats:
                view.VIEW[rid] = stats
            if stats.get("kv_events"):
                self.index.follow(rid, stats["kv_events"], stats.get("kv_events_replay"))

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None,
                              ) -> list[list[RunningReplica]]:
        start = time.perf_counter()
        try:
            if not candidate_replicas:
                return []
            self._observe(candidate_replicas)
            if pending_request is not None:  # back off between rounds when all are full
                pending_request.routing_context.should_backoff = True
            call = pending_request.args[0] if pending_request and pending_request.args else None
            try:
                return self.rank(call if isinstance(call, dict) else {}, candidate_replicas)
            except Exception:  # a bug here must not strand the call: any replica serves it
                log.exception("fleet router: ranking failed; routing to any replica")
                return [list(candidate_replicas)]
        finally:
            view.ROUTING_MS.append((time.perf_counter() - start) * 1000)

    def rank(self, call: dict[str, Any], replicas: list[RunningReplica],
             ) -> list[list[RunningReplica]]:
        """The ranks for one call (see the module docstring)."""
        avoid = set(call.get("avoid") or ())
        by_id = {r.replica_id.unique_id: r for r in replicas}
        live = [rid for rid in by_id if rid not in avoid] or list(by_id)
        last = [[by_id[rid]] for rid in by_id if rid in avoid and rid not in live]
        session = call.get("session")
        if session:
            order = rendezvous(session, live)
            prefer = call.get("prefer")
            if prefer in live:
                order.remove(prefer)
                order.insert(0, prefer)
            return [[by_id[rid]] for rid in order] + last
        ranks: list[list[RunningReplica]] = []
        tokens = call.get("tokens")
        rest = list(live)
        if tokens:
            held = {rid: n for rid, n in self.index.match(tokens).items() if rid in rest}
            if held:
                best = max(held, key=lambda rid: held[rid])
                ranks.append([by_id[best]])
                rest.remove(best)
        if rest:
            ranks.append([by_id[rid] for rid in random.sample(rest, min(2, len(rest)))])
            ranks.extend([[by_id[rid]] for rid in rest])  # every one, when both are full
        return ranks + last
