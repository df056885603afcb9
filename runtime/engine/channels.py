"""Channels between inferlets: queues (send/receive) and topics (broadcast/subscribe).

Owns every channel of every namespace: the queues and the messages in them, the topics and
their subscriptions (each with a bounded buffer), the messages a receive has taken but its
receiver has not yet confirmed (*leases*), and the byte budget all of these share. The
engine's handlers check every input (names, sizes, lease ids) before calling in; this part
trusts them. Plain Python over anyio events: no torch, no pages.

Invariants (``check_invariants`` asserts them):

* A message is in exactly one place: a queue, a subscription's buffer, or a lease. It
  counts ``len(payload) + MESSAGE_OVERHEAD`` bytes against ``max_channel_bytes`` from the
  moment it is queued until its receiver confirms it (or it is dropped).
* A queue exists while it holds a message or has a waiting sender or receiver; a topic
  exists while it has a subscription. A name nobody uses costs nothing, and a namespace has
  at most ``max_channels`` queues and topics at once (a message given back may recreate
  its queue beyond that count: it was counted before).
* A queue holds at most ``max_queue_messages`` sent messages, plus any given back; senders
  wait for room (and for the byte budget) first come first served, receivers take first
  come first served, and every wait is cancellable and changes nothing when cancelled.
* A subscription's buffer holds at most ``max_queue_messages``: a broadcast to a full one
  drops its oldest message and counts it, and the subscriber's next receive raises
  ``SubscriptionLagged`` once. A broadcast never waits.
* ``release_owner`` gives every lease of the owner back to the front of its queue (in the
  order they were taken), closes the owner's subscriptions and ends its waiting calls.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field, fields
from typing import Any

import anyio

from pie_ctx.proto import checks
from pie_ctx.proto.errors import (
    InvalidArgument,
    PieError,
    ProtocolError,
    SubscriptionLagged,
    TooManyChannels,
)

__all__ = ["ChannelLimits", "Channels", "Message", "MESSAGE_OVERHEAD"]

MESSAGE_OVERHEAD = 64  # bytes a held message counts beyond its payload (its bookkeeping)

Key = tuple[str, str]  # (namespace, name)


@dataclass(frozen=True, slots=True)
class ChannelLimits:
    """The bounds of every channel, reported in ``EngineInfo`` (docs/messages.md).

    Raises:
        InvalidArgument: a bound is not a positive int, or the byte budget cannot hold one
            message of the largest size.
    """

    max_message_bytes: int = 1 << 20  # the largest payload
    max_queue_messages: int = 64  # per queue, and per subscription's buffer
    max_channels: int = 1024  # queues and topics in use at once, per namespace
    max_subscriptions: int = 64  # per owner
    max_channel_bytes: int = 256 << 20  # every held message, engine-wide

    def __post_init__(self) -> None:
        for f in fields(self):
            checks.positive(getattr(self, f.name), f.name)
        if self.max_channel_bytes < self.max_message_bytes + MESSAGE_OVERHEAD:
            raise InvalidArgument("max_channel_bytes must hold at least one message of "
                                  "max_message_bytes")


@dataclass(frozen=True, slots=True)
class Message:
    """One message: its bytes, and whether they are UTF-8 text (the receiver gets a str)."""

    payload: bytes
    text: bool = False

    @property
    def cost(self) -> int:
        """What it counts against the byte budget."""
        return len(self.payload) + MESSAGE_OVERHEAD


@dataclass(slots=True, eq=False)
class _Waiter:
    """One waiting call; ``ended`` is set (and the event fired) when it must give up."""

    owner: Any
    event: Any = None
    ended: PieError | None = None


@dataclass(slots=True, eq=False)
class _Queue:
    key: Key
    messages: deque[Message] = field(default_factory=deque)
    senders: deque[_Waiter] = field(default_factory=deque)
    receivers: deque[_Waiter] = field(default_factory=deque)

    @property
    def is_idle(self) -> bool:
        return not (self.messages or self.senders or self.receivers)


@dataclass(slots=True, eq=False)
class _Subscription:
    sid: int
    owner: Any
    key: Key
    buffer: deque[Message] = field(default_factory=deque)
    receivers: deque[_Waiter] = field(default_factory=deque)
    lagged: int = 0  # messages dropped since its last receive
    closed: bool = False


@dataclass(slots=True)
class _Lease:
    message: Message
    source: Key | _Subscription  # where it goes back to


_PENDING = None  # a lease id reserved by a receive still waiting


class Channels:
    """Every queue, topic and subscription of one engine.

    Args:
        limits: the bounds (see :class:`ChannelLimits`).

    Usage (the handlers' side; ``owner`` is the caller, ``ns`` its namespace)::

        await channels.send(owner, ns, "jobs", Message(b"x"))
        msg = await channels.receive(owner, ns, "jobs", lease=7)
        channels.settle(owner, 7, delivered=True)
        sid = channels.subscribe(owner, ns, "news"); channels.broadcast(ns, "news", msg)
    """

    def __init__(self, limits: ChannelLimits) -> None:
        self.limits = limits
        self._queues: dict[Key, _Queue] = {}
        self._topics: dict[Key, dict[int, _Subscription]] = {}
        self._in_use: Counter[str] = Counter()  # namespace -> queues + topics
        self._subs: dict[int, _Subscription] = {}
        self._subs_of: dict[Any, dict[int, _Subscription]] = {}
        self._leases: dict[Any, dict[int, _Lease | None]] = {}
        self._short_of_bytes: set[_Waiter] = set()  # head senders waiting for the budget
        self._next_sid = 1
        self.num_bytes = 0  # held bytes, counted as Message.cost
        self.num_messages = 0

    # ------------------------------------------------------------------------- counts

    @property
    def num_channels(self) -> int:
        """Queues and topics in use, every namespace."""
        return len(self._queues) + len(self._topics)

    @property
    def num_subscriptions(self) -> int:
        return len(self._subs)

    # ------------------------------------------------------------------------- queues

    async def send(self, owner: Any, ns: str, name: str, message: Message) -> None:
        """Put ``message`` at the back of queue ``name``, waiting for room.

        Raises:
            TooManyChannels: the queue is new and the namespace has no room for it.
        """
        queue = self._queue((ns, name))
        me = _Waiter(owner)
        queue.senders.append(me)
        try:
            while not self._can_send(queue, me, message):
                await self._wait(me)
        except BaseException:
            self._short_of_bytes.discard(me)
            self._leave(queue.senders, me)
            self._drop_if_idle(queue)
            raise
        self._short_of_bytes.discard(me)
        queue.senders.popleft()
        self._hold(message)
        queue.messages.append(message)
        _wake_head(queue.receivers)
        _wake_head(queue.senders)

    def _can_send(self, queue: _Queue, me: _Waiter, message: Message) -> bool:
        if queue.senders[0] is not me or len(queue.messages) >= self.limits.max_queue_messages:
            return False
        if self.num_bytes + message.cost > self.limits.max_channel_bytes:
            self._short_of_bytes.add(me)
            return False
        return True

    async def receive(self, owner: Any, ns: str, name: str, lease: int) -> Message:
        """Take the message at the front of queue ``name``, waiting for one; it is held
        under ``lease`` until :meth:`settle`.

        Raises:
            InvalidArgument: ``lease`` is already held by this owner.
            TooManyChannels: the queue is new and the namespace has no room for it.
        """
        self._reserve(owner, lease)
        try:
            queue = self._queue((ns, name))
        except BaseException:
            self._unreserve(owner, lease)
            raise
        me = _Waiter(owner)
        queue.receivers.append(me)
        try:
            while not (queue.receivers[0] is me and queue.messages):
                await self._wait(me)
        except BaseException:
            self._leave(queue.receivers, me)
            self._drop_if_idle(queue)
            self._unreserve(owner, lease)
            raise
        queue.receivers.popleft()
        message = queue.messages.popleft()
        self._leases[owner][lease] = _Lease(message, queue.key)
        _wake_head(queue.receivers)
        _wake_head(queue.senders)
        self._drop_if_idle(queue)
        return message

    # ------------------------------------------------------------------------- topics

    def subscribe(self, owner: Any, ns: str, topic: str) -> int:
        """A new subscription to ``topic``: it gets every later broadcast.

        Raises:
            TooManyChannels: the owner holds ``max_subscriptions``, or the topic is new and
                the namespace has no room for it.
        """
        mine = self._subs_of.get(owner, {})
        if len(mine) >= self.limits.max_subscriptions:
            raise TooManyChannels(
                f"you hold {len(mine)} subscriptions, the most one runtime may "
                "(max_subscriptions): close those you no longer read (async with "
                "rt.subscribe(...) closes one for you)")
        key = (ns, topic)
        subs = self._topics.get(key)
        if subs is None:
            self._check_room(ns)
            subs = self._topics[key] = {}
            self._in_use[ns] += 1
        sub = _Subscription(self._next_sid, owner, key)
        self._next_sid += 1
        subs[sub.sid] = self._subs[sub.sid] = sub
        self._subs_of.setdefault(owner, {})[sub.sid] = sub
        return sub.sid

    def broadcast(self, ns: str, topic: str, message: Message) -> int:
        """Give ``message`` to every subscription of ``topic`` now; a full buffer drops its
        oldest message (so does one the byte budget cannot take this one into).

        Returns:
            How many subscriptions the topic had.
        """
        subs = self._topics.get((ns, topic))
        if not subs:
            return 0
        freed = False
        for sub in subs.values():
            while len(sub.buffer) >= self.limits.max_queue_messages:
                self._drop(sub.buffer.popleft())
                sub.lagged += 1
                freed = True
            if self.num_bytes + message.cost > self.limits.max_channel_bytes:
                sub.lagged += 1
            else:
                self._hold(message)
                sub.buffer.append(message)
            _wake_head(sub.receivers)
        if freed:
            self._bytes_freed()
        return len(subs)

    async def next(self, owner: Any, sid: int, lease: int) -> Message:
        """Take the oldest message of subscription ``sid``, waiting for one; it is held
        under ``lease`` until :meth:`settle`.

        Raises:
            InvalidArgument: no such subscription of this owner (or it closed meanwhile),
                or ``lease`` is already held.
            SubscriptionLagged: broadcasts dropped messages since the last receive (once).
        """
        sub = self._subscription(owner, sid)
        self._reserve(owner, lease)
        me = _Waiter(owner)
        sub.receivers.append(me)
        try:
            while True:
                if sub.receivers[0] is me and sub.lagged:
                    missed, sub.lagged = sub.lagged, 0
                    raise SubscriptionLagged(
                        f"the subscription to {sub.key[1]!r} missed {missed} message(s): its "
                        f"buffer of {self.limits.max_queue_messages} was full (or the "
                        "engine's message budget was); it goes on with the oldest message "
                        "it still holds")
                if sub.receivers[0] is me and sub.buffer:
                    break
                await self._wait(me)
        except BaseException:
            self._leave(sub.receivers, me)
            self._unreserve(owner, lease)
            raise
        sub.receivers.popleft()
        message = sub.buffer.popleft()
        self._leases[owner][lease] = _Lease(message, sub)
        _wake_head(sub.receivers)
        return message

    def unsubscribe(self, owner: Any, sid: int) -> None:
        """Close subscription ``sid``: its buffer is dropped and its waiting calls end.

        Raises:
            InvalidArgument: no such subscription of this owner.
        """
        self._close(self._subscription(owner, sid))
        self._bytes_freed()

    # ------------------------------------------------------------------------- leases

    def settle(self, owner: Any, lease: int, delivered: bool) -> None:
        """End a lease: ``delivered`` drops its message for good, otherwise the message goes
        back to the front of its queue (or subscription). Unknown leases are ignored."""
        leases = self._leases.get(owner)
        entry = leases.get(lease) if leases else None
        if entry is None:
            return  # unknown, settled already, or its receive is still waiting
        del leases[lease]  # type: ignore[union-attr]
        if not leases:
            del self._leases[owner]
        if delivered:
            self._drop(entry.message)
            self._bytes_freed()
        else:
            self._give_back(entry)

    def release_owner(self, owner: Any) -> None:
        """Everything of one owner that left: leases back to the front of their queues,
        subscriptions closed, waiting calls ended."""
        leases = self._leases.pop(owner, {})
        for entry in reversed(list(leases.values())):  # newest first: the order is kept
            if entry is not None:
                self._give_back(entry)
        for sub in list(self._subs_of.get(owner, {}).values()):
            self._close(sub)
        gone = ProtocolError("the runtime closed while waiting on a channel")
        for queue in self._queues.values():
            for waiter in (*queue.senders, *queue.receivers):
                if waiter.owner == owner:
                    _end(waiter, gone)
        self._bytes_freed()

    # ---------------------------------------------------------------------- internals

    def _check_room(self, ns: str) -> None:
        if self._in_use[ns] >= self.limits.max_channels:
            raise TooManyChannels(
                f"this namespace already has {self._in_use[ns]} queues and topics in use "
                "(max_channels): drain queues nobody reads, close subscriptions, or use "
                "fewer names")

    def _queue(self, key: Key, *, over_limit: bool = False) -> _Queue:
        queue = self._queues.get(key)
        if queue is None:
            if not over_limit:
                self._check_room(key[0])
            queue = self._queues[key] = _Queue(key)
            self._in_use[key[0]] += 1
        return queue

    def _drop_if_idle(self, queue: _Queue) -> None:
        if queue.is_idle and self._queues.get(queue.key) is queue:
            del self._queues[queue.key]
            self._forget_one(queue.key[0])

    def _forget_one(self, ns: str) -> None:
        self._in_use[ns] -= 1
        if not self._in_use[ns]:
            del self._in_use[ns]

    def _subscription(self, owner: Any, sid: Any) -> _Subscription:
        sub = self._subs.get(sid) if checks.is_int(sid) else None
        if sub is None or sub.owner != owner:
            raise InvalidArgument(f"subscription {sid!r} is unknown or closed; subscribe again")
        return sub

    def _close(self, sub: _Subscription) -> None:
        sub.closed = True
        del self._subs[sub.sid]
        mine = self._subs_of[sub.owner]
        del mine[sub.sid]
        if not mine:
            del self._subs_of[sub.owner]
        subs = self._topics[sub.key]
        del subs[sub.sid]
        if not subs:
            del self._topics[sub.key]
            self._forget_one(sub.key[0])
        while sub.buffer:
            self._drop(sub.buffer.popleft())
        closed = InvalidArgument(f"subscription {sub.sid} was closed; subscribe again")
        for waiter in sub.receivers:
            _end(waiter, closed)

    def _reserve(self, owner: Any, lease: int) -> None:
        leases = self._leases.setdefault(owner, {})
        if lease in leases:
            raise InvalidArgument(f"lease {lease} is already held: pick an id you do not hold "
                                  "(settle a message before reusing its lease id)")
        leases[lease] = _PENDING

    def _unreserve(self, owner: Any, lease: int) -> None:
        leases = self._leases.get(owner)
        if leases is not None and lease in leases and leases[lease] is _PENDING:
            del leases[lease]
            if not leases:
                del self._leases[owner]

    def _give_back(self, entry: _Lease) -> None:
        source = entry.source
        if isinstance(source, _Subscription):
            if source.closed:
                self._drop(entry.message)
                self._bytes_freed()
                return
            source.buffer.appendleft(entry.message)
            _wake_head(source.receivers)
            return
        queue = self._queue(source, over_limit=True)
        queue.messages.appendleft(entry.message)
        _wake_head(queue.receivers)

    def _hold(self, message: Message) -> None:
        self.num_bytes += message.cost
        self.num_messages += 1

    def _drop(self, message: Message) -> None:
        self.num_bytes -= message.cost
        self.num_messages -= 1

    def _bytes_freed(self) -> None:
        waiting, self._short_of_bytes = self._short_of_bytes, set()
        for waiter in waiting:
            if waiter.event is not None:
                waiter.event.set()

    def _leave(self, line: deque[_Waiter], me: _Waiter) -> None:
        was_head = bool(line) and line[0] is me
        line.remove(me)
        if was_head:
            _wake_head(line)

    async def _wait(self, me: _Waiter) -> None:
        me.event = anyio.Event()
        await me.event.wait()
        if me.ended is not None:
            raise me.ended

    # ------------------------------------------------------------------------ checks

    def check_invariants(self) -> None:
        """Raise ``RuntimeError`` if the bookkeeping is inconsistent (for tests)."""
        held = [m for q in self._queues.values() for m in q.messages]
        held += [m for s in self._subs.values() for m in s.buffer]
        held += [e.message for ls in self._leases.values() for e in ls.values() if e is not None]
        if sum(m.cost for m in held) != self.num_bytes or len(held) != self.num_messages:
            raise RuntimeError("held bytes or messages out of step with the queues")
        if self.num_bytes > self.limits.max_channel_bytes:
            raise RuntimeError("over the byte budget")
        in_use = Counter(k[0] for k in [*self._queues, *self._topics])
        if in_use != self._in_use:
            raise RuntimeError(f"per-namespace counts {dict(self._in_use)} != {dict(in_use)}")
        if any(q.is_idle for q in self._queues.values()) or not all(self._topics.values()):
            raise RuntimeError("an idle queue or an empty topic was kept")
        owned = {sid for mine in self._subs_of.values() for sid in mine}
        in_topics = {sid for subs in self._topics.values() for sid in subs}
        if not owned == in_topics == set(self._subs):
            raise RuntimeError("subscriptions out of step between owners and topics")
        if any(not ls for ls in self._leases.values()):
            raise RuntimeError("an owner with no leases was kept")


def _wake_head(line: deque[_Waiter]) -> None:
    if line and line[0].event is not None:
        line[0].event.set()


def _end(waiter: _Waiter, why: PieError) -> None:
    waiter.ended = why
    if waiter.event is not None:
        waiter.event.set()
