"""The engine's page counters agree with the reports a program saw: ``rt.stats()`` (and
``/metrics``) sum the pass reports and the ``open_report`` of every snapshot open or take,
from memory and from disk; ``disk_pages_loaded`` is the disk I/O behind them."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pie_ctx import Context
from runtime.server.http.metrics import Metrics
from tests.sdk.harness import sdk_runtime

PAGE = 4
PROMPT = list(range(3, 3 + 4 * PAGE + 2))  # 4 full pages and a tail of 2 tokens


def _series(engine) -> dict[tuple[str, tuple], float]:
    text = generate_latest(Metrics(engine).registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _pages(stats) -> tuple[int, int, int]:
    return stats.pages_reused, stats.pages_computed, stats.pages_from_disk


@pytest.mark.fp32_only("page counts only")
async def test_stats_count_snapshot_opens_from_memory_and_from_disk(
        tiny_folder, transport, tmp_path: Path) -> None:
    kw = {"snapshot_dir": tmp_path, "page_size": PAGE}
    async with sdk_runtime(tiny_folder, transport, **kw) as (rt, engine):
        ctx = Context(rt).append(PROMPT)
        flushed = await ctx.flush()
        await ctx.save("prompt")
        await ctx.release()
        before = await rt.stats()
        assert _pages(before) == (flushed.pages_reused, flushed.pages_computed, 0) == (0, 4, 0)
        opened = await Context.open(rt, "prompt")  # resident: every page from memory
        report = opened.open_report
        assert (report.pages_reused, report.pages_from_disk, report.pages_computed) == (5, 0, 0)
        after = await rt.stats()
        assert _pages(after) == (5, 4, 0)  # the flush's report plus the open's
        assert after.hit_rate == pytest.approx(5 / 9)
        await opened.release()
    async with sdk_runtime(tiny_folder, transport, **kw) as (rt, engine):  # a restart
        opened = await Context.open(rt, "prompt")  # spilled: every page from disk
        report = opened.open_report
        # the partly filled tail page counts: 4 page files on disk, 5 pages reused
        assert (report.pages_reused, report.pages_from_disk) == (5, 5)
        assert opened.num_committed_pages + opened.num_working_pages == 5
        stats = await rt.stats()
        assert stats.num_disk_pages == 4
        assert _pages(stats) == (5, 0, 5) and stats.hit_rate == 1.0
        assert stats.disk_pages_loaded == stats.pages_from_disk  # the I/O behind the open
        taken = await Context.take(rt, "prompt")  # resident now: from memory
        assert (taken.open_report.pages_reused, taken.open_report.pages_from_disk) == (5, 0)
        stats = await rt.stats()
        assert _pages(stats) == (10, 0, 5) and stats.disk_pages_loaded == 5
        series = _series(engine)
        assert series[("pie_ctx_prefix_pages_total", (("origin", "reused"),))] == 10
        assert series[("pie_ctx_prefix_pages_total", (("origin", "computed"),))] == 0
        assert series[("pie_ctx_prefix_pages_from_disk_total", ())] == 5
        assert series[("pie_ctx_prefix_hit_rate", ())] == 1.0
        assert series[("pie_ctx_disk_io_total", (("direction", "loaded"), ("unit", "pages")))] == 5


@pytest.mark.fp32_only("page counts only")
async def test_a_failed_open_counts_no_pages(tiny_folder, tmp_path: Path) -> None:
    async with sdk_runtime(tiny_folder, "local", page_size=PAGE) as (rt, engine):
        before = await rt.stats()
        with pytest.raises(Exception, match="no-such"):
            await Context.open(rt, "no-such")
        assert _pages(await rt.stats()) == _pages(before)
