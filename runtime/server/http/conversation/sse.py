"""Server-sent events: the one producer every streaming API answers through.

Owner: the shape of a stream. The API's ``produce(send)`` runs in the runtime's task
group (a task group must not stay open across an async generator's yields) and sends
events into a bounded memory stream; the response's generator renders each one as an SSE
message. An error after the headers were sent can only be an event: ``failed(err)`` sends
it in the API's shape. When the stream ends, or the client goes away, the producer is
cancelled and ``finish()`` runs (the API releases its contexts there).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any, TypeVar

import anyio

from pie_ctx import Runtime
from runtime.server.http.conversation.errors import ApiError, as_api_error

__all__ = ["PING_S", "event_stream", "sse_response"]

PING_S = 15  # a comment line this often keeps proxies from closing a quiet stream
E = TypeVar("E")
Send = Callable[[E], Awaitable[None]]


async def event_stream(rt: Runtime, produce: Callable[[Send[E]], Awaitable[None]],
                       failed: Callable[[ApiError, Send[E]], Awaitable[None]],
                       render: Callable[[E], dict[str, str]],
                       finish: Callable[[], Awaitable[None]],
                       tail: Iterable[dict[str, str]] = ()) -> AsyncIterator[dict[str, str]]:
    """The SSE messages of ``produce``'s events (``render``: one event's ``{"event",
    "data"}``), then ``tail`` when the producer ended (OpenAI's ``[DONE]``)."""
    send, receive = anyio.create_memory_object_stream[Any](256)
    scope = anyio.CancelScope()

    async def run() -> None:
        with scope:
            async with send:
                try:
                    await produce(send.send)
                except Exception as err:  # noqa: BLE001 - after the headers: an event
                    await failed(as_api_error(err), send.send)

    rt.start_soon(run)
    try:
        async with receive:
            async for event in receive:
                yield render(event)
        for message in tail:
            yield message
    finally:  # done, or the client went away: stop generating, release the contexts
        scope.cancel()
        await finish()


def sse_response(messages: AsyncIterator[dict[str, str]]) -> Any:
    """The streaming response of ``messages``."""
    from sse_starlette.sse import EventSourceResponse

    return EventSourceResponse(messages, ping=PING_S)
