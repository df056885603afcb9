"""An adversarial client among well-behaved ones, driven by hypothesis, over both transports.

Each example runs two well-behaved owners (a fixed script of flushes, forks, greedy and
seeded generations) next to a hostile owner doing a random mix of valid and invalid
operations: bad masks, oversized requests, reservations beyond its share, generations it
abandons, cancels or releases mid-stream, snapshot churn. Invariants: the well-behaved
owners' outputs equal a run without the hostile one, every hostile operation ends within
its time bound with at most a typed error, and once everyone has left no page is used
and the page store's invariants hold.
"""

from __future__ import annotations

import os
from typing import Any

import anyio
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pie_ctx import Context, Sampler, gather
from pie_ctx.errors import PieError
from tests.sdk.harness import sdk_owners, tiny_model_folder

BOUND = 20.0
SLOW = bool(os.environ.get("PIE_CTX_SLOW"))
ENGINE = {"num_pages": 192, "stall_timeout": 0.5, "owner_share": 0.5}


async def _well_behaved(rt, i: int) -> list[Any]:
    """A fixed script whose outputs must not depend on anyone else."""
    base = Context(rt).system("be brief").user(f"question {i}")
    await base.flush()
    forks = [base.fork() for _ in range(2)]
    greedy, seeded = await gather(
        forks[0].generate(Sampler.greedy(), max_tokens=12, ignore_eos=True).tokens(),
        forks[1].generate(Sampler.top_k(0.9, 20, seed=i), max_tokens=12,
                          ignore_eos=True).tokens())
    out = await (base.forward().input([5, 6]).logprobs(1, [3, 4]).sample([1], Sampler.greedy())
                 .execute())
    for ctx in (base, *forks):
        await ctx.release()
    return [greedy, seeded, out.tokens, [round(x, 3) for x in out.logprobs[0]]]


OPS = st.one_of(
    st.tuples(st.just("flush"), st.lists(st.integers(0, 265), min_size=1, max_size=40)),
    st.tuples(st.just("bad_mask"), st.integers(1, 4)),
    st.tuples(st.just("bad_index"), st.integers(1, 10**6)),
    st.tuples(st.just("huge_reply"), st.integers(10_000, 10**6)),
    st.tuples(st.just("reserve"), st.integers(0, 400)),
    st.tuples(st.just("abandon"), st.integers(1, 60)),
    st.tuples(st.just("release_mid_stream"), st.integers(5, 200)),
    st.tuples(st.just("cancel"), st.integers(5, 200)),
    st.tuples(st.just("forks"), st.integers(1, 12)),
    st.tuples(st.just("save"), st.sampled_from(["a", "b"])),
    st.tuples(st.just("delete"), st.sampled_from(["a", "b", "zzz"])),
    st.tuples(st.just("open"), st.sampled_from(["a", "b"])),
    st.tuples(st.just("truncate"), st.integers(0, 50)),
    st.tuples(st.just("bad_sampler"), st.integers(0, 3)),
)


async def _hostile_op(rt, ctx: Context, op: tuple[str, Any], keep: list[Context]) -> None:
    kind, arg = op
    if kind == "flush":
        await ctx.append(arg).flush()
    elif kind == "bad_mask":
        await ctx.forward().input([1] * arg).attention_mask(
            [[False] * (ctx.seq_len + arg)] * arg).execute()
    elif kind == "bad_index":
        await ctx.forward().input([1]).logits([arg]).execute()
    elif kind == "huge_reply":
        await ctx.forward().input([1]).logits([0] * arg).execute()
    elif kind == "reserve":
        fresh = Context(rt)
        keep.append(fresh)
        await fresh.inner().reserve_working_pages(arg)
    elif kind in ("abandon", "release_mid_stream", "cancel"):
        victim = ctx.fork().append([3])
        keep.append(victim)
        gen = victim.generate(Sampler.greedy(), max_tokens=arg, ignore_eos=True)
        async for _ in gen:
            break
        if kind == "release_mid_stream":
            await victim.release()
        elif kind == "cancel":
            await gen.aclose()
    elif kind == "forks":
        keep.extend(ctx.fork() for _ in range(arg))
        await keep[-1].refresh()
    elif kind == "save":
        await ctx.save(arg)
    elif kind == "delete":
        await Context.delete(rt, arg)
    elif kind == "open":
        keep.append(await Context.open(rt, arg))
    elif kind == "truncate":
        await ctx.truncate(arg)
    elif kind == "bad_sampler":
        bad = [lambda: Sampler.temperature(-1.0), lambda: Sampler.top_p(1, 0),
               lambda: ctx.generate("hot"), lambda: Sampler.top_k(1, 0)][arg]
        bad()


async def _hostile(rt, ops: list[tuple[str, Any]]) -> None:
    ctx = Context(rt).user("I will take everything")
    keep: list[Context] = []
    for op in ops:
        with anyio.fail_after(BOUND):  # every operation ends in bounded time
            try:
                await _hostile_op(rt, ctx, op, keep)
            except PieError:
                pass  # a typed error is a fine answer to a hostile request


_REFERENCE: dict[str, list[Any]] = {}


async def _episode(folder, transport: str, ops: list[tuple[str, Any]] | None) -> list[Any]:
    async with sdk_owners(folder, transport, 3, **ENGINE) as ((a, b, hostile), engine):
        work = [_well_behaved(a, 1), _well_behaved(b, 2)]
        if ops is not None:
            work.append(_hostile(hostile, ops))
        with anyio.fail_after(120):
            results = await gather(*work)
    # everyone left: nothing may remain but the hostile owner's snapshots
    for (namespace, name), _ in list(engine.store.snapshots):
        engine.store.delete_snapshot(name, namespace)
    stats = engine.stats()
    assert stats.num_contexts == 0 and stats.num_pages_used == 0, stats
    engine.store.check_invariants()
    return results[:2]


@pytest.mark.parametrize("transport", ["local", "socket"])
@settings(max_examples=400 if SLOW else 40, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(ops=st.lists(OPS, min_size=1, max_size=8))
def test_a_hostile_owner_changes_nothing_for_the_others(tmp_path_factory, transport, ops):
    folder = tiny_model_folder(tmp_path_factory.getbasetemp())
    if transport not in _REFERENCE:
        _REFERENCE[transport] = anyio.run(_episode, folder, transport, None)
    got = anyio.run(_episode, folder, transport, ops)
    assert got == _REFERENCE[transport]
