"""``GET /v1/pie/state`` (the page store as JSON) and ``GET /`` (the live view that draws it).

Owner: the HTTP app. This module owns nothing but the read: it walks the engine's page
store, context table and scheduler on the engine's event loop, in one synchronous pass with
no ``await`` inside, so what it reports is one consistent instant of the engine; it never
mutates them (not even the lazily cached page tables: chains are walked through the nodes'
parent links). The schema is documented in docs/http.md.

What the view shows, in the store's vocabulary (docs/pages.md):

* every live context: its committed chain (a tip in the trie), its working pages and, while
  a job runs on it, the job's shadow fork, reported in its place (the caller's own context
  is then the rollback state: its working pages are listed apart);
* every snapshot: its chain and its working pages;
* the trie nodes those chains run through, plus the cached ones, each marked ``committed``
  (one holder's chain runs through it), ``shared`` (two or more) or ``cached`` (none), so a
  client can draw forks branching off the pages they share.

The output is bounded: at most ``MAX_NODES`` nodes (whole chains, root first: the contexts'
in handle order, then the snapshots', then cached chains from the most recently used),
``MAX_HOLDERS`` contexts and as many snapshots, and ``MAX_CHAIN`` committed page ids per
holder (the tip's end); ``truncated`` says what was left out. The work is linear in the
pages the live chains run through plus the output (~10 ms for 220 contexts on 10,000
committed pages).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import asdict
from importlib import resources
from typing import Any

import msgspec

__all__ = ["state_routes", "read_state", "MAX_NODES", "MAX_HOLDERS", "MAX_CHAIN"]

MAX_NODES = 2000  # trie nodes per reply
MAX_HOLDERS = 256  # contexts per reply, and snapshots per reply
MAX_CHAIN = 512  # committed page ids listed per context or snapshot (the last ones)
MAX_LRU = 256  # cached page ids listed in eviction order
STATE_VERSION = 1


def state_routes(engine: Any, metrics: Any = None) -> list[Any]:
    """The live view's routes: ``GET /v1/pie/state`` (JSON) and ``GET /`` (the page).

    Args:
        engine: the running engine (read on its event loop, never mutated).
        metrics: the app's ``Metrics``; its ``counters()`` (cumulative request and token
            counts), if it has them, are added to the reply's ``counters``.
    """
    from starlette.responses import HTMLResponse, Response
    from starlette.routing import Route

    page = (resources.files("runtime.server.http") / "static" / "index.html").read_text("utf-8")
    no_store = {"Cache-Control": "no-store"}

    async def state(request: Any) -> Any:
        # async on purpose: it runs on the engine's loop, between two of its steps' bookkeeping
        body = msgspec.json.encode(read_state(engine, metrics))
        return Response(body, media_type="application/json", headers=no_store)

    async def index(request: Any) -> Any:
        return HTMLResponse(page, headers=no_store)

    return [Route("/v1/pie/state", state, methods=["GET"]),
            Route("/", index, methods=["GET"])]


def read_state(engine: Any, metrics: Any = None) -> dict[str, Any]:
    """The engine's contexts, snapshots and trie as plain data (see the module docstring).

    Must be called on the engine's event loop (no model step's bookkeeping can interleave).
    """
    now = time.time()
    store, scheduler = engine.store, engine.scheduler
    info = engine.info()
    states = dict(store.context_states())  # cid -> PageState, every store context

    # Which store context is whose: records (public handles), job shadows, the rest.
    running = {job.record.handle: job for job in scheduler.active if job.shadow is not None}
    queued = {job.record.handle for job in scheduler.waiting}
    records = _records(engine.records, {s.owner for s in states.values()})
    owner_ids: dict[int, int] = {}
    for record in records:
        owner_ids.setdefault(id(record.owner), len(owner_ids) + 1)
    claimed = {record.cid for record in records}
    claimed.update(job.shadow for job in running.values())

    # A holder is what a user sees: a context (its shadow's state while a job runs) or a
    # snapshot. Every store state's tip is walked, so every pinned page is found, but each
    # holder counts once, by the state it shows.
    holders: list[tuple[dict[str, Any], Any]] = []
    for record in records:
        job = running.get(record.handle)
        base = states.get(record.cid)
        shown = states.get(job.shadow) if job is not None else base
        if shown is None:
            continue
        entry: dict[str, Any] = {
            "handle": record.handle,
            "owner": owner_ids[id(record.owner)] if record.owner is not None else None,
            "status": ("running" if job is not None
                       else "queued" if record.handle in queued else "idle"),
            "job": None,
            "rollback_working_pages": [],
        }
        if job is not None:
            entry["job"] = {"kind": job.kind.value, "generated_tokens": len(job.progress.generated),
                            "prompt_tokens_left": job.prompt_remaining}
            entry["rollback_working_pages"] = list(base.working) if base is not None else []
        holders.append((entry, shown))
    for cid, s in states.items():
        if cid not in claimed:  # the engine's own (not behind a public handle)
            holders.append(({"handle": None, "owner": None, "status": "internal", "job": None,
                             "rollback_working_pages": []}, s))
    # a snapshot spilled to disk holds no page of the pool: it is not drawn
    snapshot_holders = [({"namespace": ns, "name": name}, snap.state)
                        for (ns, name), snap in store.snapshots if snap.state is not None]

    # ``through``: how many holders' chains run through each live node (a subtree sum of
    # the holders' tips over every pinned node, deepest first).
    through: dict[Any, int] = {}
    for _, s in (*holders, *snapshot_holders):
        if s.tip is not None:
            through[s.tip] = through.get(s.tip, 0) + 1
    all_tips = [s.tip for s in states.values()] + [s.tip for _, s in snapshot_holders]
    live = _walk_up(all_tips, set())
    live.sort(key=lambda n: n.depth)
    for node in reversed(live):
        if node.parent is not None:
            through[node.parent] = through.get(node.parent, 0) + through.get(node, 0)

    # Emit whole chains, root first (a node always follows its parent): the holders' in
    # their order, then the cached ones from the most recently used, until the cap.
    trie = store.trie
    lru = list(trie.lru.values())  # evictable cached pages, next victim first
    emitted: set[Any] = set()
    nodes: list[dict[str, Any]] = []
    tips = [s.tip for _, s in (*holders, *snapshot_holders)] + all_tips + lru[::-1]
    for tip in tips:
        chain = _chain_to(tip, emitted)
        room = MAX_NODES - len(nodes)
        nodes.extend(_node(n, through.get(n, 0)) for n in chain[:room])
        emitted.update(chain[:room])
        if len(chain) > room:
            break
    omitted_nodes = len(live) + trie.num_cached - len(nodes)

    contexts = [_holder(entry, s, through, store.page_size)
                for entry, s in holders[:MAX_HOLDERS]]
    snapshots = [_holder(entry, s, through, store.page_size)
                 for entry, s in snapshot_holders[:MAX_HOLDERS]]

    counters: dict[str, float] = {}
    read_counters = getattr(metrics, "counters", None)
    if callable(read_counters):
        counters.update(read_counters())
    stats = engine.stats()
    counters.update({
        "time": now,
        "tokens_computed": stats.tokens_computed,
        "pages_reused": stats.pages_reused,
        "pages_computed": stats.pages_computed,
        "num_steps": stats.num_steps,
        "model_seconds": stats.model_seconds,
    })

    return {
        "version": STATE_VERSION,
        "time": now,
        "engine": {
            "model": info.model_name, "page_size": info.page_size,
            "num_pages": info.num_pages, "dtype": info.dtype, "device": info.device,
            "attention": info.attention, "weights": info.weights, "kv_dtype": info.kv_dtype,
            "backend": info.backend, "deterministic": info.deterministic,
            "max_seq_len": info.max_seq_len, "max_pages_per_owner": info.max_pages_per_owner,
            "snapshot_dir": info.snapshot_dir,
        },
        "stats": msgspec.structs.asdict(stats),
        "pages": asdict(store.stats()),
        "jobs": {"waiting": len(scheduler.waiting), "active": len(scheduler.active),
                 "num_preemptions": scheduler.num_preemptions},
        "contexts": contexts,
        "snapshots": snapshots,
        "nodes": nodes,
        "cached_pages": {"count": trie.num_cached, "evictable": len(lru),
                         "lru": [n.page_id for n in lru[:MAX_LRU]]},
        "counters": counters,
        "truncated": {
            "nodes": omitted_nodes,
            "contexts": max(0, len(holders) - MAX_HOLDERS),
            "snapshots": max(0, len(snapshot_holders) - MAX_HOLDERS),
        },
    }


def _records(table: Any, owners: Iterable[Any]) -> list[Any]:
    """Every record of the context table, by handle. Each record owns a store context of
    its owner, so the owners of the store's contexts name every record."""
    found: dict[int, Any] = {}
    for owner in owners:
        for record in table.owned_by(owner):
            found[record.handle] = record
    return [found[h] for h in sorted(found)]


