"""``FleetIngress``: the fleet's HTTP front, a Ray Serve deployment over the engines.

Owns: reading what a request names, and the table of live overrides (which replica last
served a session). Every path goes to one engine replica through the engines' handle,
whose router (``runtime.fleet.router``) picks it; the reply streams back as the engine
sends it. What a request names, in order:

* ``x-session-id`` (Ray Serve's session header): that session;
* ``previous_response_id`` (Responses API), ``/v1/responses/{id}``: the response's
  session; the id of every response a replica answers with is written into the table, so
  a conversation's next turn goes where its snapshot is resident;
* ``conversation`` (Responses API), ``snapshot`` (our chat/completions extension),
  ``prompt_cache_key`` (OpenAI's, chat and Responses): that conversation, snapshot or
  cache key, per API key;
* ``/v1/pie/channels/{name}`` and ``/v1/pie/topics/{name}``: the channel or topic, so
  every party of one channel meets on one replica;
* otherwise a chat or completion prompt's tokens (prefix routing), else nothing
  (the less loaded of two random replicas).

Failure: a call whose replica dies before the reply began is retried once on another
replica (the first is avoided); when that fails too the client gets one OpenAI-shaped
error, ``503`` ``{"error": {"message", "type": "server_error", "code":
"replica_unavailable"}}``, one sentence without Ray's traceback, process ids or addresses
(those go to the fleet's log). One that dies while streaming ends with the same error as
an SSE ``error`` event (an SSE stream) or a cut body, which the client sees as an error.
``/fleet/replicas``
lists the replicas, ``/fleet/stats`` gives the router's decision times, and ``/metrics``
is every replica's, each sample labelled with its ``replica``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import threading
import time
from collections import OrderedDict, deque
from typing import Any

import httpx
import ray.exceptions
from ray.serve.exceptions import RayServeException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from runtime.fleet import view
from runtime.fleet.prompt import PromptTokens
from runtime.fleet.replica import Call, ReplicaUnavailable
from runtime.fleet.sessions import session_of

__all__ = ["FleetIngress", "merge_metrics", "replica_error", "failed_replica"]

log = logging.getLogger("pie_ctx.fleet")

_RESPONSE_ID = re.compile(rb'"id"\s*:\s*"(resp_[0-9a-f]{32})"')
_MAX_SESSIONS = 200_000  # overrides kept (the oldest go first)
_SCAN_BYTES = 4096  # how far into a reply response ids are looked for
# What a call through the engines' handle raises when its replica fails.
_REPLICA_ERRORS = (ray.exceptions.RayError, RayServeException, RuntimeError)
_UNAVAILABLE = ("The fleet could not serve this request: its replica stopped and so did "
                "the one it was retried on; retry in a few seconds, when Ray Serve has "
                "replaced them.")
_STOPPED = ("The fleet replica serving this request stopped while it replied; retry the "
            "request, another replica takes it (a stored conversation continues there).")


class FleetIngress:
    """The deployment class of the fleet's front (see the module docstring).

    Args:
        engines: the handle of the ``EngineReplica`` deployment.
        model: the engines' model reference (its tokenizer gives prompts' tokens for
            prefix routing); None: the default model.
        prefix_routing: False routes prompts without a session to two random replicas.
    """

    def __init__(self, engines: Any, model: str | None = None,
                 prefix_routing: bool = True) -> None:
        self.engines = engines.options(method_name="handle", stream=True)
        self.sessions: OrderedDict[str, str] = OrderedDict()
        # The tokenizer loads beside the engines' boot, not before the front serves:
        # until it is there, prompts without a session route as without prefix routing.
        self.prompts: PromptTokens | None = None
        if prefix_routing:
            threading.Thread(target=self._load_prompts, args=(model,), daemon=True,
                             name="pie-ctx-front-tokenizer").start()
        self.front_ms: deque[float] = deque(maxlen=100_000)
        self.retries = 0

    def _load_prompts(self, model: str | None) -> None:
        self.prompts = PromptTokens.load(model)

    # -- the table of overrides --------------------------------------------------------

    def _remember(self, session: str, replica: str) -> None:
        self.sessions[session] = replica
        self.sessions.move_to_end(session)
        while len(self.sessions) > _MAX_SESSIONS:
            self.sessions.popitem(last=False)

    # -- requests ----------------------------------------------------------------------

    async def __call__(self, request: Request) -> Response:
        path = request.url.path
        if path == "/fleet/replicas":
            return JSONResponse({"replicas": list(view.VIEW.values())})
        if path == "/fleet/stats":
            return JSONResponse(self.stats())
        if path == "/metrics":
            return await self._metrics()
        start = time.perf_counter()
        raw = await request.body()
        body: Any = None
        if raw and "json" in request.headers.get("content-type", ""):
            try:
                body = json.loads(raw)
            except ValueError:
                body = None  # the engine answers it with its own 400
        session = session_of(request.method, path, request.headers, body)
        call = Call(method=request.method, path=path, query=request.url.query,
                    headers=list(request.headers.items()), body=raw, session=session,
                    prefer=self.sessions.get(session) if session else None,
                    tokens=None, avoid=[])
        if session is None and self.prompts is not None and isinstance(body, dict):
            call["tokens"] = self.prompts.of(path, body)
        self.front_ms.append((time.perf_counter() - start) * 1000)
        return await self._send(call)

    async def _send(self, call: Call) -> Response:
        for attempt in (0, 1):
            stream = self.engines.remote(call)
            try:
                head = await stream.__anext__()
            except _REPLICA_ERRORS as err:
                failed = failed_replica(err) or call.get("prefer")
                log.warning("replica %s failed before replying (%s)%s", failed or "?",
                            _brief(err), "" if attempt else "; retrying on another")
                if attempt:
                    return replica_error(503, _UNAVAILABLE)
                self.retries += 1
                # nothing was streamed: once more, avoiding the replica that failed
                if failed:
                    call["avoid"] = [failed]
                if call.get("prefer") == failed:
                    call["prefer"] = None
                if not failed:  # let Serve notice which replica it was
                    await asyncio.sleep(0.5)
                continue
            break
        replica = head["replica"]
        if call.get("session"):
            self._remember(call["session"], replica)
        headers = dict(head["headers"])
        headers["x-pie-replica"] = replica
        sse = "text/event-stream" in headers.get("content-type", "")
        return StreamingResponse(self._relay(stream, replica, sse), status_code=head["status"],
                                 headers=headers)

    async def _relay(self, stream: Any, replica: str, sse: bool) -> Any:
        """The reply's body; response ids seen in its start go into the table."""
        seen = b""
        try:
            async for chunk in stream:
                if len(seen) < _SCAN_BYTES:
                    seen += chunk
                    for rid in _RESPONSE_ID.findall(seen):
                        self._remember(f"r:{rid.decode()}", replica)
                yield chunk
        except _REPLICA_ERRORS as err:
            log.warning("replica %s failed mid-reply (%s)", replica, _brief(err))
            if sse:
                body = json.dumps(_error_body(_STOPPED))
                yield f"event: error\ndata: {body}\n\n".encode()

    async def _metrics(self) -> Response:
        """Every replica's /metrics as one exposition, each sample labelled with its
        replica (one HELP/TYPE per family, as the format wants)."""
        texts: dict[str, str] = {}
        async with httpx.AsyncClient(timeout=10) as client:
            for rid, info in sorted(view.VIEW.items()):
                try:
                    texts[rid] = (await client.get(info["url"] + "/metrics")).text
                except (httpx.HTTPError, KeyError) as e:
                    log.warning("metrics of replica %s: %s", rid, e)
        return PlainTextResponse(merge_metrics(texts), media_type="text/plain; version=0.0.4")

    def stats(self) -> dict[str, Any]:
        """The router's and the front's decision times (ms), and the table's size."""
        return {"routing_ms": _quantiles(view.ROUTING_MS),
                "front_ms": _quantiles(self.front_ms), "sessions": len(self.sessions),
                "retries": self.retries, "replicas": sorted(view.VIEW)}


