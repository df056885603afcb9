"""Messages between inferlets, the SDK's side: ``Receiver`` and ``Subscription``.

Owns: the handles an inferlet holds on channels (a queue it receives from, a subscription
to a topic) and the lease ids receives use; no message is ever kept here: every message
waits in the engine (``runtime/engine/channels.py``) until a receive hands it over. Made by
``Runtime.receive`` / ``Runtime.subscribe``; see docs/messages.md.

Delivery: a receive takes its message under a lease and confirms it to the engine before
returning it, so a receive that is cancelled, fails, or whose process dies either took
nothing or its message goes back to the front of its queue (or subscription). Every
message is returned to exactly one receive call.

Usage::

    await rt.send("jobs", "resize cat.png")
    job = await rt.receive("jobs")                # one message
    async for job in rt.receive("jobs"): ...      # every message, as it comes
    async with rt.subscribe("news") as sub:       # subscribed from here on
        await rt.send("ready", "go")
        async for item in sub: ...
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Callable, Generator
from typing import Any

import anyio

from pie_ctx.proto import messages as P
from pie_ctx.proto.errors import InvalidArgument, PieError, ProtocolError

__all__ = ["Mailbox", "Receiver", "Subscription"]

SETTLE_TIMEOUT = 10.0  # seconds a confirmation or give-back may take before we stop waiting
# Lease ids, unique in this process: so they are unique per engine owner however many
# runtimes share one transport.
_LEASE_IDS = itertools.count(1)


class Mailbox:
    """One runtime's channel calls over its transport (internal: ``Runtime`` holds one).

    Args:
        transport: the runtime's transport.
    """

    def __init__(self, transport: Any) -> None:
        self._transport = transport

    async def request(self, req: Any) -> Any:
        return await self._transport.request(req)

    async def take(self, make: Callable[[int], Any]) -> str | bytes:
        """Run the receive ``make(lease)``; return its message once the engine confirmed
        the hand-over.

        Raises:
            PieError: the engine's error (nothing was taken), or ``ProtocolError`` if the
                connection is lost (the engine gives the message back when it notices).
        """
        lease = next(_LEASE_IDS)
        try:
            reply = await self._transport.request(make(lease))
        except PieError:
            raise  # the engine answered with an error, or is gone: nothing is held for us
        except BaseException:
            # Cancelled: the engine may have taken a message for this call already (its
            # reply crossed our Cancel). Give it back; an unknown lease is ignored.
            with anyio.move_on_after(SETTLE_TIMEOUT, shield=True):
                try:
                    await self._transport.request(P.SettleMessage(lease=lease, delivered=False))
                except PieError:
                    pass  # the connection is gone: the engine gives it back itself
            raise
        try:
            with anyio.fail_after(SETTLE_TIMEOUT, shield=True):
                await self._transport.request(P.SettleMessage(lease=lease, delivered=True))
        except TimeoutError:
            raise ProtocolError(
                f"the engine did not confirm a message within {SETTLE_TIMEOUT} s; it stays "
                "in the engine and goes back to its queue when this runtime closes") from None
        return reply.payload.decode("utf-8") if reply.text else reply.payload


class Receiver:
    """The messages of one queue, each taken by exactly one receive (made by
    ``rt.receive(channel)``).

    ``await receiver`` (that is, ``await rt.receive(channel)``) takes one message;
    ``async for message in receiver`` takes them one at a time as they come, forever (leave
    with ``break``, or bound the wait with ``anyio.move_on_after``). Holds nothing in the
    engine between receives, so it needs no closing.
    """

    def __init__(self, mailbox: Mailbox, channel: str) -> None:
        self._mailbox = mailbox
        self._channel = channel

    @property
    def channel(self) -> str:
        """The queue's name."""
        return self._channel

    async def receive(self) -> str | bytes:
        """Take the message at the front of the queue, waiting until there is one.

        Returns:
            The message, as the type it was sent as (``str`` or ``bytes``).

        Raises:
            TooManyChannels: the queue is not in use yet and the namespace has no room.
            ProtocolError: the runtime closed or its connection was lost.
        """
        channel = self._channel
        return await self._mailbox.take(lambda lease: P.ChannelReceive(channel=channel,
                                                                       lease=lease))

    def __await__(self) -> Generator[Any, None, str | bytes]:
        return self.receive().__await__()

    def __aiter__(self) -> Receiver:
        return self

    async def __anext__(self) -> str | bytes:
        return await self.receive()

    def __repr__(self) -> str:
        return f"Receiver({self._channel!r})"


