"""The engine's answers to the channel requests of the contract (docs/messages.md).

Owns nothing; it checks each request's input once (``pie_ctx.proto.checks``) and turns
``ChannelSend``/``ChannelReceive``/``Broadcast``/``Subscribe``/``SubscriptionReceive``/
``Unsubscribe``/``SettleMessage`` into calls on :class:`~runtime.engine.channels.Channels`
(a receive or a send may wait there). The engine adds :attr:`ChannelRequests.table` to its
handlers, as it does ``HostedRequests``'.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from pie_ctx.proto import checks
from pie_ctx.proto import messages as P
from pie_ctx.proto.errors import InvalidArgument
from runtime.engine.channels import Channels, Message

__all__ = ["ChannelRequests"]


class ChannelRequests:
    """Handlers for the channel requests.

    Args:
        channels: the queues and topics between inferlets.
        info: returns the engine's facts (its ``max_message_bytes`` bounds a payload).
    """

    def __init__(self, channels: Channels, info: Callable[[], P.EngineInfo]) -> None:
        self._channels = channels
        self._info = info  # a callable: the limits may be lowered by a server
        self.table: dict[type, Callable[[Any, Any, str], Awaitable[Any]]] = {
            P.ChannelSend: self._channel_send,
            P.ChannelReceive: self._channel_receive,
            P.Broadcast: self._broadcast,
            P.Subscribe: self._subscribe,
            P.SubscriptionReceive: self._subscription_receive,
            P.Unsubscribe: self._unsubscribe,
            P.SettleMessage: self._settle,
        }

    def _message(self, req: P.ChannelSend | P.Broadcast) -> Message:
        checks.payload(req.payload, req.text, self._info().max_message_bytes)
        return Message(req.payload, req.text)

    @staticmethod
    def _taken(message: Message, lease: int) -> P.ChannelMessage:
        return P.ChannelMessage(payload=message.payload, text=message.text, lease=lease)

    async def _channel_send(self, req: P.ChannelSend, owner: Any, ns: str) -> P.Ok:
        name = checks.channel_name(req.channel, "channel")
        await self._channels.send(owner, ns, name, self._message(req))
        return P.Ok()

    async def _channel_receive(self, req: P.ChannelReceive, owner: Any,
                               ns: str) -> P.ChannelMessage:
        name = checks.channel_name(req.channel, "channel")
        lease = checks.positive(req.lease, "lease")
        return self._taken(await self._channels.receive(owner, ns, name, lease), lease)

    async def _broadcast(self, req: P.Broadcast, owner: Any, ns: str) -> P.BroadcastReply:
        name = checks.channel_name(req.topic, "topic")
        return P.BroadcastReply(num_subscribers=self._channels.broadcast(
            ns, name, self._message(req)))

    async def _subscribe(self, req: P.Subscribe, owner: Any, ns: str) -> P.SubscriptionReply:
        name = checks.channel_name(req.topic, "topic")
        return P.SubscriptionReply(sub=self._channels.subscribe(owner, ns, name))

    async def _subscription_receive(self, req: P.SubscriptionReceive, owner: Any,
                                    ns: str) -> P.ChannelMessage:
        lease = checks.positive(req.lease, "lease")
        return self._taken(await self._channels.next(owner, req.sub, lease), lease)

    async def _unsubscribe(self, req: P.Unsubscribe, owner: Any, ns: str) -> P.Ok:
        self._channels.unsubscribe(owner, req.sub)
        return P.Ok()

    async def _settle(self, req: P.SettleMessage, owner: Any, ns: str) -> P.Ok:
        lease = checks.positive(req.lease, "lease")
        if not isinstance(req.delivered, bool):
            raise InvalidArgument("delivered must be a bool")
        self._channels.settle(owner, lease, req.delivered)
        return P.Ok()
