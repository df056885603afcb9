"""Assemble the HTTP app and run it with uvicorn on the engine's event loop.

Owner: ``run_server`` (``pie-ctx serve --http``) and the tests. The app holds one
``pie_ctx.Runtime`` over the running engine for all HTTP clients, and one more per API key
with a share (``serve --api-key KEY:SHARE``: a tenant of the engine, with its share of the
step rows and the pool; ``runtime.server.http.keys``), opened in the app's lifespan and
closed (every context it opened released) when the server stops.

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
import ipaddress
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.abc

from pie_ctx import Runtime
from pie_ctx.proto.errors import InvalidArgument
from runtime.server.http.conversation.holds import TOOL_WAIT_S, PromptHolds
from runtime.server.http.keys import CURRENT_KEY, ApiKey, KeyCheck, check_keys

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


async def _refuse(scope: Scope, receive: Receive, send: Send, status: int, message: str,
                  code: str) -> None:
    """Answer a request ``KeyCheck`` turned away, in its API's error shape."""
    await _error(scope["path"], status, message, code=code)(scope, receive, send)


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
               api_keys: Sequence[ApiKey] = (),
               mcp: dict[str, str] | None = None,
               cors_origins: list[str] | None = None,
               tool_wait_s: float = TOOL_WAIT_S) -> Any:
    """The Starlette app for ``engine`` (already running, or started by the caller before
    the app's lifespan begins).

    Args:
        engine: the engine every request runs on.
        api_key: required as ``Authorization: Bearer`` on every data endpoint if given.
        api_keys: more keys, each with its share of the engine's step rows and pool and
            its default priority (``serve --api-key KEY:SHARE``): each runs as its own
            owner, a tenant of the engine (docs/http.md, "Keys and shares"). With either
            kind of key, a request needs one of them.
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
    keys = [*([ApiKey(api_key, "key")] if api_key else []), *api_keys]
    check_keys(keys)
    holder: dict[str, Runtime] = {}  # key name ("" for none) -> the runtime it runs on

    def current_rt() -> Runtime:
        return holder[CURRENT_KEY.get()]

    holds = PromptHolds()  # one table: a key's share counts its holds on every API
    service = OpenAIService(current_rt, engine.model_name, metrics,
                            adapters=lambda: engine.info().adapters, holds=holds,
                            tool_wait_s=tool_wait_s)

    @contextlib.asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        async with contextlib.AsyncExitStack() as stack:
            rt = await stack.enter_async_context(Runtime.local(engine=engine))
            holder[""] = rt
            for key in keys:  # a key with a share is a tenant: its own runtime, its owner
                if key.share is None:
                    holder[key.name] = rt
                    continue
                mine = await stack.enter_async_context(Runtime.local(engine=engine))
                engine.add_tenant(mine.transport.owner, key.name, key.share, key.priority)
                stack.callback(engine.remove_tenant, mine.transport.owner)
                holder[key.name] = mine
            try:
                yield
            finally:
                responses.close()
                holder.clear()

    channels = ChannelRoutes(current_rt)
    inferlets = InferletRoutes(current_rt)
    serving = ServingRoutes(current_rt, engine.model_name, service.check_model)
    messages = MessagesService(current_rt, service.check_model, metrics, holds)
    responses = ResponsesService(engine, current_rt, engine.model_name,
                                 service.check_model, metrics, mcp, holds, tool_wait_s)
    embeddings = EmbeddingRoutes(current_rt, engine.model_name,
                                 lambda: engine.info().adapters)
    routes = [*service.routes, *responses.routes, *messages.routes, *serving.routes,
              *embeddings.routes, *AdapterRoutes(current_rt).routes, *channels.routes,
              *inferlets.routes, *metrics.routes, *state_routes(engine, metrics)]
    app: Any = Starlette(routes=routes, lifespan=lifespan,
                         exception_handlers={404: _not_found, 405: _not_found})
    app.state.metrics = metrics
    asgi: Any = KeyCheck(app, keys, OPEN_PATHS, _refuse)
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
