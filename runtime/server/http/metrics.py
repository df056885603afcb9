"""``GET /metrics``: the engine and the HTTP API in Prometheus' text format.

Owner: the HTTP app (one :class:`Metrics` per app, with its own registry, so two apps in
one process never mix their series). Two kinds of series:

* read from the engine at scrape time (a custom collector: nothing to keep in sync): pages
  free / used / cached / total, contexts, snapshots, queue depth and running jobs,
  prefix hit rate, pages reused vs computed, tokens computed, model steps. The page
  series are ``EngineStats``' counters, the sums of every pass report and snapshot open
  report (``pie_ctx_disk_io`` alone counts disk reads as they happen);
* recorded as requests are served: requests by endpoint and status (an ASGI middleware),
  time to first token and inter-token latency histograms, prompt / cached / completion
  tokens (the HTTP APIs report them through the ``Observer`` protocol of
  ``conversation.generation``).

Metric names start with ``pie_ctx_``; see docs/http.md for the list.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

__all__ = ["Metrics"]

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class _EngineCollector:
    """Engine gauges and counters, read when Prometheus scrapes."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Any]:
        s = self.engine.stats()
        sched = self.engine.scheduler
        pages = GaugeMetricFamily("pie_ctx_pages", "KV pages by state", labels=["state"])
        pages.add_metric(["free"], s.num_pages_free)
        pages.add_metric(["used"], s.num_pages_used)
        pages.add_metric(["cached"], s.num_pages_cached)
        yield pages
        yield GaugeMetricFamily("pie_ctx_pages_total", "KV pages in the pool",
                                value=s.num_pages_total)
        yield GaugeMetricFamily("pie_ctx_contexts", "live contexts", value=s.num_contexts)
        yield GaugeMetricFamily("pie_ctx_snapshots", "saved snapshots", value=s.num_snapshots)
        yield GaugeMetricFamily("pie_ctx_queue_depth", "jobs waiting to be admitted",
                                value=len(sched.waiting))
        yield GaugeMetricFamily("pie_ctx_running_jobs", "jobs admitted and running",
                                value=len(sched.active))
        yield GaugeMetricFamily("pie_ctx_prefix_hit_rate",
                                "pages reused / pages reused or computed (passes and "
                                "snapshot opens)", value=s.hit_rate)
        reuse = CounterMetricFamily("pie_ctx_prefix_pages",
                                    "KV pages by origin: reused (prefix matches, snapshot "
                                    "opens) or computed", labels=["origin"])
        reuse.add_metric(["reused"], s.pages_reused)
        reuse.add_metric(["computed"], s.pages_computed)
        yield reuse
        yield CounterMetricFamily("pie_ctx_prefix_pages_from_disk",
                                  "of the reused pages, those read from disk (prefix "
                                  "matches and snapshot opens)",
                                  value=s.pages_from_disk)
        yield GaugeMetricFamily("pie_ctx_snapshots_resident", "snapshots with pages in the pool",
                                value=s.num_snapshots_resident)
        disk = GaugeMetricFamily("pie_ctx_disk", "the snapshot directory's page files",
                                 labels=["unit"])
        disk.add_metric(["pages"], s.num_disk_pages)
        disk.add_metric(["bytes"], s.disk_bytes)
        yield disk
        io = CounterMetricFamily("pie_ctx_disk_io", "pages and bytes moved to and from disk "
                                 "(reads counted as done, even for a request that then "
                                 "failed)", labels=["direction", "unit"])
        io.add_metric(["written", "pages"], s.disk_pages_written)
        io.add_metric(["written", "bytes"], s.disk_bytes_written)
        io.add_metric(["loaded", "pages"], s.disk_pages_loaded)
        io.add_metric(["loaded", "bytes"], s.disk_bytes_loaded)
        yield io
        yield CounterMetricFamily("pie_ctx_snapshots_spilled",
                                  "snapshots dropped from the pool to disk under pressure",
                                  value=s.num_snapshots_spilled)
        yield CounterMetricFamily("pie_ctx_tokens_computed", "tokens run through the model",
                                  value=s.tokens_computed)
        yield CounterMetricFamily("pie_ctx_model_steps", "engine steps", value=s.num_steps)
        yield CounterMetricFamily("pie_ctx_model_seconds", "seconds spent in model calls",
                                  value=s.model_seconds)
        yield from self.engine.metric_families()  # the engine's own (runtime.engine)


