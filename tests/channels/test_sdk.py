"""Channels through the SDK, in-process and over the server's socket (``transport``):
order, exactly-once, broadcast, back-pressure, typed errors, cancellation, cleanup."""

from __future__ import annotations

import random
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest

from pie_ctx import Runtime
from pie_ctx.errors import InvalidArgument, MessageTooLarge, ProtocolError, SubscriptionLagged
from pie_ctx.proto import messages as P
from pie_ctx.transport import LocalTransport
from runtime.engine.channels import ChannelLimits
from tests.sdk.harness import _ADDRESSES, new_runtime, sdk_owners

pytestmark = pytest.mark.fp32_only("channels carry bytes; no dtype changes them")


async def settled(engine: Any, **expected: int) -> None:
    """Wait until the engine's channel counters read ``expected``, then check invariants."""
    with anyio.fail_after(5):
        while any(getattr(engine.stats(), k) != v for k, v in expected.items()):
            await anyio.sleep(0.005)
    engine.channels.check_invariants()


async def test_messages_arrive_in_order_as_the_type_they_were_sent(tiny_folder, transport):
    async with sdk_owners(tiny_folder, transport, 2) as ((a, b), engine):
        sent = ["one", b"two", "", b"", "tr\u00e8s \U0001f600", bytes(range(256))]
        for m in sent:
            await a.send("jobs", m)
        got = [await b.receive("jobs") for _ in sent]
        assert got == sent and [type(m) for m in got] == [type(m) for m in sent]
        await a.send("jobs", "last")
        async for m in b.receive("jobs"):
            assert m == "last"
            break
        await settled(engine, num_channels=0, num_channel_messages=0, channel_bytes=0)


async def test_each_message_goes_to_exactly_one_of_two_receivers(tiny_folder, transport):
    n = 40
    async with sdk_owners(tiny_folder, transport, 3) as ((a, b, c), engine):
        got: dict[str, list[int]] = {"b": [], "c": []}
        all_in = anyio.Event()

        async def drain(rt: Runtime, name: str) -> None:
            async for m in rt.receive("q"):
                got[name].append(int(m))
                if sum(map(len, got.values())) == n:
                    all_in.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(drain, b, "b")
            tg.start_soon(drain, c, "c")
            for i in range(n):
                await a.send("q", str(i))
                await anyio.sleep(0.002)  # let both receivers queue up to take the next
            with anyio.fail_after(10):
                await all_in.wait()
            tg.cancel_scope.cancel()
        assert sorted(got["b"] + got["c"]) == list(range(n))
        assert got["b"] and got["c"] and all(v == sorted(v) for v in got.values())
        await settled(engine, num_channels=0, num_channel_messages=0)


async def test_broadcast_reaches_every_present_subscriber_and_no_later_one(tiny_folder, transport):
    async with sdk_owners(tiny_folder, transport, 3) as ((a, b, c), engine):
        sub_b = await b.subscribe("news")  # registered when the await returns
        assert sub_b.subscribed
        async with c.subscribe("news") as sub_c:
            assert await a.broadcast("news", "first") == 2
            late = await a.subscribe("news")
            assert await a.broadcast("news", b"second") == 3
            assert [await sub_b.receive(), await sub_b.receive()] == ["first", b"second"]
            assert [await sub_c.receive(), await sub_c.receive()] == ["first", b"second"]
            assert await late.receive() == b"second"  # never saw "first"
        assert sub_c.closed
        await settled(engine, num_subscriptions=2, num_channel_messages=0)
        assert await a.broadcast("nobody-listens", "x") == 0

        heard: list[Any] = []

        async def bare_loop() -> None:  # subscribes at its first step, closes at its end
            async for m in b.subscribe("alerts"):
                heard.append(m)
                break

        async with anyio.create_task_group() as tg:
            tg.start_soon(bare_loop)
            await settled(engine, num_subscriptions=3)
            assert await a.broadcast("alerts", "fire") == 1
        assert heard == ["fire"]
        await settled(engine, num_subscriptions=2)
        await sub_b.aclose()
        await late.aclose()
        await late.aclose()  # twice is a no-op
        await settled(engine, num_subscriptions=0, num_channels=0, channel_bytes=0)


async def test_a_slow_subscriber_lags_and_never_stalls_the_broadcaster(tiny_folder, transport):
    limits = ChannelLimits(max_queue_messages=2)
    async with sdk_owners(tiny_folder, transport, 2, channel_limits=limits) as ((a, b), engine):
        sub = await b.subscribe("ticks")
        for i in range(5):
            assert await a.broadcast("ticks", str(i)) == 1  # never waits
        assert engine.stats().num_channel_messages == 2  # bounded: the newest two
        got = []
        with pytest.raises(SubscriptionLagged, match="missed 3 message"):
            async for m in sub:
                got.append(m)
        async for m in sub:  # it goes on with what it still holds
            got.append(m)
            if m == "4":
                break
        assert got == ["3", "4"] and sub.subscribed
        await sub.aclose()
        await settled(engine, num_channels=0, num_channel_messages=0)


async def test_a_blocked_sender_resumes_when_a_receiver_takes_one(tiny_folder, transport):
    limits = ChannelLimits(max_queue_messages=2)
    async with sdk_owners(tiny_folder, transport, 2, channel_limits=limits) as ((a, b), engine):
        assert a.info.max_queue_messages == 2 and b.info.max_channels == limits.max_channels
        await a.send("q", "0")
        await a.send("q", "1")
        third_sent = anyio.Event()

        async def third() -> None:
            await a.send("q", "2")
            third_sent.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(third)
            await anyio.sleep(0.1)
            assert not third_sent.is_set() and engine.stats().num_channel_messages == 2
            assert await b.receive("q") == "0"
            with anyio.fail_after(5):
                await third_sent.wait()
        with anyio.move_on_after(0.1) as scope:  # a cancelled send sends nothing
            await a.send("q", "never")
        assert scope.cancelled_caught
        assert [await b.receive("q"), await b.receive("q")] == ["1", "2"]
        await settled(engine, num_channels=0, num_channel_messages=0)


