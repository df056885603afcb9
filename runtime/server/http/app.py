"""Assemble the HTTP app and run it with uvicorn on the engine's event loop.

Owner: ``run_server`` (``pie-ctx serve --http``) and the tests. The app holds one
``pie_ctx.Runtime`` over the running engine for all HTTP clients, opened in the app's
lifespan and closed (every context it opened released) when the server stops.

Security: on a loopback address no key is needed; on any other address an API key is
mandatory (``Authorization: Bearer KEY``, or ``x-api-key: KEY`` as Anthropic's clients
send it, on every request but the live view's static page, which holds no data and sends
the key from its URL fragment on its own requests, and ``/health`` and ``/version``).

Browser pages from the origins ``serve --cors-origin`` lists may call the API (CORS).
Every unknown path (404) and method (405) is answered with OpenAI's error body (Anthropic's
on ``/v1/messages``), and every request writes one access-log line (``access_log``).
"""

from __future__ import annotations

import contextlib
import hmac
import ipaddress
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.abc

from pie_ctx import Runtime
from pie_ctx.proto.errors import InvalidArgument
from runtime.server.http.conversation.holds import TOOL_WAIT_S, PromptHolds

__all__ = ["HttpAddress", "create_app", "parse_http_address", "serve_http", "is_loopback"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

# Served without a key: static, or no data.
OPEN_PATHS = frozenset({"/", "/favicon.ico", "/health", "/version"})


@dataclass(frozen=True, slots=True)
class HttpAddress:
    host: str
    port: int

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"


def parse_http_address(text: str) -> HttpAddress:
    """``PORT`` or ``HOST:PORT`` (``[v6]:PORT`` for IPv6) -> :class:`HttpAddress`; the host
    defaults to 127.0.0.1.

    Raises:
        InvalidArgument: not of that form, or the port is not in [0, 65535].
    """
    host, sep, port = text.rpartition(":")
    if not sep:
        host, port = "127.0.0.1", text
    host = host.strip("[]") or "127.0.0.1"
    if not port.isdigit() or not 0 <= int(port) <= 65535:
        raise InvalidArgument(f"--http takes [HOST:]PORT with a port in 0-65535, got {text!r}")
    return HttpAddress(host, int(port))


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class _KeyCheck:
    """ASGI middleware: every request but :data:`OPEN_PATHS` carries the API key."""

    def __init__(self, app: Any, key: str) -> None:
        self.app, self._key = app, key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        given = b""
        for name, value in scope.get("headers", ()):
            if name == b"authorization" and value[:7].lower() == b"bearer ":
                given = value[7:].strip()
            elif name == b"x-api-key" and not given:  # Anthropic's clients
                given = value.strip()
        if hmac.compare_digest(given, self._key):
            await self.app(scope, receive, send)
            return
        message = ("missing API key: send 'Authorization: Bearer KEY' or 'x-api-key: KEY'"
                   if not given else "invalid API key")
        response = _error(scope["path"], 401, message, code="invalid_api_key")
        await response(scope, receive, send)


def _error(path: str, status: int, message: str, code: str | None = None) -> Any:
    """The error response of ``path``'s API: Anthropic's shape on its routes, else
    OpenAI's."""
    from runtime.server.http.anthropic.api import anthropic_error, is_anthropic_path
    from runtime.server.http.conversation.errors import error_response

    if is_anthropic_path(path):
        return anthropic_error(status, message)
    kind = "invalid_request_error" if status < 500 else "server_error"
    return error_response(status, message, kind, code=code)


async def _not_found(request: Any, exc: Any) -> Any:
    """404 and 405 as the API's error body (clients show its message)."""
    method, path = request.method, request.url.path
    if exc.status_code == 405:
        allowed = (exc.headers or {}).get("Allow", "")
        response = _error(path, 405, f"Method {method} is not allowed on {path}"
                          + (f"; allowed: {allowed}" if allowed else ""),
                          code="method_not_allowed")
        if allowed:
            response.headers["Allow"] = allowed
        return response
    if exc.status_code == 404:
        return _error(path, 404, f"Invalid URL ({method} {path}): no such endpoint on this "
                                 f"server (see docs/http.md)", code="unknown_url")
    return _error(path, exc.status_code, str(exc.detail))


def create_app(engine: Any, *, api_key: str | None = None,
               mcp: dict[str, str] | None = None,
               cors_origins: list[str] | None = None,
               tool_wait_s: float = TOOL_WAIT_S) -> Any:
    """The Starlette app for ``engine`` (already running, or started by the caller before
    the app's lifespan begins).

    Args:
        engine: the engine every request runs on.
        api_key: required as ``Authorization: Bearer`` on every data endpoint if given.
        mcp: the MCP servers ``/v1/responses`` may run tools on, name -> command or URL
            (``serve --mcp``).
        cors_origins: browser origins allowed to call the API (``serve --cors-origin``;
            ``*`` for any): Starlette's ``CORSMiddleware`` answers their preflights
            (before the key check: a preflight carries no key) and marks the replies.
        tool_wait_s: how long a turn that ends in tool calls keeps its context held in
            the cache while the client runs them (``serve --tool-hold``; 0: not held).
    """
    from starlette.applications import Starlette

    from runtime.server.http.access_log import access_log
    from runtime.server.http.adapters_api import AdapterRoutes
    from runtime.server.http.anthropic.api import MessagesService
    from runtime.server.http.channels_api import ChannelRoutes
    from runtime.server.http.embeddings_api import EmbeddingRoutes
    from runtime.server.http.inferlets_api import InferletRoutes
    from runtime.server.http.metrics import Metrics
    from runtime.server.http.openai.api import OpenAIService
    from runtime.server.http.responses.api import ResponsesService
    from runtime.server.http.serving_api import ServingRoutes
    from runtime.server.http.state import state_routes

    metrics = Metrics(engine)
    holder: dict[str, Runtime] = {}
    holds = PromptHolds()  # one table: a key's share counts its holds on every API
    service = OpenAIService(lambda: holder["rt"], engine.model_name, metrics,
                            adapters=lambda: engine.info().adapters, holds=holds,
                            tool_wait_s=tool_wait_s)

    @contextlib.asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        async with Runtime.local(engine=engine) as rt:
            holder["rt"] = rt
            try:
                yield
            finally:
                responses.close()
                del holder["rt"]

    channels = ChannelRoutes(lambda: holder["rt"])
    inferlets = InferletRoutes(lambda: holder["rt"])
    serving = ServingRoutes(lambda: holder["rt"], engine.model_name, service.check_model)
    messages = MessagesService(lambda: holder["rt"], service.check_model, metrics, holds)
    responses = ResponsesService(engine, lambda: holder["rt"], engine.model_name,
                                 service.check_model, metrics, mcp, holds, tool_wait_s)
    embeddings = EmbeddingRoutes(lambda: holder["rt"], engine.model_name,
                                 lambda: engine.info().adapters)
    routes = [*service.routes, *responses.routes, *messages.routes, *serving.routes,
              *embeddings.routes, *AdapterRoutes(lambda: holder["rt"]).routes, *channels.routes,
              *inferlets.routes, *metrics.routes, *state_routes(engine, metrics)]
    app: Any = Starlette(routes=routes, lifespan=lifespan,
                         exception_handlers={404: _not_found, 405: _not_found})
    app.state.metrics = metrics
    asgi: Any = _KeyCheck(app, api_key) if api_key else app
    if cors_origins:
        from starlette.middleware.cors import CORSMiddleware

        asgi = CORSMiddleware(asgi, allow_origins=list(cors_origins), allow_methods=["*"],
                              allow_headers=["*"], expose_headers=["*"])
    # Refused requests are counted and logged too.
    return _WithLifespan(access_log(metrics.middleware(asgi)), app)


class _WithLifespan:
    """The middleware stack as one ASGI app whose lifespan events reach the Starlette app."""

    def __init__(self, outer: Any, app: Any) -> None:
        self.outer, self.app = outer, app
        self.state = app.state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self.app(scope, receive, send)
        else:
            await self.outer(scope, receive, send)


def bind(address: HttpAddress) -> tuple[socket.socket, HttpAddress]:
    """A listening TCP socket on ``address`` and the address it got (the real port).

    Raises:
        InvalidArgument: the address cannot be bound (in use, not ours, bad host).
    """
    try:
        infos = socket.getaddrinfo(address.host, address.port, type=socket.SOCK_STREAM)
        family = infos[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(infos[0][4])
        sock.listen(2048)
    except OSError as err:
        raise InvalidArgument(f"cannot listen for HTTP on {address}: {err.strerror or err}") \
            from None
    sock.setblocking(False)
    return sock, HttpAddress(address.host, sock.getsockname()[1])


async def serve_http(app: Any, sock: socket.socket, *,
                     task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
                     ) -> None:
    """Serve ``app`` on the listening ``sock`` with uvicorn, on this event loop (asyncio),
    until cancelled; then stop gracefully (open streams get a few seconds, the app's
    lifespan closes its runtime)."""
    import uvicorn

    class _Server(uvicorn.Server):
        # The caller owns the process's signals (run_server stops everything on SIGINT).
        def install_signal_handlers(self) -> None:
            pass

        @contextlib.contextmanager
        def capture_signals(self) -> Any:
            yield

    config = uvicorn.Config(app, lifespan="on", log_level="warning", access_log=False,
                            timeout_graceful_shutdown=3, ws="none")
    server = _Server(config)
    done = anyio.Event()

    async def run() -> None:
        try:
            with anyio.CancelScope(shield=True):  # stopped through should_exit, not cancel
                await server.serve(sockets=[sock])
        finally:
            done.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(run)
        while not server.started:
            if done.is_set():
                raise InvalidArgument("the HTTP server did not start (see the log)")
            await anyio.sleep(0.005)
        task_status.started()
        try:
            await anyio.sleep_forever()
        finally:
            server.should_exit = True
