"""Prometheus series the engine adds to ``GET /metrics`` beyond the HTTP layer's own: the
holds (docs/pages.md, "Holds"), suspended contexts ("Suspend and resume") and the API
keys' shares (docs/http.md, "Keys and shares"). Owns nothing: it reads ``EngineStats``
and the engine's tenants.

The HTTP app's collector yields ``Engine.metric_families()`` after its own series, so a
series added here needs no change there.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from pie_ctx.proto import messages as P

if TYPE_CHECKING:
    from runtime.engine.tenants import Tenants
    from runtime.kv.store import PageStore

__all__ = ["page_families", "tenant_families"]


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


def tenant_families(tenants: Tenants, store: PageStore
                    ) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
    """Per API key (labelled by its name, never the key): ``pie_ctx_key_rows_total``
    (step rows computed for it), ``pie_ctx_key_pages`` (pages its contexts hold now),
    ``pie_ctx_key_page_share`` (the most they may hold) and ``pie_ctx_key_share`` (its
    weight). Nothing when the server has no keys with shares."""
    if not tenants:
        return
    rows = CounterMetricFamily("pie_ctx_key_rows", "step rows (tokens) computed for an "
                               "API key's requests", labels=["key"])
    pages = GaugeMetricFamily("pie_ctx_key_pages", "KV pages an API key's contexts hold",
                              labels=["key"])
    limit = GaugeMetricFamily("pie_ctx_key_page_share", "the most KV pages an API key's "
                              "contexts may hold", labels=["key"])
    share = GaugeMetricFamily("pie_ctx_key_share", "an API key's weight in the split of "
                              "step rows and pages", labels=["key"])
    for owner, tenant in tenants.by_owner.items():
        rows.add_metric([tenant.name], tenant.rows)
        pages.add_metric([tenant.name], store.owner_pages(owner))
        limit.add_metric([tenant.name], tenant.max_pages or 0)
        share.add_metric([tenant.name], tenant.share)
    yield from (rows, pages, limit, share)
