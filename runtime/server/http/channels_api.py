"""Messages between outside programs and inferlets: ``POST /v1/pie/channels/{name}`` (a
queue: one receiver gets it) and ``POST /v1/pie/topics/{name}`` (a topic: every present
subscriber) send; ``GET /v1/pie/channels/{name}`` (a long poll: one message) and
``GET /v1/pie/topics/{name}`` (server-sent events: a subscription) receive.

Owner: the HTTP app. Written against the public SDK only (``Runtime.send`` and
``Runtime.broadcast`` over the app's runtime), so the messages land in that runtime's
namespace, ``default``: the one of in-process inferlets and of Unix-socket clients without a
token (docs/messages.md).

Body: the raw request body is the message. ``Content-Type: application/octet-stream``
sends bytes; any other type (``text/plain``, ``application/json``, none) sends a str, and
the body must then be UTF-8. Query ``timeout`` (seconds, 0-300, default 10): how long a
send waits for room in a full queue.

Replies: 200 ``{"object": "pie.channel.message", "channel", "bytes", "type"}`` (``type``
is ``"text"`` or ``"bytes"``), or for a topic ``{"object": "pie.topic.message", "topic",
"bytes", "type", "subscribers"}``.

Receiving: ``GET /v1/pie/channels/{name}?timeout=S`` takes one message (``rt.receive``),
waiting up to S seconds (0-300, default 10): 200 with the send reply's fields plus
``"data"`` (the text, or base64 for bytes), or 204 with no body if none came. A client that
goes away while it waits takes nothing (the receive is cancelled, so the engine keeps the
message); one lost after the reply was written loses that message. ``GET
/v1/pie/topics/{name}`` subscribes before its headers go out and streams server-sent events:
``{"object": "pie.topic.subscribed", "topic"}`` first, then one ``pie.topic.message`` (with
``"data"``) per broadcast, and ``{"object": "pie.topic.lagged", "topic", "message"}`` when
its buffer overflowed; the subscription closes when the client disconnects. Errors use OpenAI's body: 400 (bad name, body not
UTF-8, bad timeout), 413 ``message_too_large``, 503 ``channel_full`` (no room within the
timeout) or ``too_many_channels``; a missing or wrong API key is 401 (the app's key check).
"""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio

from pie_ctx import Runtime
from pie_ctx.proto.errors import (
    InvalidArgument,
    MessageTooLarge,
    SubscriptionLagged,
    TooManyChannels,
)
from runtime.server.http.conversation.errors import error_response

__all__ = ["ChannelRoutes", "DEFAULT_TIMEOUT", "MAX_TIMEOUT"]

DEFAULT_TIMEOUT = 10.0
MAX_TIMEOUT = 300.0


