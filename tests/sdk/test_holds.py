"""``Context.retain`` through a real engine: a held prefix survives pressure that evicts an
unheld one, shows in the stats, ends on release; bad input is a typed error."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pie_ctx import Context
from pie_ctx.errors import HoldLimit, HoldNotFound, InvalidArgument
from runtime.server.http.metrics import Metrics
from tests.sdk.harness import sdk_runtime

HELD, PLAIN, OTHER = list(range(10, 50)), list(range(60, 100)), list(range(100, 188))


async def reused(rt, tokens: list[int]) -> int:
    """Pages a fresh context with these tokens found already computed."""
    async with Context(rt) as ctx:
        return (await ctx.append(tokens).flush()).pages_reused


async def test_a_held_prefix_outlives_pressure_and_an_unheld_one_does_not(tiny_folder, transport):
    async with sdk_runtime(tiny_folder, transport, num_pages=32, hold_share=0.5) as (rt, engine):
        held = Context(rt).append(HELD)
        hold = await held.retain(ttl=60, priority=3)
        assert hold.num_pages == 10 and hold.priority == 3  # 40 tokens, pages of 4
        await held.release()
        async with Context(rt) as plain:
            await plain.append(PLAIN).flush()
        stats = await rt.stats()
        assert (stats.num_holds, stats.num_pages_held) == (1, 10)
        assert stats.pages_held_by_priority == {3: 10}
        text = generate_latest(Metrics(engine).registry).decode()
        series = {(x.name, tuple(x.labels.values())): x.value
                  for family in text_string_to_metric_families(text) for x in family.samples}
        assert series[("pie_ctx_holds", ())] == 1
        assert series[("pie_ctx_pages_held", ("all",))] == 10
        assert series[("pie_ctx_pages_held", ("3",))] == 10
        async with Context(rt) as big:  # needs 22 pages: 12 free, the rest evicted
            await big.append(OTHER).flush()
        assert await reused(rt, HELD) >= 9  # (the last page may be recomputed for logits)
        assert await reused(rt, PLAIN) <= 1
        await rt.release_hold(hold)
        assert (await rt.stats()).num_holds == 0
        with pytest.raises(HoldNotFound):
            await rt.release_hold(hold.hold)


async def test_bad_holds_are_typed_errors_that_change_nothing(tiny_folder, transport):
    async with sdk_runtime(tiny_folder, transport, num_pages=32) as (rt, engine):
        ctx = Context(rt).append(HELD)
        await ctx.flush()
        for kw in ({"ttl": -1}, {"ttl": 0}, {"ttl": 30, "priority": -2},
                   {"ttl": 30, "num_tokens": -1}):
            with pytest.raises(InvalidArgument):
                await ctx.retain(**kw)
        assert (await rt.stats()).num_holds == 0
        assert rt.info.max_held_pages_per_owner == 8  # a quarter of the pool by default
        with pytest.raises(HoldLimit, match="max|limit"):
            await ctx.retain(ttl=30)  # 10 pages > 8
        assert (await ctx.retain(ttl=30, num_tokens=32)).num_pages == 8
        assert (await rt.stats()).num_pages_held == 8
