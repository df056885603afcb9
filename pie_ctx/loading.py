"""Loading an inferlet file: ``load_inferlet`` checks its entry points, ``inferlet_args``
builds its ``args``. Shared by ``pie-ctx run`` and the server's hosted inferlets.

Owns nothing; importing it imports neither torch nor the runtime.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import reprlib
from pathlib import Path
from types import ModuleType
from typing import Any

from pie_ctx.proto.errors import InvalidArgument

__all__ = ["load_inferlet", "inferlet_args", "MAIN_SHAPE"]


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


def inferlet_args(module: ModuleType, argv: list[str], prog: str,
                  parser_class: type[argparse.ArgumentParser] = argparse.ArgumentParser,
                  ) -> argparse.Namespace:
    """The ``args`` that ``pie-ctx run`` passes to ``async def main(rt, args)``: an
    ``argparse.Namespace`` of ``argv`` (the words after ``--``).

    A file that defines ``def add_arguments(parser)`` declares its options on ``parser``
    (an ``argparse.ArgumentParser``) and gets them parsed, as attributes. A file without
    it gets every word as given in the list ``args.argv`` (a lone ``-h`` or ``--help``
    prints the file's docstring instead). ``parser_class`` builds the parser (the server
    passes one that raises instead of printing and exiting).
    """
    parser = parser_class(prog=prog, description=(module.__doc__ or "").strip() or None)
    if callable(getattr(module, "add_arguments", None)):
        module.add_arguments(parser)
        return parser.parse_args(argv)
    parser.add_argument("argv", nargs="*", help="words for the inferlet (args.argv)")
    if argv in (["-h"], ["--help"]):
        return parser.parse_args(argv)  # prints the help and exits
    return argparse.Namespace(argv=list(argv))
