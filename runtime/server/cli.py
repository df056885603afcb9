"""``pie-ctx serve`` and ``pie-ctx stats``: the server's command-line entry points.

``register(subparsers)`` adds both subcommands to the main ``pie-ctx`` parser; each sets
``func`` to a handler taking the parsed ``argparse.Namespace`` and returning an exit code.
Importing this module has no side effects and imports neither torch nor the engine (the
``serve`` handler loads them when it runs).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import anyio

from pie_ctx.errors import PieError
from runtime.server.endpoint import Address, default_socket_path, parse_address, read_token_file
from runtime.server.framing import DEFAULT_MAX_FRAME_BYTES

__all__ = ["register", "serve_main", "stats_main"]


def register(subparsers: Any) -> None:
    """Add the ``serve`` and ``stats`` subcommands to an argparse subparsers object."""
    serve = subparsers.add_parser(
        "serve", help="run the engine as a server for inferlets in other processes",
        description="Serve one engine over a Unix socket (default: in your runtime folder) "
                    "or over TCP (loopback by default; clients need the token).")
    serve.add_argument("--model", default=None, help="model reference (default: SmolLM2-135M)")
    serve.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    serve.add_argument("--num-pages", type=int, default=None, help="KV pool size in pages")
    serve.add_argument("--socket", default=None, help="Unix socket path to listen on")
    serve.add_argument("--host", default=None, help="TCP host (default 127.0.0.1 with --port)")
    serve.add_argument("--port", type=int, default=None, help="TCP port (0 = pick a free one)")
    serve.add_argument("--token-file", default=None,
                       help="file holding the client token; generated 0600 if missing")
    serve.add_argument("--max-frame-bytes", type=int, default=DEFAULT_MAX_FRAME_BYTES,
                       help=argparse.SUPPRESS)
    serve.set_defaults(func=serve_main)

    stats = subparsers.add_parser("stats", help="print a running server's page and cache stats")
    stats.add_argument("address", nargs="?", default=None,
                       help="unix:PATH, tcp:HOST:PORT or a socket path (default: the default socket)")
    stats.add_argument("--token-file", default=None, help="the server's token file")
    stats.add_argument("--json", action="store_true", help="print one JSON object")
    stats.set_defaults(func=stats_main)


def _listen_address(args: argparse.Namespace) -> Address:
    if args.socket is not None and (args.host is not None or args.port is not None):
        raise PieError("give either --socket or --host/--port, not both")
    if args.host is not None or args.port is not None:
        return Address("tcp", host=args.host or "127.0.0.1", port=args.port or 0)
    return Address("unix", path=args.socket or default_socket_path())


def _say(text: str) -> None:
    print(f"pie-ctx: {text}", file=sys.stderr, flush=True)


def serve_main(args: argparse.Namespace) -> int:
    """Run ``pie-ctx serve`` until SIGINT/SIGTERM; return the exit code (0 on a signal)."""
    from runtime.engine.engine import Engine
    from runtime.server.run import run_server, settle_token

    try:
        address = _listen_address(args)
        token, token_file = settle_token(address, None, args.token_file)
        engine = Engine.boot(args.model, page_size=args.page_size, num_pages=args.num_pages)
    except PieError as err:
        _say(f"error: {err}")
        return 2

    def ready(bound: Address) -> None:
        _say(f"serving {engine.model_name} on {bound} "
             f"({engine.store.num_pages_total} pages of {engine.store.page_size} tokens)")
        if token_file is not None:
            _say(f"clients need the token in {token_file}")

    try:
        anyio.run(lambda: run_server(engine, address, token=token,
                                     max_frame_bytes=args.max_frame_bytes, ready=ready))
    except PieError as err:
        _say(f"error: {err}")
        return 2
    except KeyboardInterrupt:  # a second Ctrl-C while shutting down
        pass
    _say("stopped")
    return 0


async def fetch_stats(address: str, token: str | None) -> dict[str, Any]:
    """Connect to a server and return its ``EngineStats`` as a dict."""
    import msgspec

    from pie_ctx import protocol as P
    from pie_ctx.socket_transport import SocketTransport

    transport = await SocketTransport.connect(address, token=token)
    try:
        stats = await transport.request(P.GetStats())
        info = transport.info
    finally:
        await transport.aclose()
    return {"model_name": info.model_name, "page_size": info.page_size,
            **{k: v for k, v in msgspec.structs.asdict(stats).items()}}


def stats_main(args: argparse.Namespace) -> int:
    """Print a server's stats (``pie-ctx stats ADDRESS``); return the exit code."""
    try:
        address = args.address or f"unix:{default_socket_path()}"
        parse_address(address)
        token = read_token_file(args.token_file) if args.token_file else None
        stats = anyio.run(fetch_stats, address, token)
    except (PieError, OSError) as err:
        _say(f"error: {err}")
        return 2
    if args.json:
        print(json.dumps(stats))
        return 0
    for key, value in stats.items():
        shown = f"{value:.3f}" if isinstance(value, float) else value
        print(f"{key:>18}  {shown}")
    return 0