# The served routes, each its own label (a path outside them is "other": the label's values
# stay bounded whatever clients send).
_PATHS = frozenset({
    "/", "/metrics", "/health", "/version", "/tokenize", "/detokenize",
    "/v1/models", "/v1/chat/completions", "/v1/completions", "/v1/embeddings",
    "/v1/responses", "/v1/responses/input_tokens", "/v1/responses/compact",
    "/v1/conversations", "/v1/messages",
    "/v1/messages/count_tokens", "/v1/load_lora_adapter", "/v1/unload_lora_adapter",
    "/v1/pie/state"})
# Routes with a path parameter, counted under one label each (the first match).
_PATTERNS = ((re.compile(r"/v1/models/.+"), "/v1/models/{model}"),
             (re.compile(r"/v1/responses/[^/]+/input_items"),
              "/v1/responses/{id}/input_items"),
             (re.compile(r"/v1/responses/[^/]+"), "/v1/responses/{id}"),
             (re.compile(r"/v1/conversations/[^/]+/items/[^/]+"),
              "/v1/conversations/{id}/items/{item_id}"),
             (re.compile(r"/v1/conversations/[^/]+/items"), "/v1/conversations/{id}/items"),
             (re.compile(r"/v1/conversations/[^/]+"), "/v1/conversations/{id}"),
             (re.compile(r"/v1/pie/channels/.+"), "/v1/pie/channels/{name}"),
             (re.compile(r"/v1/pie/topics/.+"), "/v1/pie/topics/{name}"),
             (re.compile(r"/v1/pie/inferlets/.+"), "/v1/pie/inferlets/{name}"))


class Metrics:
    """The app's metrics: the Prometheus registry, the ``/metrics`` route, the request
    middleware, and the ``Observer`` the OpenAI inferlet reports to."""

    def __init__(self, engine: Any) -> None:
        from starlette.responses import Response
        from starlette.routing import Route

        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine))  # type: ignore[arg-type]
        r = self.registry
        self.requests = Counter("pie_ctx_http_requests", "HTTP requests by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.ttft = Histogram("pie_ctx_time_to_first_token_seconds",
                              "request arrival to its first generated token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("pie_ctx_inter_token_latency_seconds",
                             "time between two streamed tokens of one choice",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.token_counts = Counter("pie_ctx_request_tokens",
                                    "tokens of finished API requests by kind", ["kind"],
                                    registry=r)
        self._totals = {"requests": 0.0, "prompt_tokens": 0.0, "cached_tokens": 0.0,
                        "completion_tokens": 0.0}

        async def scrape(request: Any) -> Any:
            return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)

        self.routes = [Route("/metrics", scrape, methods=["GET"])]

    # ---------------------------------------------- Observer (conversation.generation)

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def next_token(self, seconds: float) -> None:
        self.itl.observe(seconds)

    def tokens(self, prompt: int, cached: int, completion: int) -> None:
        self.token_counts.labels("prompt").inc(prompt)
        self.token_counts.labels("cached").inc(cached)
        self.token_counts.labels("completion").inc(completion)
        t = self._totals
        t["requests"] += 1
        t["prompt_tokens"] += prompt
        t["cached_tokens"] += cached
        t["completion_tokens"] += completion

    def counters(self) -> dict[str, float]:
        """Cumulative request and token counts, and the time they were read (for rates)."""
        return {**self._totals, "time": time.time()}

    # ---------------------------------------------------------------- the middleware

    def endpoint(self, path: str) -> str:
        """The label of ``path``: a known route, or "other" (bounded label values)."""
        if path in _PATHS:
            return path
        for pattern, label in _PATTERNS:
            if pattern.fullmatch(path):
                return label
        return "other"

    def middleware(self, app: Any) -> Any:
        """Wrap ``app`` so every HTTP response is counted by endpoint and status (a request
        whose client left before any response counts as status 499)."""

        async def counted(scope: Any, receive: Any, send: Any) -> None:
            if scope["type"] != "http":
                await app(scope, receive, send)
                return
            status = [499]

            async def send_status(message: Any) -> None:
                if message["type"] == "http.response.start":
                    status[0] = message["status"]
                await send(message)

            try:
                await app(scope, receive, send_status)
            except BaseException:
                if status[0] == 499:
                    status[0] = 500
                raise
            finally:
                self.requests.labels(self.endpoint(scope["path"]), str(status[0])).inc()

        return counted
