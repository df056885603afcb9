"""The engine process of a fleet replica: ``pie-ctx serve`` that dies with its replica.

Owns: the watch on the parent and the replica's temporary folder (where the engine's
socket is). A Ray replica starts its engine as
``python -m runtime.fleet.engine_proc PARENT_PID TEMP_DIR serve ...``; a thread here checks
every 0.2 s that the parent still lives, and when it does not, removes ``TEMP_DIR`` and
exits the process at once (a replica killed with SIGKILL leaves no engine holding a pool,
a port, a socket folder or the shared folder's temp files: the next engine to open the
folder sweeps those). Everything else is ``pie-ctx serve`` with the remaining arguments;
however it ends, ``TEMP_DIR`` goes with it.
"""

from __future__ import annotations

import os
import shutil
import sys
import threading
import time


def _watch(parent: int, temp_dir: str) -> None:
    while True:
        if os.getppid() != parent:
            shutil.rmtree(temp_dir, ignore_errors=True)
            os._exit(3)
        time.sleep(0.2)


def main(argv: list[str]) -> int:
    parent, temp_dir = int(argv[0]), argv[1]
    threading.Thread(target=_watch, args=(parent, temp_dir), daemon=True,
                     name="pie-ctx-parent-watch").start()
    import argparse

    from runtime.server.cli import register

    try:
        parser = argparse.ArgumentParser(prog="pie-ctx")
        register(parser.add_subparsers(dest="command", required=True))
        args = parser.parse_args(argv[2:])
        return args.func(args)
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
