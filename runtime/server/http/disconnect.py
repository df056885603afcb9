"""A non-streamed request stops computing when its client goes away.

Owner: the watch over one request's connection while its answer is computed. uvicorn does
not cancel a handler whose client disconnected: a non-streamed completion would go on
generating every token it was allowed (a stream notices, at its next send). Every API's
non-streamed path (chat and text completions, Responses, Anthropic's messages) runs its
generation through :func:`unless_disconnected`: a second task waits on the ASGI
``receive`` channel (which, once the body is read, yields only ``http.disconnect``) and
cancels the work the moment the client leaves; the contexts are released by the work's own
``finally`` blocks, so the engine drops the rows at its next step.

The route then raises :class:`ClientGone`; the APIs' guards answer it with
:data:`NO_RESPONSE` (nothing is sent), so the access log and ``/metrics`` record the
request as 499, nginx's "client closed request".
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import anyio

from pie_ctx.proto.errors import single_exception

__all__ = ["ClientGone", "NO_RESPONSE", "unless_disconnected"]

T = TypeVar("T")


class ClientGone(Exception):
    """The client disconnected before its answer was ready (the work was cancelled)."""


async def _no_response(scope: Any, receive: Any, send: Any) -> None:
    """An ASGI response that sends nothing: there is no one to send it to."""
    return None


NO_RESPONSE = _no_response


async def unless_disconnected(request: Any, work: Callable[[], Awaitable[T]]) -> T:
    """``await work()``, cancelled if ``request``'s client disconnects first. Call it once
    the request's body has been read (the watch reads the same channel).

    Raises:
        ClientGone: the client left; ``work`` was cancelled (its ``finally`` blocks ran).
        Exception: whatever ``work`` raised, as it raised it.
    """
    gone = False
    done: list[T] = []

    async def watch(cancel: anyio.CancelScope) -> None:
        nonlocal gone
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                gone = True
                cancel.cancel()
                return

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(watch, tg.cancel_scope)
            try:
                done.append(await work())
            finally:
                tg.cancel_scope.cancel()  # the watch ends with the work
    except BaseExceptionGroup as group:  # the work's own error, unwrapped
        raise single_exception(group) from None
    if gone and not done:
        raise ClientGone("the client disconnected")
    return done[0]
