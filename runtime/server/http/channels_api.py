"""Messages from outside to inferlets: ``POST /v1/pie/channels/{name}`` (a queue: one
receiver gets it) and ``POST /v1/pie/topics/{name}`` (a topic: every present subscriber).

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
"bytes", "type", "subscribers"}``. Errors use OpenAI's body: 400 (bad name, body not
UTF-8, bad timeout), 413 ``message_too_large``, 503 ``channel_full`` (no room within the
timeout) or ``too_many_channels``; a missing or wrong API key is 401 (the app's key check).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio

from pie_ctx import Runtime
from pie_ctx.proto.errors import InvalidArgument, MessageTooLarge, TooManyChannels
from runtime.server.http.openai_schema import error_response

__all__ = ["ChannelRoutes", "DEFAULT_TIMEOUT", "MAX_TIMEOUT"]

DEFAULT_TIMEOUT = 10.0
MAX_TIMEOUT = 300.0


class _Refused(Exception):
    def __init__(self, status: int, message: str, code: str | None = None,
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param


class ChannelRoutes:
    """The two routes over one runtime (``get_runtime()`` is called per request)."""

    def __init__(self, get_runtime: Callable[[], Runtime]) -> None:
        from starlette.routing import Route

        self.get_runtime = get_runtime
        self.routes = [
            Route("/v1/pie/channels/{name:path}", self._guard(self.send), methods=["POST"]),
            Route("/v1/pie/topics/{name:path}", self._guard(self.broadcast), methods=["POST"]),
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
