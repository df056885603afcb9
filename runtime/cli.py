"""The ``pie-ctx`` command: run inferlets, manage cached models, serve an engine.

    pie-ctx run FILE.py [--model M] [--page-size N] [--connect ADDR] [-v] [-- INFERLET ARGS]
    pie-ctx launch NAME [--connect ADDR] [-- INFERLET ARGS]   (inside `serve --inferlets DIR`)
    pie-ctx models [list] | pie-ctx models pull [NAME]
    pie-ctx stats [ADDRESS] [--json]                  (a running server's counters)
    pie-ctx serve ...                                  (see docs/server.md)

An inferlet is a Python file defining ``async def main(rt, args)``: ``rt`` is the
``pie_ctx.Runtime``, ``args`` an ``argparse.Namespace`` of the words after ``--``, parsed by
the inferlet's own ``add_arguments(parser)`` if it defines one, else collected as the list
``args.argv``. What ``main`` returns, unless None, is printed.

This module is the program's entry point, the top of the package order (docs/design.md):
besides the SDK it imports ``runtime.server.cli`` (to offer ``serve``), in ``models`` the
loader, for ``run --inferlets`` the engine's boot and the inferlet host, and for a
torchrun rank other than 0 the tensor-parallel worker. ``python -m runtime`` runs it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from pie_ctx.loading import inferlet_args, load_inferlet
from pie_ctx.proto.address import default_socket_path, parse_address, read_token_file
from pie_ctx.proto.errors import PieError

__all__ = ["main", "load_inferlet", "inferlet_args"]


def _parser() -> argparse.ArgumentParser:
    # The server ships in the same distribution; ``run`` boots an engine the same way.
    from runtime.server.cli import add_engine_arguments, register

    parser = argparse.ArgumentParser(prog="pie-ctx", description="Run and serve inferlets.")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run an inferlet file",
                         description="Run an inferlet (arguments after `--` go to it).")
    run.add_argument("file", help="the inferlet: a .py file with async def main(rt, args)")
    add_engine_arguments(run)
    run.add_argument("--connect", default=None, metavar="ADDRESS",
                     help="run against `pie-ctx serve` (unix:PATH, tcp:HOST:PORT, a socket "
                          "path, or `default` for the server's default socket)")
    run.add_argument("--token-file", default=None, help="token file for a TCP server")
    run.add_argument("--inferlets", default=None, metavar="DIR",
                     help="without --connect: the folder rt.spawn launches inferlets from")
    run.add_argument("--loop", choices=("asyncio", "trio"), default="asyncio",
                     help="async library to run the inferlet under (default asyncio)")
    run.add_argument("-v", "--verbose", action="store_true",
                     help="print a one-line engine summary at the end")
    run.set_defaults(func=_run)

    models = sub.add_parser("models", help="list or fetch cached models")
    msub = models.add_subparsers(dest="models_command")
    msub.add_parser("list", help="list cached models (the default)")
    pull = msub.add_parser("pull", help="fetch and convert a model ahead of time")
    pull.add_argument("name", nargs="?", default="default", help="model (default: the default)")
    models.set_defaults(func=_models)

    launch = sub.add_parser(
        "launch", help="launch an inferlet of the server's folder inside the server",
        description="Launch the inferlet NAME of `pie-ctx serve --inferlets DIR` inside the "
                    "server, print what it sends to its session as it comes, then what its "
                    "main returns (arguments after `--` go to it). See docs/inferlets.md.")
    launch.add_argument("name", help="the inferlet's file name in the server's folder, "
                                     "without .py")
    launch.add_argument("--connect", default="default", metavar="ADDRESS",
                        help="the server: unix:PATH, tcp:HOST:PORT, a socket path, or "
                             "`default` (the default socket)")
    launch.add_argument("--token-file", default=None, help="token file for a TCP server")
    launch.add_argument("--namespace", default=None,
                        help="the sub-namespace to launch it in (see docs/server.md)")
    launch.set_defaults(func=_launch)

    stats = sub.add_parser("stats", help="print a running server's page and cache stats")
    stats.add_argument("address", nargs="?", default=None,
                       help="unix:PATH, tcp:HOST:PORT or a socket path (default: the default socket)")
    stats.add_argument("--token-file", default=None, help="the server's token file")
    stats.add_argument("--json", action="store_true", help="print one JSON object")
    stats.set_defaults(func=_stats)

    register(sub)
    from runtime.fleet.app import register as register_fleet  # (imports no Ray until run)

    register_fleet(sub)
    return parser


def _run(args: argparse.Namespace, rest: list[str]) -> int:
    import anyio

    from pie_ctx.runtime import Runtime

    module = load_inferlet(args.file)
    iargs = inferlet_args(module, rest, prog=f"pie-ctx run {args.file} --")

    async def go() -> Any:
        if args.connect:
            address = args.connect
            if address == "default":
                address = default_socket_path()
            token = read_token_file(args.token_file) if args.token_file else None
            manager = Runtime.connect(address, token=token)
        else:
            from runtime.server.cli import engine_options

            manager = Runtime.local(args.model, **engine_options(args))
            if args.inferlets is not None:
                manager = _hosting_runtime(args)
        async with manager as rt:
            t0 = time.perf_counter()
            result = await module.main(rt, iargs)
            if args.verbose:
                s = await rt.stats()
                print(f"pie-ctx: {rt.model_name}: {time.perf_counter() - t0:.2f}s, "
                      f"{s.tokens_computed} tokens computed in {s.num_model_calls} model calls, "
                      f"pages reused {s.pages_reused} / computed {s.pages_computed} "
                      f"(hit rate {s.hit_rate:.0%}), model time {s.model_seconds:.2f}s",
                      file=sys.stderr)
        return result

    result = anyio.run(go, backend=args.loop)
    if result is not None:
        print(result)
    return 0


@asynccontextmanager
async def _hosting_runtime(args: argparse.Namespace) -> AsyncIterator[Any]:
    """``pie-ctx run --inferlets DIR``: an engine in this process that can launch DIR's
    inferlets (``rt.spawn``), and a runtime on it."""
    from pie_ctx.runtime import Runtime
    from runtime.boot import boot_engine
    from runtime.hosted.folder import InferletFolder
    from runtime.hosted.host import host_inferlets
    from runtime.server.cli import engine_options

    folder = InferletFolder(args.inferlets)  # a bad folder fails before the model loads
    async with boot_engine(args.model, **engine_options(args)) as engine:
        host_inferlets(engine, folder.path)
        async with Runtime.local(engine=engine) as rt:
            yield rt


def _launch(args: argparse.Namespace, rest: list[str]) -> int:
    """``pie-ctx launch NAME``: run a hosted inferlet and stream its session to stdout."""
    import anyio

    from pie_ctx.runtime import Runtime

    address = default_socket_path() if args.connect == "default" else args.connect
    token = read_token_file(args.token_file) if args.token_file else None

    async def go() -> str | None:
        async with Runtime.connect(address, token=token, namespace=args.namespace) as rt:
            handle = await rt.spawn(args.name, rest)
            async for text in handle.output():
                sys.stdout.write(text)
                sys.stdout.flush()
            return await handle

    result = anyio.run(go)
    if result is not None:
        print(result)
    return 0


def _models(args: argparse.Namespace, rest: list[str]) -> int:
    from runtime.model.loader import list_cached_models, resolve_model

    if args.models_command == "pull":
        name, folder = resolve_model(None if args.name == "default" else args.name)
        print(f"{name}: {folder}")
        return 0
    cached = list_cached_models()
    if not cached:
        print("no cached models; `pie-ctx models pull` fetches the default one")
    for m in cached:
        print(f"{m.name}\t{m.size_bytes / 2**20:.0f} MiB\t{m.path}")
    return 0


async def fetch_stats(address: str, token: str | None) -> dict[str, Any]:
    """Connect to a server and return its model, page size and ``EngineStats`` as a dict."""
    import msgspec

    from pie_ctx.proto import messages as P
    from pie_ctx.socket_transport import SocketTransport

    async with SocketTransport.open(address, token=token) as transport:
        stats = await transport.request(P.GetStats())
        info = transport.info
    return {"model_name": info.model_name, "page_size": info.page_size,
            "snapshot_dir": info.snapshot_dir or "(in memory)",
            **msgspec.structs.asdict(stats)}


def _stats(args: argparse.Namespace) -> int:
    """``pie-ctx stats [ADDRESS]``: print a server's counters."""
    import anyio

    address = args.address or f"unix:{default_socket_path()}"
    parse_address(address)
    token = read_token_file(args.token_file) if args.token_file else None
    stats = anyio.run(fetch_stats, address, token)
    if args.json:
        print(json.dumps(stats))
        return 0
    for key, value in stats.items():
        shown = f"{value:.3f}" if isinstance(value, float) else value
        print(f"{key:>22}  {shown}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``pie-ctx`` console script."""
    if os.environ.get("RANK", "0") != "0" and "WORLD_SIZE" in os.environ:
        # a torchrun rank other than 0: serve rank 0's tensor-parallel engine as a worker
        from runtime.distributed.launch import under_torchrun, worker_main

        if under_torchrun():
            return worker_main()
    argv = list(sys.argv[1:] if argv is None else argv)
    rest: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, rest = argv[:cut], argv[cut + 1 :]
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if getattr(args, "verbose", False) else logging.WARNING,
                        format="pie-ctx: %(message)s")
    try:
        if args.func in (_run, _models, _launch):
            return args.func(args, rest)
        return args.func(args)
    except PieError as err:
        print(f"pie-ctx: error: {err}", file=sys.stderr)
        return 1 if args.func in (_run, _launch) else 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