def merge_metrics(texts: dict[str, str]) -> str:
    """Prometheus expositions of several replicas as one, with ``replica`` labels."""
    from prometheus_client.parser import text_string_to_metric_families

    families: dict[str, tuple[str, str, list[str]]] = {}
    for rid, text in texts.items():
        for fam in text_string_to_metric_families(text):
            _, _, lines = families.setdefault(fam.name, (fam.type, fam.documentation, []))
            for s in fam.samples:
                labels = {"replica": rid, **s.labels}
                body = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
                lines.append(f"{s.name}{{{body}}} {_number(s.value)}")
    out = []
    for name, (kind, doc, lines) in families.items():
        shown = f"{name}_total" if kind == "counter" else name  # (as prometheus_client writes)
        out += [f"# HELP {shown} {_escape(doc)}", f"# TYPE {shown} {kind}", *lines]
    return "\n".join(out) + "\n"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value: float) -> str:
    value = float(value)
    if value != value:
        return "NaN"
    return {float("inf"): "+Inf", float("-inf"): "-Inf"}.get(value, repr(value))


def _quantiles(values: Any) -> dict[str, float]:
    data = sorted(values)
    if not data:
        return {"n": 0}
    return {"n": len(data), "p50": data[len(data) // 2],
            "p99": data[min(len(data) - 1, int(len(data) * 0.99))]}


def _error_body(message: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": "server_error",
                      "code": "replica_unavailable"}}


def replica_error(status: int, message: str) -> Response:
    """The client's answer when no replica could serve its request: one OpenAI-shaped
    error (``code: replica_unavailable``)."""
    return JSONResponse(_error_body(message), status_code=status)


def failed_replica(err: BaseException) -> str | None:
    """The id of the replica a handle call's error names: the one whose engine failed
    (``ReplicaUnavailable``, through Ray's wrapping), or the one whose actor died (by its
    actor id, from what replicas report); None when neither says."""
    seen: BaseException | None = err
    for _ in range(4):
        if seen is None:
            break
        if isinstance(seen, ReplicaUnavailable):
            return seen.replica
        seen = getattr(seen, "cause", None) or seen.__cause__
    actor = getattr(err, "actor_id", None)
    if actor:
        for rid, info in view.VIEW.items():
            if info.get("actor_id") == actor:
                return rid
    return None


def _brief(err: BaseException) -> str:
    """One line of an error for the fleet's log (Ray's messages carry a traceback)."""
    seen: BaseException | None = err
    for _ in range(4):
        if isinstance(seen, ReplicaUnavailable):
            return f"{seen.replica}: {seen.message}"
        seen = getattr(seen, "cause", None) if seen is not None else None
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    return f"{type(err).__name__}: {lines[-1] if lines else ''}"[:300]
