"""Prometheus series the engine adds to ``GET /metrics`` beyond the HTTP layer's own: the
holds (docs/pages.md, "Holds"). Owns nothing: it reads ``EngineStats``.

The HTTP app's collector yields ``Engine.metric_families()`` after its own series, so a
series added here needs no change there.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily

from pie_ctx.proto import messages as P

__all__ = ["page_families"]


def page_families(s: P.EngineStats) -> Iterator[GaugeMetricFamily]:
    """``pie_ctx_holds`` (live holds) and ``pie_ctx_pages_held`` (pages in the pool some
    hold covers, labelled by the highest priority covering each, plus ``all``)."""
    yield GaugeMetricFamily("pie_ctx_holds", "live holds (Context.retain)", value=s.num_holds)
    held = GaugeMetricFamily("pie_ctx_pages_held", "KV pages in the pool some hold covers, "
                             "by the highest priority covering them", labels=["priority"])
    held.add_metric(["all"], s.num_pages_held)
    for priority, n in sorted(s.pages_held_by_priority.items()):
        held.add_metric([str(priority)], n)
    yield held
