"""The error every HTTP API answers with, and the one guard that turns failures into it.

Owner: :class:`ApiError` (a refused request with OpenAI's fields: status, message, type,
param, code), the mapping from the SDK's typed errors onto it (:func:`as_api_error`), and
the server's default error body, OpenAI's ``{"error": {"message", "type", "param",
"code"}}`` (every route but Anthropic's answers with it). An API renders an
:class:`ApiError` in its own shape through :func:`guard`'s ``render``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from pie_ctx.proto.errors import (
    ContextTooLong,
    InvalidArgument,
    OutOfPages,
    PieError,
    SnapshotNotFound,
)
from runtime.server.http.disconnect import NO_RESPONSE, ClientGone

__all__ = ["ApiError", "as_api_error", "error_body", "error_response", "guard", "openai_error"]


class ApiError(Exception):
    """A request the API refuses, with OpenAI's error fields."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, type: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = (
            status, message, param, code, type)


def as_api_error(err: BaseException) -> ApiError:
    """The API error an exception from the SDK (or anywhere) becomes."""
    if isinstance(err, ApiError):
        return err
    if isinstance(err, SnapshotNotFound):
        return ApiError(404, str(err), param="snapshot", code="snapshot_not_found")
    if isinstance(err, ContextTooLong):
        return ApiError(400, str(err), param="messages", code="context_length_exceeded")
    if isinstance(err, InvalidArgument):
        return ApiError(400, str(err))
    if isinstance(err, OutOfPages):
        return ApiError(503, f"the engine has no room for this request now: {err}",
                        code="engine_overloaded", type="server_error")
    if isinstance(err, PieError):
        return ApiError(500, f"{type(err).__name__}: {err}", type="server_error")
    return ApiError(500, f"internal error: {type(err).__name__}", type="server_error")


def error_body(err: ApiError) -> dict[str, Any]:
    """OpenAI's error body ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": err.message, "type": err.type, "param": err.param,
                      "code": err.code}}


def error_response(status: int, message: str, type: str, param: str | None = None,
                   code: str | None = None) -> Any:
    """OpenAI's error body with ``status``."""
    from starlette.responses import JSONResponse

    return JSONResponse(error_body(ApiError(status, message, param=param, code=code,
                                            type=type)), status_code=status)


def openai_error(err: ApiError) -> Any:
    """:func:`error_response` of an :class:`ApiError` (the default ``render``)."""
    return error_response(err.status, err.message, err.type, err.param, err.code)


Handler = Callable[[Any], Awaitable[Any]]


def guard(handler: Handler, render: Callable[[ApiError], Any] = openai_error) -> Handler:
    """``handler`` with any failure before its response starts rendered as an error
    response (``render``: the API's shape); a client that went away gets none."""

    async def guarded(request: Any) -> Any:
        try:
            return await handler(request)
        except ClientGone:  # no one to answer (logged and counted as 499)
            return NO_RESPONSE
        except Exception as err:  # noqa: BLE001 - every error gets a body, none a crash
            return render(as_api_error(err))

    return guarded
