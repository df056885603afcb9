"""Run a server in the background of a test (or of a benchmark), on a real socket.

Owns: the background task group, the listener and, for the default address, the private
temporary folder holding the Unix socket. Leaving the context stops accepting, cancels
every connection (releasing each client's contexts) and removes the socket file.

Usage::

    async with serve_in_background(make_engine()) as srv:
        async with SocketTransport.open(srv.address) as transport: ...
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import anyio

from pie_ctx.proto.address import Address, new_token, parse_address
from pie_ctx.proto.framing import DEFAULT_MAX_FRAME_BYTES
from runtime.server.run import open_listener
from runtime.server.server import Server

__all__ = ["BackgroundServer", "serve_in_background", "serve_http_in_background"]


@dataclass(frozen=True, slots=True)
class BackgroundServer:
    """Where the background server listens, the token it requires, and the server itself."""

    address: str
    token: str | None
    server: Server


@contextlib.asynccontextmanager
async def serve_in_background(engine: Any, *, address: str | None = None, tcp: bool = False,
                              token: str | None = None,
                              max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
                              run_engine: bool = True,
                              extra_tokens: tuple[str, ...] = ()) -> AsyncIterator[BackgroundServer]:
    """Serve ``engine`` until the block exits.

    Args:
        engine: the engine to serve.
        address: where to listen; default: a fresh private Unix socket, or with
            ``tcp=True`` a free loopback port (``tcp:127.0.0.1:0``).
        tcp: listen on loopback TCP (a token is generated when none is given).
        token: the token clients must present (required for TCP, optional for Unix).
        max_frame_bytes: largest frame accepted from a client.
        run_engine: enter ``async with engine`` here; pass False if it is already running.
        extra_tokens: more accepted tokens, each with its own snapshot namespace.

    Yields:
        A :class:`BackgroundServer` with the bound address (``"unix:..."``/``"tcp:..."``).
    """
    tmpdir: str | None = None
    if address is None and not tcp:
        tmpdir = tempfile.mkdtemp(prefix="pie-srv-")
        os.chmod(tmpdir, 0o700)
        addr = Address("unix", path=os.path.join(tmpdir, "s.sock"))
    elif address is None:
        addr = Address("tcp", host="127.0.0.1", port=0)
    else:
        addr = parse_address(address)
    if addr.kind == "tcp" and token is None:
        token = new_token()
    tokens = ([token] if token else []) + list(extra_tokens)
    server = Server(engine, tokens=tokens, require_token=addr.kind == "tcp",
                    max_frame_bytes=max_frame_bytes)
    try:
        async with contextlib.AsyncExitStack() as stack:
            if run_engine:
                await stack.enter_async_context(engine)
            listener, bound = await open_listener(addr)
            tg = await stack.enter_async_context(anyio.create_task_group())
            await tg.start(server.serve, listener)
            try:
                yield BackgroundServer(address=str(bound), token=token, server=server)
            finally:
                tg.cancel_scope.cancel()
    finally:
        if tmpdir is not None:
            shutil.rmtree(tmpdir, ignore_errors=True)


@contextlib.asynccontextmanager
async def serve_http_in_background(engine: Any, *, api_key: str | None = None,
                                   host: str = "127.0.0.1") -> AsyncIterator[str]:
    """Serve the HTTP API of ``engine`` (already running) on a free port of ``host`` until
    the block exits; yields its base URL (``http://127.0.0.1:PORT``)."""
    from runtime.server.http.app import HttpAddress, bind, create_app, serve_http

    sock, bound = bind(HttpAddress(host, 0))
    async with anyio.create_task_group() as tg:
        await tg.start(serve_http, create_app(engine, api_key=api_key), sock)
        try:
            yield str(bound)
        finally:
            tg.cancel_scope.cancel()