def _chain_to(tip: Any, emitted: set[Any]) -> list[Any]:
    """The nodes from the last emitted one (or the root) down to ``tip``, root first."""
    chain: list[Any] = []
    node = tip
    while node is not None and node not in emitted:
        chain.append(node)
        node = node.parent
    chain.reverse()
    return chain


def _walk_up(tips: Iterable[Any], seen: set[Any]) -> list[Any]:
    """The nodes on the chains of ``tips`` not in ``seen`` (tip side first per chain);
    ``seen`` grows with them."""
    out: list[Any] = []
    for node in tips:
        while node is not None and node not in seen:
            seen.add(node)
            out.append(node)
            node = node.parent
    return out


def _node(node: Any, holders: int) -> dict[str, Any]:
    pinned = node.pins > 0
    return {
        "page": node.page_id,
        "parent": None if node.parent is None else node.parent.page_id,
        "depth": node.depth,
        "holders": holders,
        "pinned": pinned,
        "state": "cached" if not pinned else "shared" if holders > 1 else "committed",
        "evictable": not pinned and node.num_children == 0,
        "private": not node.registered,
    }


def _holder(entry: dict[str, Any], state: Any, through: dict[Any, int],
            page_size: int) -> dict[str, Any]:
    """A context's or snapshot's entry: ``entry`` plus its page state."""
    chain: list[int] = []
    node = state.tip
    while node is not None and len(chain) < MAX_CHAIN:
        chain.append(node.page_id)
        node = node.parent
    chain.reverse()
    # Sharing only grows towards the root: the first shared node from the tip counts all.
    num_shared = 0
    node = state.tip
    while node is not None:
        if through.get(node, 0) > 1:
            num_shared = node.depth
            break
        node = node.parent
    num_committed = 0 if state.tip is None else state.tip.depth
    return {
        **entry,
        "tip": None if state.tip is None else state.tip.page_id,
        "seq_len": num_committed * page_size + len(state.tokens),
        "num_committed_pages": num_committed,
        "num_shared_pages": num_shared,
        "committed_pages": chain,
        "working_pages": list(state.working),
        "num_working_tokens": len(state.tokens),
    }
