"""Helpers of the replica and early-engine tests: a short temporary root of a test's own
(a Unix socket's path is limited), the replicas' folders in it, and polling."""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from runtime.fleet.replica import TEMP_PREFIX


@contextmanager
def short_temp_root(prefix: str) -> Iterator[Path]:
    """A new temporary folder, emptied and removed afterwards."""
    root = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield root
    finally:
        for p in sorted(root.rglob("*"), reverse=True):
            p.rmdir() if p.is_dir() else p.unlink()
        root.rmdir()


def replica_folders(root: Path) -> list[str]:
    """The replicas' temporary folders under ``root``, by name."""
    return sorted(p.name for p in root.iterdir() if p.name.startswith(TEMP_PREFIX))


def wait_until(check: Callable[[], bool], timeout: float = 30.0) -> bool:
    """Poll ``check`` until it holds or ``timeout`` seconds pass; its last answer."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.05)
    return check()
