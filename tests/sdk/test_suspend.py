"""Suspend and resume through the SDK and a real engine, in-process and over the socket: a
suspended context's pages leave the pool (held, on disk under pressure, or in host memory
without a snapshot directory), its next use brings them back and continues exactly as if it
had never left, computing no token twice; the engine suspends idle contexts by itself when
it needs room, furthest expected return first; bad input is a typed error."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pie_ctx import Context, Sampler
from pie_ctx.errors import ContextClosed, InvalidArgument
from runtime.server.http.metrics import Metrics
from tests.sdk.harness import sdk_runtime

GREEDY = Sampler.greedy()
PROMPT, OTHER, THIRD = list(range(10, 50)), list(range(100, 200)), list(range(60, 100))


async def continuation(ctx: Context) -> tuple[list[int], object]:
    gen = ctx.generate(GREEDY, max_tokens=8, ignore_eos=True)
    tokens = await gen.tokens()
    return tokens, gen.report


async def reference(folder, transport) -> tuple[list[int], object]:
    """The same prompt and generation on an engine with room to spare, never suspended."""
    async with sdk_runtime(folder, transport, num_pages=128) as (rt, _):
        ctx = Context(rt).append(PROMPT)
        await ctx.flush()
        return await continuation(ctx)


async def test_a_suspended_context_comes_back_from_disk_without_recompute(
        tiny_folder, transport, tmp_path: Path):
    want, want_report = await reference(tiny_folder, transport)
    async with sdk_runtime(tiny_folder, transport, num_pages=26,
                           snapshot_dir=tmp_path, disk_cache_gb=0) as (rt, engine):
        ctx = Context(rt).append(PROMPT)
        await ctx.flush()
        assert await ctx.suspend() == 10  # 40 tokens in pages of 4
        stats = await rt.stats()
        assert (stats.num_contexts_suspended, stats.num_suspends) == (1, 1)
        assert stats.num_pages_held == 10  # cached, held: evicted last, and to disk
        async with Context(rt) as big:  # 100 tokens: the held pages must go to disk
            await big.append(OTHER).flush()
        assert (await rt.stats()).disk_pages_written >= 9
        got, report = await continuation(ctx)
        assert got == want
        assert report.tokens_computed == want_report.tokens_computed  # nothing recomputed
        assert report.pages_resumed_from_disk >= 9 and report.pages_resumed == 10
        stats = await rt.stats()
        assert (stats.num_contexts_suspended, stats.num_resumes) == (0, 1)
        assert stats.pages_resumed_from_disk == report.pages_resumed_from_disk
        assert stats.pages_resumed_from_memory + stats.pages_resumed_from_disk == 10
        assert stats.num_holds == 0  # the suspend's hold ended with the resume
        text = generate_latest(Metrics(engine).registry).decode()
        series = {(x.name, tuple(x.labels.values())): x.value
                  for family in text_string_to_metric_families(text) for x in family.samples}
        assert series[("pie_ctx_contexts_suspended", ())] == 0
        assert series[("pie_ctx_suspends_total", ("request",))] == 1
        assert series[("pie_ctx_resumes_total", ())] == 1
        assert series[("pie_ctx_pages_resumed_total", ("disk",))] == \
            report.pages_resumed_from_disk


async def test_without_a_snapshot_directory_pages_wait_in_host_memory(tiny_folder, transport):
    want, want_report = await reference(tiny_folder, transport)
    async with sdk_runtime(tiny_folder, transport, num_pages=26) as (rt, _):
        ctx = Context(rt).append(PROMPT)
        await ctx.flush()
        await ctx.suspend()
        async with Context(rt) as big:  # evicts every cached page
            await big.append(OTHER).flush()
        got, report = await continuation(ctx)
        assert got == want and report.tokens_computed == want_report.tokens_computed
        assert report.pages_resumed_from_disk == 0 and report.pages_resumed == 10


async def test_the_engine_suspends_idle_contexts_when_it_needs_room(tiny_folder, transport,
                                                                    tmp_path: Path):
    want, _ = await reference(tiny_folder, transport)
    async with sdk_runtime(tiny_folder, transport, num_pages=40,
                           snapshot_dir=tmp_path) as (rt, _):
        soon, later = Context(rt).append(PROMPT), Context(rt).append(THIRD)
        await soon.flush()
        await later.flush()
        await later.suspend(lazy=True, back_in=600)  # idle, and back last
        assert (await rt.stats()).num_contexts_suspended == 0
        async with Context(rt) as big:  # 25+ pages: only one idle context has to go
            await big.append(OTHER).flush()
        stats = await rt.stats()
        assert (stats.num_auto_suspends, stats.num_contexts_suspended) == (1, 1)
        got, report = await continuation(soon)  # never suspended: all in the pool
        assert got == want and report.pages_resumed == 0
        assert (await rt.stats()).num_resumes == 0
        _, report = await continuation(later)  # its next use brings it back
        assert report.pages_resumed == 10 and (await rt.stats()).num_resumes == 1


async def test_bad_suspends_are_typed_errors(tiny_folder, transport):
    async with sdk_runtime(tiny_folder, transport, num_pages=32) as (rt, _):
        ctx = Context(rt).append(PROMPT)
        await ctx.flush()
        for bad in (-1, float("nan"), "soon"):
            with pytest.raises(InvalidArgument):
                await ctx.suspend(back_in=bad)
        assert (await rt.stats()).num_suspends == 0
        await ctx.suspend()
        await ctx.release()  # a suspended context can be released as it is
        stats = await rt.stats()
        assert (stats.num_contexts_suspended, stats.num_resumes, stats.num_holds) == (0, 0, 0)
        with pytest.raises(ContextClosed):
            await ctx.suspend()


async def _agents(rt, n: int) -> list[list[int]]:
    """``n`` contexts, each a distinct 40-token prompt, flushed one after another, then
    all generating at once; their tokens."""
    ctxs = [Context(rt).append([7 + i, *PROMPT[1:]]) for i in range(n)]
    for ctx in ctxs:
        await ctx.flush()
    outs = [None] * n

    async def one(i: int) -> None:
        outs[i] = (await continuation(ctxs[i]))[0]
    async with anyio.create_task_group() as tg:
        for i in range(n):
            tg.start_soon(one, i)
    return outs


@pytest.mark.fp32_only("scheduling, not numerics: dtypes are covered above")
async def test_more_contexts_than_the_pool_holds_all_finish_exactly(
        tiny_folder, transport, tmp_path: Path):
    async with sdk_runtime(tiny_folder, transport, num_pages=256) as (rt, _):
        want = await _agents(rt, 6)
        roomy = await rt.stats()
    # 6 contexts of 10+ pages each in 32 pages: most of them are out of the pool at any time
    async with sdk_runtime(tiny_folder, transport, num_pages=32,
                           snapshot_dir=tmp_path) as (rt, _):
        got = await _agents(rt, 6)
        stats = await rt.stats()
    assert got == want
    assert stats.num_auto_suspends >= 4 and stats.num_resumes >= 4
    assert stats.tokens_computed == roomy.tokens_computed  # no token computed twice
    assert stats.num_contexts_suspended <= 6


@pytest.mark.fp32_only("scheduling, not numerics")
async def test_the_lowest_priority_idle_context_leaves_first(tiny_folder, transport,
                                                             tmp_path: Path):
    async with sdk_runtime(tiny_folder, transport, num_pages=40,
                           snapshot_dir=tmp_path) as (rt, engine):
        low = Context(rt, priority=0).append(PROMPT)
        high = Context(rt, priority=9).append(THIRD)
        await low.flush()
        await high.flush()  # high is the most recently used: by recency it would stay
        fork = high.fork()  # forks keep their parent's priority
        await fork.flush()
        async with Context(rt) as big:  # room for one idle context's pages must be made
            await big.append(OTHER).flush()
        stats = await rt.stats()
        assert stats.num_auto_suspends >= 1
        records = list(engine.records)
        assert sorted(r.priority for r in records) == [0, 9, 9]
        suspended = [r.priority for r in records if r.suspended is not None]
        assert suspended and set(suspended) == {0}
        with pytest.raises(InvalidArgument):
            Context(rt, priority=101)
