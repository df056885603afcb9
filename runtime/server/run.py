"""Run a server on an address: open the listener, settle the token, stop on signals.

Owns: the listening socket (and the Unix socket file, removed on exit). ``run_server`` is
what ``pie-ctx serve`` runs; tests use ``runtime.server.testing.serve_in_background``,
which shares :func:`open_listener` and :func:`settle_token`.

Invariants: a TCP listener never runs without a token; a Unix socket file is created
0600 inside a 0700 folder, and an address where a live server already listens is refused
rather than stolen.
"""

from __future__ import annotations

import contextlib
import os
import signal
import stat
from collections.abc import Callable, Sequence
from typing import Any

import anyio
import anyio.abc
from anyio.abc import SocketAttribute

from pie_ctx.proto.address import (
    Address,
    default_token_file,
    new_token,
    read_token_file,
    write_token_file,
)
from pie_ctx.proto.errors import InvalidArgument
from pie_ctx.proto.framing import DEFAULT_MAX_FRAME_BYTES
from runtime.server.server import Server

__all__ = ["open_listener", "settle_token", "run_server"]


async def open_listener(address: Address) -> tuple[anyio.abc.Listener[Any], Address]:
    """Listen on ``address``; return the listener and the bound address (real TCP port).

    Raises:
        InvalidArgument: another server already listens on the Unix socket path, or the
            path exists and is not a socket.
        OSError: the address cannot be bound.
    """
    if address.kind == "tcp":
        listener = await anyio.create_tcp_listener(local_host=address.host,
                                                   local_port=address.port)
        port = listener.extra(SocketAttribute.local_port)
        return listener, Address("tcp", host=address.host, port=port)
    path = address.path
    with contextlib.suppress(FileNotFoundError):
        if not stat.S_ISSOCK(os.stat(path).st_mode):
            raise InvalidArgument(f"{path} exists and is not a socket; pick another --socket")
        try:
            stream = await anyio.connect_unix(path)
        except OSError:
            pass  # a stale socket file from a server that died: safe to replace
        else:
            await stream.aclose()
            raise InvalidArgument(f"a server is already listening on {path}")
    os.makedirs(os.path.dirname(os.path.abspath(path)), mode=0o700, exist_ok=True)
    listener = await anyio.create_unix_listener(path, mode=0o600)
    return listener, Address("unix", path=path)


def settle_token(address: Address, token: str | None,
                 token_file: str | None) -> tuple[str | None, str | None]:
    """Decide the token a server requires, writing a token file when one is generated.

    A given ``token`` wins (and is written to ``token_file`` if one is named). Otherwise an
    existing ``token_file`` is read. Otherwise, for TCP (or when ``token_file`` is named), a
    fresh token is generated and written 0600 to ``token_file`` (default: the runtime
    folder's ``tcp.token``). A Unix socket with neither needs no token.

    Returns:
        ``(token, token_file)``; both None for an open Unix socket.

    Raises:
        InvalidArgument: the token file is unreadable or readable by other users.
    """
    if token is not None:
        if token_file is not None:
            write_token_file(token_file, token)
        return token, token_file
    if token_file is not None and os.path.exists(token_file):
        return read_token_file(token_file), token_file
    if address.kind == "tcp" or token_file is not None:
        path = token_file or default_token_file()
        token = new_token()
        write_token_file(path, token)
        return token, path
    return None, None


async def run_server(engine: Any, address: Address, *, token: str | None = None,
                     max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
                     ready: Callable[[Address], None] | None = None,
                     handle_signals: bool = True, http: Any = None,
                     api_key: str | None = None, api_keys: Sequence[Any] = (),
                     http_ready: Callable[[Any], None] | None = None,
                     mcp: dict[str, str] | None = None,
                     cors_origins: list[str] | None = None,
                     tool_hold_s: float | None = None) -> None:
    """Run ``engine`` behind a server on ``address`` until SIGINT/SIGTERM (or cancellation).

    On a signal the server stops accepting, cancels every running request (each client's
    contexts are released), stops the engine and returns normally.

    Args:
        engine: an engine that is not running yet (this enters ``async with engine``).
        address: where to listen.
        token: required from every client if given; mandatory for TCP.
        max_frame_bytes: largest frame accepted from a client.
        ready: called with the bound address once clients can connect.
        handle_signals: install SIGINT/SIGTERM handlers (main thread only).
        http: also serve the HTTP API (``runtime.server.http``) on this ``HttpAddress``, on
            the same engine.
        api_key: required by the HTTP API if given; mandatory off loopback (or
            ``api_keys``).
        api_keys: keys with shares (``runtime.server.http.keys.ApiKey``): each a tenant.
        http_ready: called with the bound HTTP address once HTTP clients can connect.
        mcp: MCP servers for the HTTP API's server-side tools, name -> command or URL.
        cors_origins: the browser origins the HTTP API answers CORS requests from.
        tool_hold_s: how long the HTTP API holds a turn that ends in tool calls (None:
            its default; 0: not held).

    If the engine's runner is lost (a tensor-parallel rank died), every pending request
    gets the ``ModelError``, then the server stops and raises it.

    Raises:
        ModelError: the engine's runner was lost (``Engine.wait_lost``).
        InvalidArgument: TCP without a token, HTTP off loopback without a key, or an
            address is taken.
    """
    if address.kind == "tcp" and not token:
        raise InvalidArgument("a TCP server requires a token (see settle_token)")
    http_sock = None
    if http is not None:
        from runtime.server.http.app import bind, is_loopback

        if not api_key and not api_keys and not is_loopback(http.host):
            raise InvalidArgument("HTTP off loopback requires an API key (see settle_token)")
        http_sock, http = bind(http)
    server = Server(engine, tokens=[token] if token else [], require_token=address.kind == "tcp",
                    max_frame_bytes=max_frame_bytes)
    lost: list[BaseException] = []  # the engine's runner, if it is lost (tensor parallel)
    async with engine:
        listener, bound = await open_listener(address)
        try:
            async with anyio.create_task_group() as tg:
                if hasattr(engine, "wait_lost"):
                    tg.start_soon(_stop_on_lost_runner, engine, tg.cancel_scope, lost)
                await tg.start(server.serve, listener)
                if http_sock is not None:
                    from runtime.server.http.app import create_app, serve_http

                    extra = {} if tool_hold_s is None else {"tool_wait_s": tool_hold_s}
                    app = create_app(engine, api_key=api_key, api_keys=api_keys, mcp=mcp,
                                     cors_origins=cors_origins, **extra)
                    await tg.start(serve_http, app, http_sock)
                    if http_ready is not None:
                        http_ready(http)
                if handle_signals:
                    tg.start_soon(_stop_on_signal, tg.cancel_scope)
                if ready is not None:
                    ready(bound)
        finally:
            if bound.kind == "unix":
                with contextlib.suppress(OSError):
                    os.unlink(bound.path)
        if lost:
            raise lost[0]  # a non-zero exit: the engine cannot serve any more


async def _stop_on_lost_runner(engine: Any, scope: anyio.CancelScope,
                               lost: list[BaseException]) -> None:
    lost.append(await engine.wait_lost())
    await anyio.sleep(0.5)  # the failed requests' replies go out first
    scope.cancel()


async def _stop_on_signal(scope: anyio.CancelScope) -> None:
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for _ in signals:
            scope.cancel()
            return
