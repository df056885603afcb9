"""A replica's hold on its engine process, and engines booted before their replicas.

Owns: ``SpawnedEngine`` (an engine process a replica started itself), ``AdoptedEngine``
(one the fleet's driver started early, taken by a replica) and ``EarlyEngines`` (the
driver's side: one engine per replica, booting while Ray and Serve start).

An engine's boot (model load, kernels, warm-up) does not need Ray: ``pie-ctx fleet``
starts the replicas' engines first, each in a temporary folder of its own
(``pie-ctx-replica-<driver pid>-*``, its socket and ``engine.log``, its stderr), then
starts Ray and Serve beside them. A replica starting up claims one folder (it creates
``owner`` there with ``O_EXCL``, so each engine has one replica) and writes its pid in it;
the engine process (``runtime.fleet.engine_proc``) watches its parent until an owner is
named, then that owner, and removes the folder and exits when the one it watches is
gone. A replica adopts nothing when none is free (a replacement, a replica on another
machine): it starts its own engine. When the fleet serves, the driver stops the engines
no replica took (``EarlyEngines.release``), and after the fleet stopped it reaps its
children and removes what is left of their folders (``EarlyEngines.close``).
"""

from __future__ import annotations

import os
import select
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from typing import IO

__all__ = ["SpawnedEngine", "AdoptedEngine", "EarlyEngines", "claim", "TEMP_PREFIX",
           "OWNER", "LOG"]

TEMP_PREFIX = "pie-ctx-replica-"
OWNER = "owner"  # an early engine's folder: the pid of the replica that took it
LOG = "engine.log"  # an early engine's folder: its stderr
_TICK_S = 0.05  # how often an adopted engine's log is read for more

Command = Callable[[str], list[str]]  # an engine's command line for its socket's path


class SpawnedEngine:
    """An engine process this replica started: its log is a pipe.

    Args:
        command: the engine's command line (``replica.engine_command``).
    """

    def __init__(self, command: list[str]) -> None:
        self.proc = subprocess.Popen(command, stdin=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True)
        self.pid = self.proc.pid

    def readline(self) -> str:
        """The engine's next log line; "" once it exited and all was read."""
        return self.proc.stderr.readline()  # type: ignore[union-attr]

    def exited(self) -> bool:
        return self.proc.poll() is not None

    def how(self) -> str:
        """How it ended, for messages ("status 1")."""
        return f"status {self.proc.returncode}"

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for its exit; False when ``timeout`` passed first."""
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return False
        return True

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)


class AdoptedEngine:
    """An engine the driver started and this replica took (``claim``): not a child of
    this process, so its exit is seen through a pidfd and its log read from its file.

    Args:
        pid: the engine's process id.
        log_path: its stderr's file.

    Raises:
        ProcessLookupError: it has exited already.
    """

    def __init__(self, pid: int, log_path: str) -> None:
        self.pid = pid
        self._pidfd = os.pidfd_open(pid)
        self._log: IO[str] = open(log_path, encoding="utf-8", errors="replace")
        self._partial = ""

    def readline(self) -> str:
        """The engine's next log line, waiting for it; "" once it exited and all was read."""
        while True:
            self._partial += self._log.readline()
            if self._partial.endswith("\n"):
                line, self._partial = self._partial, ""
                return line
            if self.exited():
                rest = self._partial + self._log.read()
                self._partial = ""
                return rest
            select.select([self._pidfd], [], [], _TICK_S)

    def exited(self) -> bool:
        return bool(select.select([self._pidfd], [], [], 0)[0])

    def how(self) -> str:
        return "status unknown"  # (its parent, the driver, reaps it)

    def wait(self, timeout: float | None = None) -> bool:
        return bool(select.select([self._pidfd], [], [], timeout)[0])

    def signal(self, sig: int) -> None:
        if not self.exited():
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass


def claim(folders: list[str]) -> tuple[str, AdoptedEngine] | None:
    """Take the first free early engine of ``folders`` for this process: its folder and
    the engine; None when every one is taken, gone or on another machine.

    An engine whose process has exited is skipped (its folder is its own to remove).
    """
    for folder in folders:
        try:
            fd = os.open(os.path.join(folder, OWNER), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except OSError:  # taken, or not on this machine, or removed
            continue
        with os.fdopen(fd, "w") as f:
            f.write(str(os.getpid()))
        try:
            with open(os.path.join(folder, "pid"), encoding="ascii") as f:
                pid = int(f.read())
            return folder, AdoptedEngine(pid, os.path.join(folder, LOG))
        except (OSError, ValueError):  # the engine exited and removed its folder
            continue
    return None


class EarlyEngines:
    """The driver's engines, booting before Ray: one per replica (see the module).

    Args:
        command: an engine's command line for a socket path (``replica.engine_command``
            with the fleet's options, and this process as the parent).
        count: how many.
        key: what they were started with, for the app to check against its own options.
        temp_dir: where their folders go (default: the temporary folder).
        env: their environment (default: this process's).
    """

    def __init__(self, command: Command, count: int, key: object = None,
                 temp_dir: str | None = None, env: dict[str, str] | None = None) -> None:
        self.key = key
        self.folders: list[str] = []
        self._procs: list[subprocess.Popen[bytes]] = []
        self.started = time.time()
        try:
            for _ in range(count):
                folder = tempfile.mkdtemp(prefix=f"{TEMP_PREFIX}{os.getpid()}-",
                                          dir=temp_dir)
                self.folders.append(folder)
                with open(os.path.join(folder, LOG), "wb") as log:
                    proc = subprocess.Popen(command(os.path.join(folder, "engine.sock")),
                                            stdin=subprocess.DEVNULL, stderr=log, env=env)
                self._procs.append(proc)
                # (written after the start: a replica that finds no pid file skips it)
                _write_atomic(os.path.join(folder, "pid"), str(proc.pid))
        except BaseException:
            self.close()
            raise
        for proc in self._procs:  # reap each as it exits (adopted ones, too)
            threading.Thread(target=proc.wait, daemon=True, name="pie-ctx-early-reap").start()

    def release(self) -> int:
        """Stop the engines no replica took (the driver claims them first, so none is
        taken meanwhile); return how many."""
        freed = 0
        for folder, proc in zip(self.folders, self._procs, strict=False):
            try:
                os.close(os.open(os.path.join(folder, OWNER),
                                 os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except OSError:
                continue
            freed += 1
            proc.terminate()
        return freed

    def close(self, timeout: float = 10.0) -> None:
        """Stop every engine still running (the replicas stopped theirs), wait for them,
        and remove their folders."""
        for proc in self._procs:
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + timeout
        for proc in self._procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for folder in self.folders:
            shutil.rmtree(folder, ignore_errors=True)


def _write_atomic(path: str, text: str) -> None:
    with open(path + ".tmp", "w", encoding="ascii") as f:
        f.write(text)
    os.replace(path + ".tmp", path)

