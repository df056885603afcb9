"""One access-log line per HTTP request: method, path, status, milliseconds, tokens.

Owner: the ``pie_ctx.http.access`` logger and the ASGI middleware that writes it. A line
looks like::

    pie-ctx: 127.0.0.1 POST /v1/chat/completions 200 84.1ms prompt=31 completion=12

``prompt``/``completion`` are the tokens the request prefilled (cached ones included) and
generated, as its ``usage`` says; ``-`` for a request that generated nothing (a 404, a
``GET``). A request whose client left before any response is logged with status 499.

On by default (``pie-ctx serve --http``); ``serve --no-access-log`` turns it off
(:func:`set_enabled`). Handlers that generate report their tokens with
:func:`note_tokens`; the middleware reads them when the response is over, streamed or not.
"""

from __future__ import annotations

import contextvars
import logging
import sys
import time
from typing import Any

__all__ = ["LOGGER", "access_log", "note_tokens", "set_enabled"]

LOGGER = logging.getLogger("pie_ctx.http.access")
_TOKENS: contextvars.ContextVar[list[int] | None] = contextvars.ContextVar(
    "pie_ctx_http_tokens", default=None)


_ENABLED = [True]  # not LOGGER.disabled: uvicorn's logging.config re-enables loggers


def set_enabled(on: bool) -> None:
    """Turn the access log on or off for this process."""
    _ENABLED[0] = bool(on)


def note_tokens(prompt: int, completion: int) -> None:
    """Count a request's prompt and completion tokens into its access-log line (nothing
    outside a request)."""
    counts = _TOKENS.get()
    if counts is not None:
        counts[0] += prompt
        counts[1] += completion


def _ensure_handler() -> None:
    if not LOGGER.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("pie-ctx: %(message)s"))
        LOGGER.addHandler(handler)
        LOGGER.setLevel(logging.INFO)
        LOGGER.propagate = False


def access_log(app: Any) -> Any:
    """Wrap the ASGI ``app`` so every HTTP request writes one line once it is answered."""
    _ensure_handler()

    async def logged(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not _ENABLED[0]:
            await app(scope, receive, send)
            return
        status = [499]
        counts = [0, 0]
        token = _TOKENS.set(counts)
        started = time.perf_counter()

        async def send_status(message: Any) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await app(scope, receive, send_status)
        finally:
            _TOKENS.reset(token)
            ms = (time.perf_counter() - started) * 1000
            client = scope.get("client") or ("-", 0)
            tokens = (f"prompt={counts[0]} completion={counts[1]}" if any(counts)
                      else "prompt=- completion=-")
            LOGGER.info("%s %s %s %d %.1fms %s", client[0], scope.get("method", "-"),
                        scope.get("path", "-"), status[0], ms, tokens)

    return logged
