"""The engine process of a fleet replica: ``pie-ctx serve`` that dies with its replica.

Owns: the watch on the parent. A Ray replica starts its engine as
``python -m runtime.fleet.engine_proc PARENT_PID serve ...``; a thread here checks every
0.2 s that the parent still lives, and exits the process at once when it does not (a
replica killed with SIGKILL leaves no engine holding a pool, a port or the shared folder's
temp files: the next engine to open the folder sweeps them). Everything else is
``pie-ctx serve`` with the remaining arguments.
"""

from __future__ import annotations

import os
import sys
import threading
import time


def _watch(parent: int) -> None:
    while True:
        if os.getppid() != parent:
            os._exit(3)
        time.sleep(0.2)


def main(argv: list[str]) -> int:
    parent = int(argv[0])
    threading.Thread(target=_watch, args=(parent,), daemon=True,
                     name="pie-ctx-parent-watch").start()
    import argparse

    from runtime.server.cli import register

    parser = argparse.ArgumentParser(prog="pie-ctx")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv[1:])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
