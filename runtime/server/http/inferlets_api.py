"""``POST /v1/pie/inferlets/{name}``: launch an inferlet of the operator's folder inside
the server (``serve --inferlets DIR``), as ``pie-ctx launch`` does over the socket.

Owner: the HTTP app. Written against the public SDK only (``Runtime.spawn`` over the app's
runtime): the launch is an engine owner of its own (its own page share) in the namespace
``default``, and it is cancelled (its contexts released) if the HTTP client goes away first.
The API key rules are the app's: with a key, this route needs it like every data route.

Body (JSON, optional): ``{"args": ["word", ...], "stream": false}``. ``args`` are the words
its ``main`` gets (as after ``--``).

Replies: 200 ``{"object": "pie.inferlet.result", "name", "output", "result"}``: ``output`` is
everything it sent with ``rt.session.send``, ``result`` the ``str`` of what ``main`` returned
(null for None). With ``"stream": true``, server-sent events: ``{"object":
"pie.inferlet.output", "text"}`` per session text, then ``{"object": "pie.inferlet.result",
"name", "result"}`` or an error body, then ``[DONE]``. Errors use OpenAI's body: 400 (a bad
body; ``invalid_inferlet_arguments`` when its own options refuse ``args``, with its usage
text as the message), 404 ``inferlet_not_found`` (no folder, no such file,
or a name that leads out of the folder), 500 ``inferlet_failed`` (it raised), 409
``inferlet_cancelled``.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio

from pie_ctx import Runtime
from pie_ctx.proto.errors import (
    InferletCancelled,
    InferletFailed,
    InferletNotFound,
    InferletUsage,
    InvalidArgument,
    PieError,
)
from runtime.server.http.conversation.errors import error_response

__all__ = ["InferletRoutes"]

_MAX_BODY = 1 << 20


def _refusal(err: PieError) -> tuple[int, str, str | None]:
    """(status, type, code) of an error."""
    if isinstance(err, InferletNotFound):
        return 404, "invalid_request_error", "inferlet_not_found"
    if isinstance(err, InferletUsage):
        return 400, "invalid_request_error", "invalid_inferlet_arguments"
    if isinstance(err, InvalidArgument):
        return 400, "invalid_request_error", None
    if isinstance(err, InferletCancelled):
        return 409, "server_error", "inferlet_cancelled"
    if isinstance(err, InferletFailed):
        return 500, "server_error", "inferlet_failed"
    return 500, "server_error", type(err).__name__


def _error_body(err: PieError) -> dict[str, Any]:
    _, kind, code = _refusal(err)
    return {"error": {"message": str(err), "type": kind, "param": None, "code": code}}


class InferletRoutes:
    """The launch route over one runtime (``get_runtime()`` is called per request)."""

    def __init__(self, get_runtime: Callable[[], Runtime]) -> None:
        from starlette.routing import Route

        self.get_runtime = get_runtime
        self.routes = [Route("/v1/pie/inferlets/{name:path}", self.launch, methods=["POST"])]

    @staticmethod
    async def _body(request: Any) -> tuple[list[str], bool]:
        raw = bytearray()
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > _MAX_BODY:
                raise InvalidArgument(f"the body is over {_MAX_BODY} bytes")
        if not raw.strip():
            return [], False
        try:
            body = json.loads(raw)
        except ValueError:
            raise InvalidArgument('the body must be JSON: {"args": ["word", ...], '
                                  '"stream": false}') from None
        if not isinstance(body, dict) or set(body) - {"args", "stream"}:
            raise InvalidArgument('the body is a JSON object with "args" (a list of str) and '
                                  '"stream" (a bool), both optional')
        args = body.get("args", [])
        stream = body.get("stream", False)
        if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
            raise InvalidArgument('"args" must be a list of str (the words after `--`)')
        if not isinstance(stream, bool):
            raise InvalidArgument('"stream" must be true or false')
        return args, stream

    async def launch(self, request: Any) -> Any:
        from sse_starlette.sse import EventSourceResponse
        from starlette.responses import JSONResponse

        name = request.path_params["name"]
        try:
            args, stream = await self._body(request)
            handle = await self.get_runtime().spawn(name, args)
        except PieError as err:
            status, kind, code = _refusal(err)
            return error_response(status, str(err), kind, code=code)
        if stream:
            return EventSourceResponse(self._events(handle, name), ping=15)
        try:
            output = [text async for text in handle.output()]
            result = await handle
        except PieError as err:
            status, kind, code = _refusal(err)
            return error_response(status, str(err), kind, code=code)
        finally:
            with anyio.CancelScope(shield=True):  # a no-op once it ended; else stop it
                await handle.cancel()
        return JSONResponse({"object": "pie.inferlet.result", "name": name,
                             "output": "".join(output), "result": result})

    @staticmethod
    async def _events(handle: Any, name: str) -> AsyncIterator[dict[str, str]]:
        try:
            async for text in handle.output():
                yield {"data": json.dumps({"object": "pie.inferlet.output", "text": text})}
            try:
                result = await handle
            except PieError as err:
                yield {"data": json.dumps(_error_body(err))}
            else:
                yield {"data": json.dumps({"object": "pie.inferlet.result", "name": name,
                                           "result": result})}
            yield {"data": "[DONE]"}
        finally:  # the client went away: stop it (a no-op once it ended)
            with anyio.CancelScope(shield=True):
                await handle.cancel()
