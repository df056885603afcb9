"""Nothing hangs: every SDK operation completes or raises a typed error in bounded time,
whatever state the other objects are in, over both transports."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import pytest

from pie_ctx import Context, Runtime, Sampler
from pie_ctx.errors import ContextClosed, PieError, ProtocolError
from tests.sdk.harness import new_runtime, sdk_owners

GREEDY = Sampler.greedy()
BOUND = 20.0  # seconds any one operation may take on the tiny model


async def _settled(engine: Any) -> None:
    """Every context is gone (releases may finish just after a generation ends)."""
    with anyio.fail_after(BOUND):
        while engine.stats().num_contexts:
            await anyio.sleep(0.01)
    engine.store.check_invariants()


def _operations(rt: Runtime, ctx: Context) -> dict[str, Callable[[], Any]]:
    """Every public operation, as a call that returns a value or an awaitable."""
    raw = lambda: ctx.inner()  # noqa: E731

    async def generated() -> str:
        return await ctx.generate(GREEDY, max_tokens=3).text()

    async def forked() -> Any:
        return await ctx.fork().refresh()

    return {
        "user": lambda: ctx.user("more"),
        "append": lambda: ctx.append([5, 6]),
        "cue": lambda: ctx.cue(),
        "seq_len": lambda: ctx.seq_len,
        "pending_tokens": lambda: ctx.pending_tokens,
        "flush": ctx.flush,
        "refresh": ctx.refresh,
        "generate": generated,
        "fork": forked,
        "truncate": lambda: ctx.truncate(0),
        "save": lambda: ctx.save("liveness"),
        "reserve": lambda: raw().reserve_working_pages(1),
        "commit": lambda: raw().commit_working_pages(0),
        "release_pages": lambda: raw().release_working_pages(0),
        "truncate_tokens": lambda: raw().truncate_working_page_tokens(0),
        "forward": lambda: ctx.forward().input([3]).logits([0]).execute(),
        "open": lambda: Context.open(rt, "liveness"),
        "take": lambda: Context.take(rt, "nothing-here"),
        "delete": lambda: Context.delete(rt, "liveness"),
        "snapshots": rt.snapshots,
        "stats": rt.stats,
        "release": ctx.release,
    }


async def _bounded(call: Callable[[], Any]) -> BaseException | None:
    """Run one operation under the bound; return the typed error it raised, if any."""
    with anyio.fail_after(BOUND):
        try:
            result = call()
            if isinstance(result, Awaitable):
                await result
        except PieError as err:
            return err
    return None


async def _context_in(rt: Runtime, state: str) -> tuple[Context, Any]:
    ctx = Context(rt).user("hello there")
    if state == "new":
        return ctx, None
    await ctx.flush()
    if state == "flushed":
        return ctx, None
    if state == "streaming":  # a generator iterated once, then left alone
        gen = ctx.generate(GREEDY, max_tokens=120, ignore_eos=True)
        async for _ in gen:
            break
        return ctx, gen
    assert state == "released"
    await ctx.release()
    return ctx, None


@pytest.mark.parametrize("state", ["new", "flushed", "streaming", "released"])
async def test_every_operation_in_every_state_is_bounded(tiny_folder, transport, state):
    async with sdk_owners(tiny_folder, transport, 1) as ((rt,), engine):
        names = list(_operations(rt, Context(rt)))
        for name in names:
            ctx, gen = await _context_in(rt, state)
            err = await _bounded(_operations(rt, ctx)[name])
            if state == "released" and name not in ("open", "take", "delete", "snapshots",
                                                     "stats", "release"):
                assert isinstance(err, ContextClosed), (name, err)
            if gen is not None:  # the generation it interrupted ends in bounded time too
                with anyio.fail_after(BOUND):
                    try:
                        await gen.text()
                    except ContextClosed:
                        assert name == "release"
            await _bounded(ctx.release)
            await _bounded(lambda: Context.delete(rt, "liveness"))
        await _settled(engine)


async def test_every_operation_after_the_runtime_closed_raises_at_once(tiny_folder, transport):
    async with sdk_owners(tiny_folder, transport, 1) as ((keeper,), engine):
        for name in _operations(keeper, Context(keeper)):
            async with new_runtime(engine, transport) as rt:
                ctx = Context(rt).user("hello")
                await ctx.flush()
                gen = ctx.generate(GREEDY, max_tokens=50, ignore_eos=True)
            with anyio.fail_after(2):
                err = await _bounded(_operations(rt, ctx)[name])
            if name in ("snapshots", "stats", "open", "take", "delete"):
                assert isinstance(err, ProtocolError), (name, err)
            elif name not in ("release", "seq_len", "pending_tokens"):
                assert isinstance(err, ContextClosed), (name, err)
            with pytest.raises(ContextClosed), anyio.fail_after(2):
                await gen.text()
        engine.store.check_invariants()


async def test_leaving_async_with_closes_an_open_generator(tiny_folder, transport):
    async with sdk_owners(tiny_folder, transport, 1) as ((rt,), engine):
        with anyio.fail_after(BOUND):
            async with Context(rt).user("go on") as ctx:
                gen = ctx.generate(GREEDY, max_tokens=500, ignore_eos=True)
                async for _ in gen:
                    break
        with pytest.raises(ContextClosed):
            await gen.text()
        assert gen.finish_reason == "cancelled"
        await _settled(engine)


async def test_release_cancels_a_generation_being_iterated_elsewhere(tiny_folder, transport):
    async with sdk_owners(tiny_folder, transport, 1) as ((rt,), engine):
        ctx = Context(rt).user("a long story please")
        gen = ctx.generate(GREEDY, max_tokens=2000, ignore_eos=True)
        seen: list[str] = []
        outcome: list[BaseException] = []

        async def consume() -> None:
            try:
                async for delta in gen:
                    seen.append(delta.text)
            except ContextClosed as err:
                outcome.append(err)

        with anyio.fail_after(BOUND):
            async with anyio.create_task_group() as tg:
                tg.start_soon(consume)
                while len(seen) < 3:
                    await anyio.sleep(0.01)
                await ctx.release()
        assert outcome and "released" in str(outcome[0])


async def test_an_abandoned_generator_does_not_block_the_next_operation(tiny_folder, transport):
    async with sdk_owners(tiny_folder, transport, 1) as ((rt,), _):
        ctx = Context(rt).user("hi").cue()
        prompt = len(ctx.pending_tokens)
        gen = ctx.generate(GREEDY, max_tokens=30, ignore_eos=True)
        async for _ in gen:
            break
        with anyio.fail_after(BOUND):
            await ctx.flush()  # runs after the generation, which it reads to the end
        assert gen.finish_reason == "length"
        # the flush wrote the generation's last (pending) token too
        assert ctx.seq_len == prompt + 30 and ctx.pending_tokens == []
        text = await gen.text()  # everything is still there for the consumer
        assert text == gen.text_out and len(gen.tokens_out) == 30
