"""Prometheus series the engine adds to ``GET /metrics`` beyond the HTTP layer's own: the
holds (docs/pages.md, "Holds") and suspended contexts ("Suspend and resume"). Owns
nothing: it reads ``EngineStats``.

The HTTP app's collector yields ``Engine.metric_families()`` after its own series, so a
series added here needs no change there.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from pie_ctx.proto import messages as P

__all__ = ["page_families"]


def page_families(s: P.EngineStats) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
    """``pie_ctx_holds`` (live holds), ``pie_ctx_pages_held`` (pages in the pool some
    hold covers, labelled by the highest priority covering each, plus ``all``),
    ``pie_ctx_contexts_suspended`` (now), ``pie_ctx_suspends_total`` (by ``how``: asked
    for, or chosen by the engine for room), ``pie_ctx_resumes_total`` and
    ``pie_ctx_pages_resumed_total`` (by ``source``: memory or disk)."""
    yield GaugeMetricFamily("pie_ctx_holds", "live holds (Context.retain)", value=s.num_holds)
    held = GaugeMetricFamily("pie_ctx_pages_held", "KV pages in the pool some hold covers, "
                             "by the highest priority covering them", labels=["priority"])
    held.add_metric(["all"], s.num_pages_held)
    for priority, n in sorted(s.pages_held_by_priority.items()):
        held.add_metric([str(priority)], n)
    yield held
    yield GaugeMetricFamily("pie_ctx_contexts_suspended", "contexts whose KV pages are out "
                            "of the pool until their next use", value=s.num_contexts_suspended)
    suspends = CounterMetricFamily("pie_ctx_suspends", "contexts suspended", labels=["how"])
    suspends.add_metric(["request"], s.num_suspends - s.num_auto_suspends)
    suspends.add_metric(["pressure"], s.num_auto_suspends)
    yield suspends
    yield CounterMetricFamily("pie_ctx_resumes", "suspended contexts brought back",
                              value=s.num_resumes)
    pages = CounterMetricFamily("pie_ctx_pages_resumed", "KV pages suspended contexts got "
                                "back without computing them", labels=["source"])
    pages.add_metric(["memory"], s.pages_resumed_from_memory)
    pages.add_metric(["disk"], s.pages_resumed_from_disk)
    yield pages
