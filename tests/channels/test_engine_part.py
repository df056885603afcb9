"""The engine's channels part on its own: ordering, exactly-once, bounds, leases, cleanup.

Every test ends with ``check_invariants`` (a message is in exactly one place, the byte and
namespace counts match, nothing idle is kept)."""

from __future__ import annotations

import anyio
import pytest

from pie_ctx.proto.errors import (
    InvalidArgument,
    ProtocolError,
    SubscriptionLagged,
    TooManyChannels,
)
from runtime.engine.channels import MESSAGE_OVERHEAD, ChannelLimits, Channels, Message

A, B = object(), object()  # two owners


def msg(i: int | str) -> Message:
    return Message(str(i).encode(), text=True)


async def test_one_queue_delivers_each_message_once_in_order_to_two_receivers() -> None:
    ch = Channels(ChannelLimits())
    got: dict[object, list[bytes]] = {A: [], B: []}
    leases = iter(range(1, 1000))

    async def receiver(owner: object, n: int) -> None:
        for _ in range(n):
            lease = next(leases)
            got[owner].append((await ch.receive(owner, "ns", "q", lease)).payload)
            ch.settle(owner, lease, delivered=True)
            await anyio.sleep(0)

    async with anyio.create_task_group() as tg:
        tg.start_soon(receiver, A, 10)
        tg.start_soon(receiver, B, 10)
        await anyio.sleep(0.01)
        for i in range(20):
            await ch.send(None, "ns", "q", msg(i))
    every = sorted(got[A] + got[B], key=int)
    assert every == [str(i).encode() for i in range(20)]  # each exactly once
    for mine in got.values():
        assert mine == sorted(mine, key=int) and mine  # in order, both served
    assert ch.num_channels == ch.num_messages == ch.num_bytes == 0
    ch.check_invariants()


async def test_a_full_queue_makes_senders_wait_first_come_first_served() -> None:
    ch = Channels(ChannelLimits(max_queue_messages=2))
    await ch.send(A, "ns", "q", msg(0))
    await ch.send(A, "ns", "q", msg(1))
    done: list[int] = []

    async def send(i: int) -> None:
        await ch.send(A, "ns", "q", msg(i))
        done.append(i)

    async with anyio.create_task_group() as tg:
        tg.start_soon(send, 2)
        await anyio.sleep(0.01)
        tg.start_soon(send, 3)
        await anyio.sleep(0.01)
        assert done == [] and ch.num_messages == 2
        assert (await ch.receive(B, "ns", "q", 1)).payload == b"0"
        await anyio.sleep(0.01)
        assert done == [2]  # room for one: the first waiting sender
        assert (await ch.receive(B, "ns", "q", 2)).payload == b"1"
    assert done == [2, 3]
    # a cancelled send changes nothing
    with anyio.move_on_after(0.02) as scope:
        await ch.send(A, "ns", "q", msg(9))
    assert scope.cancelled_caught
    payloads = []
    for lease in (3, 4):
        payloads.append((await ch.receive(B, "ns", "q", lease)).payload)
    for lease in range(1, 5):
        ch.settle(B, lease, delivered=True)
    assert payloads == [b"2", b"3"] and ch.num_channels == ch.num_bytes == 0
    ch.check_invariants()


async def test_the_byte_budget_is_shared_and_freed_only_when_a_message_is_confirmed() -> None:
    size = 100
    ch = Channels(ChannelLimits(max_message_bytes=size, max_channel_bytes=size + MESSAGE_OVERHEAD))
    big = Message(b"x" * size)
    await ch.send(A, "ns", "q1", big)
    sent = anyio.Event()

    async def send_other() -> None:
        await ch.send(A, "other-ns", "q2", big)
        sent.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(send_other)
        await anyio.sleep(0.01)
        assert not sent.is_set()  # another namespace's queue, the same engine budget
        await ch.receive(B, "ns", "q1", 1)
        await anyio.sleep(0.01)
        assert not sent.is_set()  # taken but not confirmed: its bytes still count
        ch.settle(B, 1, delivered=True)
        with anyio.fail_after(1):
            await sent.wait()
    assert ch.num_bytes == big.cost
    ch.check_invariants()


async def test_names_cost_nothing_when_idle_and_a_namespace_has_at_most_max_channels() -> None:
    ch = Channels(ChannelLimits(max_channels=2))
    await ch.send(A, "ns", "a", msg(1))
    sid = ch.subscribe(A, "ns", "t")
    with pytest.raises(TooManyChannels, match="max_channels"):
        await ch.send(A, "ns", "c", msg(1))
    with pytest.raises(TooManyChannels):
        await ch.receive(A, "ns", "c", 1)
    await ch.send(A, "ns2", "c", msg(1))  # another namespace has its own count
    ch.check_invariants()
    await ch.receive(B, "ns", "a", 1)
    ch.settle(B, 1, delivered=True)
    ch.unsubscribe(A, sid)
    for name in ("x", "y"):  # a drained queue or topic frees its name
        await ch.send(A, "ns", name, msg(1))
    assert ch.num_channels == 3
    ch.check_invariants()