class Subscription:
    """One subscription to a topic: every message broadcast to the topic while it is open
    (made by ``rt.subscribe(topic)``).

    It is registered in the engine by ``await rt.subscribe(topic)`` or by entering
    ``async with rt.subscribe(topic) as sub`` (both return only once it is, so anything
    broadcast afterwards reaches it), or by the first step of a bare
    ``async for message in rt.subscribe(topic)``. It closes on ``aclose()``, on leaving
    ``async with``, when that bare loop ends (by ``break``, ``return`` or an error), and
    when its runtime closes.

    A subscriber that falls behind loses the oldest messages of its buffer (it holds
    ``rt.info.max_queue_messages``) and its next receive raises ``SubscriptionLagged`` once,
    saying how many; it then goes on with the oldest message it still holds (iterate again
    after catching it). Broadcasters never wait for subscribers.
    """

    def __init__(self, mailbox: Mailbox, topic: str) -> None:
        self._mailbox = mailbox
        self._topic = topic
        self._sid: int | None = None
        self._closed = False
        self._lock: anyio.Lock | None = None

    @property
    def topic(self) -> str:
        """The topic's name."""
        return self._topic

    @property
    def subscribed(self) -> bool:
        """True once registered in the engine, until closed."""
        return self._sid is not None and not self._closed

    @property
    def closed(self) -> bool:
        """True once closed (by ``aclose()``, the end of its ``async with`` or bare
        ``async for``, or its runtime closing); it then receives nothing more."""
        return self._closed

    async def start(self) -> Subscription:
        """Register in the engine now (if not yet); later broadcasts reach this subscription.

        Returns:
            This subscription.

        Raises:
            InvalidArgument: it was closed.
            TooManyChannels: this runtime holds ``max_subscriptions`` already, or the topic
                is new and the namespace has no room.
        """
        if self._lock is None:
            self._lock = anyio.Lock()
        async with self._lock:
            if self._closed:
                raise InvalidArgument(f"this subscription to {self._topic!r} is closed; "
                                      "subscribe again")
            if self._sid is None:
                reply = await self._mailbox.request(P.Subscribe(topic=self._topic))
                self._sid = reply.sub
                if self._closed:  # aclose() ran while the engine registered it
                    self._closed = False
                    await self.aclose()
                    raise InvalidArgument(f"this subscription to {self._topic!r} is closed; "
                                          "subscribe again")
        return self

    async def receive(self) -> str | bytes:
        """Take the oldest message of this subscription, waiting until there is one
        (registering first if it is not yet).

        Returns:
            The message, as the type it was broadcast as (``str`` or ``bytes``).

        Raises:
            SubscriptionLagged: broadcasts dropped messages it had not read (once).
            InvalidArgument: the subscription is closed (or closed while waiting).
            ProtocolError: the runtime closed or its connection was lost.
        """
        await self.start()
        sid = self._sid
        return await self._mailbox.take(lambda lease: P.SubscriptionReceive(sub=sid,
                                                                            lease=lease))

    async def aclose(self) -> None:
        """Close the subscription: the engine drops its buffer; receives waiting on it end
        (an ``async for`` over it stops). Closing twice is a no-op."""
        if self._closed:
            return
        self._closed = True
        if self._sid is not None:
            with anyio.move_on_after(SETTLE_TIMEOUT, shield=True):
                try:
                    await self._mailbox.request(P.Unsubscribe(sub=self._sid))
                except PieError:
                    pass  # the runtime is closed: its subscriptions are gone already

    def __await__(self) -> Generator[Any, None, Subscription]:
        return self.start().__await__()

    async def __aenter__(self) -> Subscription:
        return await self.start()

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    def __aiter__(self) -> AsyncIterator[str | bytes]:
        return self._iterate(owned=self._sid is None and not self._closed)

    async def _iterate(self, owned: bool) -> AsyncIterator[str | bytes]:
        # ``owned``: this loop registered the subscription, so it closes it when it ends.
        try:
            while not self._closed:
                try:
                    message = await self.receive()
                except InvalidArgument:
                    if self._closed:
                        return
                    raise
                yield message
        finally:
            if owned:
                await self.aclose()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open" if self._sid is not None else "new"
        return f"Subscription({self._topic!r}, {state})"