class _Refused(Exception):
    def __init__(self, status: int, message: str, code: str | None = None,
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param


class ChannelRoutes:
    """The four routes over one runtime (``get_runtime()`` is called per request)."""

    def __init__(self, get_runtime: Callable[[], Runtime]) -> None:
        from starlette.routing import Route

        self.get_runtime = get_runtime
        self.routes = [
            Route("/v1/pie/channels/{name:path}", self._guard(self.send), methods=["POST"]),
            Route("/v1/pie/topics/{name:path}", self._guard(self.broadcast), methods=["POST"]),
            Route("/v1/pie/channels/{name:path}", self._guard(self.receive), methods=["GET"]),
            Route("/v1/pie/topics/{name:path}", self._guard(self.subscribe), methods=["GET"]),
        ]

    @staticmethod
    def _guard(handler: Callable[[Any], Any]) -> Callable[[Any], Any]:
        async def guarded(request: Any) -> Any:
            try:
                return await handler(request)
            except _Refused as e:
                return error_response(e.status, e.message, "invalid_request_error"
                                      if e.status < 500 else "server_error", e.param, e.code)
            except MessageTooLarge as err:
                return error_response(413, str(err), "invalid_request_error",
                                      code="message_too_large")
            except InvalidArgument as err:
                return error_response(400, str(err), "invalid_request_error")
            except TooManyChannels as err:
                return error_response(503, str(err), "server_error", code="too_many_channels")

        return guarded

    async def _message(self, request: Any, rt: Runtime) -> str | bytes:
        """The body as the message, read no further than the engine's limit."""
        limit = rt.info.max_message_bytes
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise MessageTooLarge(f"the body is over the engine's limit of {limit} bytes "
                                      "per message (max_message_bytes)")
        kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if kind == "application/octet-stream":
            return bytes(body)
        try:
            return body.decode("utf-8")
        except UnicodeDecodeError:
            raise _Refused(400, "the body is not UTF-8 text; send binary messages with "
                                "Content-Type: application/octet-stream") from None

    @staticmethod
    def _timeout(request: Any) -> float:
        raw = request.query_params.get("timeout")
        if raw is None:
            return DEFAULT_TIMEOUT
        try:
            value = float(raw)
        except ValueError:
            value = -1.0
        if not 0 <= value <= MAX_TIMEOUT:
            raise _Refused(400, f"timeout must be a number of seconds in [0, {MAX_TIMEOUT:g}]",
                           param="timeout")
        return value

    @staticmethod
    def _described(message: str | bytes) -> dict[str, Any]:
        size = len(message.encode() if isinstance(message, str) else message)
        return {"bytes": size, "type": "text" if isinstance(message, str) else "bytes"}

    async def send(self, request: Any) -> Any:
        from starlette.responses import JSONResponse

        rt = self.get_runtime()
        name = request.path_params["name"]
        timeout = self._timeout(request)
        message = await self._message(request, rt)
        try:
            with anyio.fail_after(timeout):
                await rt.send(name, message)
        except TimeoutError:
            raise _Refused(503, f"the channel {name!r} stayed full for {timeout:g} s: its "
                                "receivers are behind (retry later, or pass a longer "
                                "?timeout=)", code="channel_full") from None
        return JSONResponse({"object": "pie.channel.message", "channel": name,
                             **self._described(message)})

    async def broadcast(self, request: Any) -> Any:
        from starlette.responses import JSONResponse

        rt = self.get_runtime()
        name = request.path_params["name"]
        message = await self._message(request, rt)
        subscribers = await rt.broadcast(name, message)
        return JSONResponse({"object": "pie.topic.message", "topic": name,
                             **self._described(message), "subscribers": subscribers})

    @staticmethod
    def _carried(message: str | bytes) -> dict[str, Any]:
        """The message as JSON fields: ``data`` is the text, or base64 for bytes."""
        data = message if isinstance(message, str) else base64.b64encode(message).decode()
        return {**ChannelRoutes._described(message), "data": data}

    async def receive(self, request: Any) -> Any:
        from starlette.responses import JSONResponse, Response

        receiver = self.get_runtime().receive(request.path_params["name"])
        timeout = self._timeout(request)
        got: list[str | bytes] = []
        async with anyio.create_task_group() as tg:

            async def until_gone() -> None:  # a client that leaves cancels its receive
                while (await request.receive())["type"] != "http.disconnect":
                    pass
                tg.cancel_scope.cancel()

            tg.start_soon(until_gone)
            with anyio.move_on_after(timeout):
                got.append(await receiver)
            tg.cancel_scope.cancel()
        if not got:
            return Response(status_code=204)
        return JSONResponse({"object": "pie.channel.message", "channel": receiver.channel,
                             **self._carried(got[0])})

    async def subscribe(self, request: Any) -> Any:
        from sse_starlette.sse import EventSourceResponse

        sub = await self.get_runtime().subscribe(request.path_params["name"])
        return EventSourceResponse(self._events(sub), ping=15)

    async def _events(self, sub: Any) -> AsyncIterator[dict[str, str]]:
        topic = sub.topic
        try:
            yield {"data": json.dumps({"object": "pie.topic.subscribed", "topic": topic})}
            while True:
                try:
                    message = await sub.receive()
                except SubscriptionLagged as lag:
                    yield {"data": json.dumps({"object": "pie.topic.lagged", "topic": topic,
                                               "message": str(lag)})}
                    continue
                yield {"data": json.dumps({"object": "pie.topic.message", "topic": topic,
                                           **self._carried(message)})}
        finally:  # the client went away (or the server stops): drop the subscription
            with anyio.CancelScope(shield=True):
                await sub.aclose()