async def test_a_lease_given_back_returns_to_the_front_and_an_owner_leaving_gives_all_back() -> None:
    ch = Channels(ChannelLimits(max_queue_messages=3))
    for i in range(3):
        await ch.send(A, "ns", "q", msg(i))
    m0 = await ch.receive(B, "ns", "q", 1)
    with pytest.raises(InvalidArgument, match="lease 1 is already held"):
        await ch.receive(B, "ns", "q", 1)
    ch.settle(B, 1, delivered=False)
    ch.settle(B, 1, delivered=False)  # idempotent
    assert (await ch.receive(B, "ns", "q", 2)) == m0
    await ch.receive(B, "ns", "q", 3)
    await ch.send(A, "ns", "q", msg(3))  # room: a taken message leaves the queue
    ch.release_owner(B)  # two leases, taken in order 0 then 1: back in that order
    got = []
    for lease in range(1, 5):
        got.append((await ch.receive(A, "ns", "q", lease)).payload)
        ch.settle(A, lease, delivered=True)
    assert got == [b"0", b"1", b"2", b"3"]
    ch.check_invariants()


async def test_a_cancelled_receive_takes_nothing_and_an_owner_leaving_ends_its_waits() -> None:
    ch = Channels(ChannelLimits())
    with anyio.move_on_after(0.02):
        await ch.receive(B, "ns", "q", 1)
    assert ch.num_channels == 0  # the queue existed only while someone waited
    await ch.send(A, "ns", "q", msg("kept"))
    assert (await ch.receive(A, "ns", "q", 1)).payload == b"kept"
    ch.settle(A, 1, delivered=True)

    async def wait_forever() -> None:
        with pytest.raises(ProtocolError, match="runtime closed"):
            await ch.receive(B, "ns", "q", 2)

    async with anyio.create_task_group() as tg:
        tg.start_soon(wait_forever)
        await anyio.sleep(0.01)
        ch.release_owner(B)
    assert ch.num_channels == 0
    ch.check_invariants()


async def test_broadcast_reaches_present_subscriptions_and_a_slow_one_lags() -> None:
    ch = Channels(ChannelLimits(max_queue_messages=2))
    early = ch.subscribe(A, "ns", "t")
    assert ch.broadcast("ns", "t", msg(0)) == 1
    late = ch.subscribe(B, "ns", "t")
    for i in range(1, 5):
        assert ch.broadcast("ns", "t", msg(i)) == 2
    assert ch.broadcast("ns", "nobody", msg(9)) == 0
    assert ch.num_messages == 4  # two buffers of two: the oldest were dropped
    with pytest.raises(SubscriptionLagged, match="missed 3 message"):
        await ch.next(A, early, 1)
    with pytest.raises(SubscriptionLagged, match="missed 2 message"):
        await ch.next(B, late, 1)
    got = [(await ch.next(B, late, n)).payload for n in (1, 2)]
    assert got == [b"3", b"4"]  # the late one never saw 0
    ch.settle(B, 2, delivered=False)  # given back to its subscription's front
    assert (await ch.next(B, late, 3)).payload == b"4"
    with pytest.raises(InvalidArgument, match="unknown or closed"):
        await ch.next(B, early, 9)  # another owner's subscription
    ch.release_owner(B)
    assert ch.num_subscriptions == 1
    ch.check_invariants()

    async def wait_next() -> None:
        with pytest.raises(InvalidArgument, match="was closed"):
            await ch.next(A, early, 10)

    async with anyio.create_task_group() as tg:
        for n in (1, 2):
            await ch.next(A, early, 100 + n)
            ch.settle(A, 100 + n, delivered=True)
        tg.start_soon(wait_next)
        await anyio.sleep(0.01)
        ch.unsubscribe(A, early)
    assert ch.num_channels == ch.num_subscriptions == ch.num_bytes == 0
    ch.check_invariants()


async def test_subscriptions_per_owner_are_bounded() -> None:
    ch = Channels(ChannelLimits(max_subscriptions=2))
    ch.subscribe(A, "ns", "t")
    ch.subscribe(A, "ns", "u")
    with pytest.raises(TooManyChannels, match="max_subscriptions"):
        ch.subscribe(A, "ns", "t")
    ch.subscribe(B, "ns", "t")
    ch.release_owner(A)
    assert ch.num_subscriptions == 1 and ch.num_channels == 1
    ch.check_invariants()


def test_limits_are_checked() -> None:
    with pytest.raises(InvalidArgument, match="max_queue_messages"):
        ChannelLimits(max_queue_messages=0)
    with pytest.raises(InvalidArgument, match="hold at least one message"):
        ChannelLimits(max_message_bytes=1000, max_channel_bytes=1000)
