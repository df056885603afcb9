"""The socket transport behaves like the in-process one: same results, same errors, no
deadlock however many requests are queued, flow control instead of refusals."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio
import pytest

from pie_ctx import Context, Sampler, gather
from pie_ctx.errors import PieError, SnapshotNotFound
from tests.sdk.harness import sdk_owners

BOUND = 60.0


def _bad_calls(rt) -> dict[str, Callable[[], Any]]:
    """Bad input of every kind, as calls (sync or async) on a fresh context."""
    ctx = Context(rt).append([1, 2, 3])
    raw = ctx.inner()
    return {
        "reserve 2.5 pages": lambda: raw.reserve_working_pages(2.5),
        "reserve True pages": lambda: raw.reserve_working_pages(True),
        "commit -1 pages": lambda: raw.commit_working_pages(-1),
        "truncate '1'": lambda: ctx.truncate("1"),
        "seed 2**80": lambda: Sampler.temperature(1.0, seed=2**80),
        "sampler as a string": lambda: ctx.generate("greedy"),
        "temperature nan": lambda: Sampler.temperature(float("nan")),
        "max_tokens 0": lambda: ctx.generate(max_tokens=0),
        "max_tokens 2**70": lambda: ctx.generate(max_tokens=2**70).text(),
        "stop token out of range": lambda: ctx.generate(stop=[10**9]),
        "empty stop string": lambda: ctx.generate(stop=[""]),
        "stop of the wrong type": lambda: ctx.generate(stop=[1.5]),
        "append a float": lambda: ctx.append([1.0]),
        "append 2**70": lambda: ctx.append([2**70]),
        "user(None)": lambda: ctx.user(None),
        "lone surrogate": lambda: ctx.user("bad \ud800 text"),
        "snapshot name ''": lambda: ctx.save(""),
        "snapshot name 257 chars": lambda: Context.open(rt, "x" * 257),
        "open a missing snapshot": lambda: Context.open(rt, "missing"),
        "input_at negative": lambda: ctx.forward().input_at([1], [-1]),
        "input_at 2**70": lambda: ctx.forward().input_at([1], [2**70]),
        "mask of strings": lambda: ctx.forward().input([4]).attention_mask(
            [["yes"] * 4]).logits([0]).execute(),
        "mask all False": lambda: ctx.forward().input([4]).attention_mask(
            [[False] * 4]).execute(),
        "logits index 5": lambda: ctx.forward().input([4]).logits([5]).execute(),
        "logprob ids out of range": lambda: ctx.forward().input([4]).logprobs(0, [-3]),
        "distribution top_k 0": lambda: ctx.forward().input([4]).distribution(0, 0),
        "sample with a dict": lambda: ctx.forward().input([4]).sample([0], {"t": 1}),
        "huge reply": lambda: ctx.forward().input([4]).logits([0] * 100_000).execute(),
    }


async def _outcomes(rt) -> dict[str, tuple[str, str]]:
    out = {}
    for name, call in _bad_calls(rt).items():
        try:
            result = call()
            if hasattr(result, "__await__"):
                await result
            out[name] = ("ok", "")
        except PieError as err:
            out[name] = (type(err).__name__, str(err))
    return out


async def test_the_same_bad_input_gives_the_same_error_on_both_transports(tiny_folder):
    seen = {}
    for transport in ("local", "socket"):
        async with sdk_owners(tiny_folder, transport, 1) as ((rt,), engine):
            seen[transport] = await _outcomes(rt)
            engine.store.check_invariants()
    assert seen["local"] == seen["socket"]
    for name, (kind, message) in seen["local"].items():
        expected = "SnapshotNotFound" if name == "open a missing snapshot" else "InvalidArgument"
        assert kind == expected, (name, kind, message)
        assert message, name


async def test_a_thousand_releases_at_once_do_not_deadlock(tiny_folder, transport):
    async with sdk_owners(tiny_folder, transport, 1, num_pages=4096) as ((rt,), engine):
        ctxs = [Context(rt).append([1, 2, 3, 4, 5]) for _ in range(1000)]
        with anyio.fail_after(BOUND):
            await gather(*(c.flush() for c in ctxs))
            assert engine.stats().num_contexts == 1000
            await gather(*(c.release() for c in ctxs))
            assert (await rt.stats()).num_contexts == 0  # and the connection still works


async def test_more_requests_than_the_server_allows_in_flight_are_queued(tiny_folder, transport):
    async with sdk_owners(tiny_folder, transport, 1, num_pages=2048) as ((rt,), engine):
        base = Context(rt).append([1, 2, 3, 4, 5, 6])
        await base.flush()
        forks = [base.fork() for _ in range(600)]
        with anyio.fail_after(BOUND):
            states = await gather(*(f.refresh() for f in forks), *(rt.stats() for _ in range(1400)))
        assert all(s.seq_len == 6 for s in states[:600])
        assert (await base.refresh()).seq_len == 6  # an unrelated call afterwards works
        await gather(*(f.release() for f in forks))


async def test_gather_raises_the_first_error_after_everything_finished(tiny_folder, transport):
    async with sdk_owners(tiny_folder, transport, 1) as ((rt,), engine):
        ctx = Context(rt).append([1, 2, 3, 4])
        for i in range(200):
            ctx.save(f"s{i}")
        await ctx.refresh()
        assert len(await rt.snapshots()) == 200
        names = [f"s{i}" for i in range(200)]
        names.insert(100, "missing")
        with anyio.fail_after(BOUND), pytest.raises(SnapshotNotFound) as info:
            await gather(*(Context.delete(rt, n) for n in names))
        assert "missing" in str(info.value)  # the error itself, not an ExceptionGroup
        assert await rt.snapshots() == []  # every other delete ran to its end
        with pytest.raises(SnapshotNotFound) as info:
            await gather(Context.delete(rt, "a"), Context.delete(rt, "b"))
        assert "1 more" in "".join(getattr(info.value, "__notes__", []))
