"""The ``pie-ctx`` command: run inferlets, manage cached models, serve an engine.

    pie-ctx run FILE.py [--model M] [--page-size N] [--connect ADDR] [-v] [-- INFERLET ARGS]
    pie-ctx models [list] | pie-ctx models pull [NAME]
    pie-ctx stats [ADDRESS] [--json]                  (a running server's counters)
    pie-ctx serve ...                                  (see docs/server.md)

An inferlet is a Python file defining ``async def main(rt, args)``: ``rt`` is the
``pie_ctx.Runtime``, ``args`` an ``argparse.Namespace`` of the words after ``--``, parsed by
the inferlet's own ``add_arguments(parser)`` if it defines one, else collected as the list
``args.argv``. What ``main`` returns, unless None, is printed.

This module is the program's entry point, so it sits above both packages: besides the SDK
it imports ``runtime.server.cli`` (to offer ``serve``) and, in ``models``, the loader.
Every other SDK module stays clear of ``runtime``.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import logging
import reprlib
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

from pie_ctx.proto.address import default_socket_path, parse_address, read_token_file
from pie_ctx.proto.errors import InvalidArgument, PieError

__all__ = ["main", "load_inferlet", "inferlet_args"]


# What an inferlet defines, for the one-line errors of ``load_inferlet``.
MAIN_SHAPE = "async def main(rt, args)"
MAIN_ARGS = ("rt: the pie_ctx.Runtime; args: an argparse.Namespace of the words after `--`, "
             "parsed by add_arguments(parser) if the file defines it, else as args.argv")
ADD_ARGUMENTS_SHAPE = "def add_arguments(parser)"


def load_inferlet(path: str | Path) -> ModuleType:
    """Import an inferlet file as a module and check the shape of its entry points.

    An inferlet defines ``async def main(rt, args)``, where ``rt`` is the
    ``pie_ctx.Runtime`` and ``args`` what ``inferlet_args`` makes of the words after
    ``--``, and optionally ``def add_arguments(parser)`` for its own options. What
    ``main`` returns, unless None, is printed.

    Errors raised by the file's own code (a ``SyntaxError``, an exception at import) keep
    their traceback: they are the inferlet's bugs, not the runner's.

    Raises:
        InvalidArgument: the file is missing, or has no ``main``, or ``main`` is not
            ``async def main(rt, args)`` (not async, or not callable with two arguments),
            or ``add_arguments`` is not ``def add_arguments(parser)``. The message is one
            line showing the expected shape.
    """
    file = Path(path)
    if not file.is_file():
        raise InvalidArgument(f"inferlet {file} does not exist")
    spec = importlib.util.spec_from_file_location(f"inferlet_{file.stem}", file)
    if spec is None or spec.loader is None:
        raise InvalidArgument(f"{file} is not a Python file")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    main = getattr(module, "main", None)
    if main is None:
        raise InvalidArgument(f"{file} has no main: an inferlet defines `{MAIN_SHAPE}` "
                              f"({MAIN_ARGS})")
    if not inspect.iscoroutinefunction(main) or not _accepts(main, 2):
        raise InvalidArgument(f"{file}: main must be `{MAIN_SHAPE}`, not "
                              f"`{_shape('main', main)}` ({MAIN_ARGS})")
    add = getattr(module, "add_arguments", None)
    if add is not None and (inspect.iscoroutinefunction(add) or not _accepts(add, 1)):
        raise InvalidArgument(f"{file}: add_arguments must be `{ADD_ARGUMENTS_SHAPE}`, not "
                              f"`{_shape('add_arguments', add)}` (parser: the "
                              f"argparse.ArgumentParser of the inferlet's own options)")
    return module


def _accepts(fn: Any, num_args: int) -> bool:
    """Whether ``fn`` can be called with ``num_args`` positional arguments."""
    if not callable(fn):
        return False
    try:
        inspect.signature(fn).bind(*([None] * num_args))
    except TypeError:
        return False
    except ValueError:  # no signature to read (a builtin): let the call decide
        return True
    return True


def _shape(name: str, fn: Any) -> str:
    """How ``name`` was defined, as one line: ``def main(rt)``, ``main = 3``..."""
    if not callable(fn):
        return f"{name} = {reprlib.repr(fn)}"
    try:
        sig = str(inspect.signature(fn))
    except ValueError:
        sig = "(...)"
    return f"{'async ' if inspect.iscoroutinefunction(fn) else ''}def {name}{sig}"


def inferlet_args(module: ModuleType, argv: list[str], prog: str) -> argparse.Namespace:
    """The ``args`` that ``pie-ctx run`` passes to ``async def main(rt, args)``: an
    ``argparse.Namespace`` of ``argv`` (the words after ``--``).

    A file that defines ``def add_arguments(parser)`` declares its options on ``parser``
    (an ``argparse.ArgumentParser``) and gets them parsed, as attributes. A file without
    it gets every word as given in the list ``args.argv`` (a lone ``-h`` or ``--help``
    prints the file's docstring instead).
    """
    parser = argparse.ArgumentParser(prog=prog, description=(module.__doc__ or "").strip() or None)
    if callable(getattr(module, "add_arguments", None)):
        module.add_arguments(parser)
        return parser.parse_args(argv)
    parser.add_argument("argv", nargs="*", help="words for the inferlet (args.argv)")
    if argv in (["-h"], ["--help"]):
        return parser.parse_args(argv)  # prints the help and exits
    return argparse.Namespace(argv=list(argv))


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
    run.add_argument("--backend", choices=("asyncio", "trio"), default="asyncio",
                     help="async library to run the inferlet under")
    run.add_argument("-v", "--verbose", action="store_true",
                     help="print a one-line engine summary at the end")
    run.set_defaults(func=_run)

    models = sub.add_parser("models", help="list or fetch cached models")
    msub = models.add_subparsers(dest="models_command")
    msub.add_parser("list", help="list cached models (the default)")
    pull = msub.add_parser("pull", help="fetch and convert a model ahead of time")
    pull.add_argument("name", nargs="?", default="default", help="model (default: the default)")
    models.set_defaults(func=_models)

    stats = sub.add_parser("stats", help="print a running server's page and cache stats")
    stats.add_argument("address", nargs="?", default=None,
                       help="unix:PATH, tcp:HOST:PORT or a socket path (default: the default socket)")
    stats.add_argument("--token-file", default=None, help="the server's token file")
    stats.add_argument("--json", action="store_true", help="print one JSON object")
    stats.set_defaults(func=_stats)

    register(sub)
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

    result = anyio.run(go, backend=args.backend)
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
    argv = list(sys.argv[1:] if argv is None else argv)
    rest: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, rest = argv[:cut], argv[cut + 1 :]
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if getattr(args, "verbose", False) else logging.WARNING,
                        format="pie-ctx: %(message)s")
    try:
        if args.func in (_run, _models):
            return args.func(args, rest)
        return args.func(args)
    except PieError as err:
        print(f"pie-ctx: error: {err}", file=sys.stderr)
        return 1 if args.func is _run else 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
