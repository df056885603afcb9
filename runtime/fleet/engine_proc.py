"""The engine process of a fleet replica: ``pie-ctx serve`` that dies with its replica.

Owns: the watch on the parent and the replica's temporary folder (where the engine's
socket is). A Ray replica starts its engine as
``python -m runtime.fleet.engine_proc PARENT_PID TEMP_DIR serve ...``; a thread here checks
every 0.2 s that the parent still lives, and when it does not, removes ``TEMP_DIR`` and
exits the process at once (a replica killed with SIGKILL leaves no engine holding a pool,
a port, a socket folder or the shared folder's temp files: the next engine to open the
folder sweeps those). Everything else is ``pie-ctx serve`` with the remaining arguments;
however it ends, ``TEMP_DIR`` goes with it.

An engine the fleet's driver started early (``runtime.fleet.engines.EarlyEngines``) is
taken by a replica, which writes its pid in ``TEMP_DIR/owner``: from then on the thread
watches that process instead of the parent (the driver), so the engine dies with the
replica that serves it.
"""

from __future__ import annotations

import os
import shutil
import sys
import threading
import time


def _owner(temp_dir: str) -> int | None:
    """The pid of the replica that took this engine, if one did."""
    try:
        with open(os.path.join(temp_dir, "owner"), encoding="ascii") as f:
            text = f.read()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # (empty: the driver took it back)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process with that pid
        return True
    return True


def _watch(parent: int, temp_dir: str) -> None:
    owner: int | None = None
    while True:
        owner = owner or _owner(temp_dir)
        if not (_alive(owner) if owner else os.getppid() == parent):
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