async def test_an_oversize_message_is_a_typed_error_that_changes_nothing(tiny_folder, transport):
    limits = ChannelLimits(max_message_bytes=100)
    async with sdk_owners(tiny_folder, transport, 2, channel_limits=limits) as ((a, b), engine):
        assert a.info.max_message_bytes == 100
        sub = await b.subscribe("t")
        with pytest.raises(MessageTooLarge, match="over the engine's limit of 100"):
            await a.send("q", b"x" * 101)
        with pytest.raises(MessageTooLarge):
            await a.broadcast("t", "\u00e9" * 51)  # 102 bytes of UTF-8
        with pytest.raises(MessageTooLarge):  # the engine checks too, and the class crosses
            await a.transport.request(P.ChannelSend(channel="q", payload=b"x" * 101))
        with pytest.raises(InvalidArgument, match="str or bytes"):
            await a.send("q", 5)
        with pytest.raises(InvalidArgument, match="channel names"):
            a.receive("bad\nname")
        with pytest.raises(InvalidArgument, match="topic names"):
            a.subscribe("")
        assert engine.stats().num_channel_messages == 0
        await a.send("q", b"x" * 100)
        assert await b.receive("q") == b"x" * 100
        await sub.aclose()
        await settled(engine, num_channels=0, num_channel_messages=0)


class _StallAfterReceive:
    """A runtime's transport, except that a channel receive stalls once its reply is in:
    cancelling it then crosses a message the engine has already handed over."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.stalled = anyio.Event()
        self.info, self.tokenizer = inner.info, inner.tokenizer

    async def request(self, req: Any) -> Any:
        reply = await self._inner.request(req)
        if isinstance(req, P.ChannelReceive):
            self.stalled.set()
            await anyio.sleep_forever()
        return reply

    async def aclose(self) -> None:
        pass


async def test_a_cancelled_receive_loses_nothing(tiny_folder, transport):
    async with sdk_owners(tiny_folder, transport, 2) as ((a, b), engine):
        # The reply crossed the cancel: the SDK gives the message back, at the front.
        stalling = _StallAfterReceive(b.transport)
        async with anyio.create_task_group() as tg:
            rt = Runtime(stalling, tg)
            tg.start_soon(rt.receive("q").receive)
            await a.send("q", "precious")
            await a.send("q", "next")
            with anyio.fail_after(5):
                await stalling.stalled.wait()
            tg.cancel_scope.cancel()
        with anyio.fail_after(5):  # a lost message would leave us waiting here
            assert [await a.receive("q"), await a.receive("q")] == ["precious", "next"]
        await settled(engine, num_channel_messages=0)

        # Receives cancelled at random moments while messages flow: none lost, none twice.
        rng = random.Random(5)
        n, got = 60, []
        async with anyio.create_task_group() as tg:

            async def produce() -> None:
                for i in range(n):
                    await a.send("flow", str(i))
                    await anyio.sleep(rng.random() * 0.002)

            tg.start_soon(produce)
            with anyio.fail_after(20):  # a lost message would leave us waiting here
                while len(got) < n:
                    with anyio.move_on_after(rng.random() * 0.003):
                        got.append(int(await b.receive("flow")))
        assert got == list(range(n))  # one receiver: in order, exactly once
        await settled(engine, num_channels=0, num_channel_messages=0)


async def test_closing_a_runtime_ends_its_waits_and_subscriptions(tiny_folder, transport):
    async with sdk_owners(tiny_folder, transport, 1) as ((a,), engine):
        async with anyio.create_task_group() as tg:
            async with new_runtime(engine, transport) as b:

                async def wait_forever() -> None:
                    with pytest.raises(ProtocolError):
                        await b.receive("q")

                sub = await b.subscribe("t")
                tg.start_soon(wait_forever)
                await a.broadcast("t", "unread")
                await settled(engine, num_channels=2, num_subscriptions=1)
        assert not sub.subscribed or b.closed
        await settled(engine, num_channels=0, num_subscriptions=0, num_channel_messages=0)
        for i in range(3):  # nobody reads: they wait, bounded, for the next receiver
            await a.send("q", str(i))
        async with new_runtime(engine, transport) as c:
            assert [await c.receive("q") for _ in range(3)] == ["0", "1", "2"]
        await settled(engine, num_channels=0, num_channel_messages=0)


@asynccontextmanager
async def _in_namespace(engine: Any, transport: str, namespace: str):
    if transport == "local":
        async with anyio.create_task_group() as tg:
            local = LocalTransport(engine, namespace=f"default/{namespace}")
            yield Runtime(local, tg)
            await local.aclose()
    else:
        async with Runtime.connect(_ADDRESSES[id(engine)], namespace=namespace) as rt:
            yield rt


async def test_channels_are_namespaced_like_snapshots(tiny_folder, transport):
    async with sdk_owners(tiny_folder, transport, 1) as ((a,), engine):
        async with _in_namespace(engine, transport, "team") as other:
            await a.send("q", "for default")
            await other.send("q", "for team")
            assert await other.receive("q") == "for team"
            assert await a.receive("q") == "for default"
            sub = await other.subscribe("t")
            assert await a.broadcast("t", "x") == 0
            await sub.aclose()
        await settled(engine, num_channels=0, num_channel_messages=0)
