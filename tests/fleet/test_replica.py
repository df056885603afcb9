"""``EngineReplica`` outside Ray Serve: its temporary folder (the engine's socket) is
removed on every way out: the engine killed, the replica stopped, a failed start, the
replica process killed (the engine removes it), and a folder whose owner died with its
engine is swept by the next replica."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("ray.serve")

from runtime.fleet.replica import TEMP_PREFIX, EngineReplica  # noqa: E402
from tests.fleet.temp_roots import replica_folders, short_temp_root, wait_until  # noqa: E402
from tests.sdk.harness import tiny_model_folder  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def temp_root(monkeypatch) -> Iterator[Path]:
    """The replicas' temporary root for this test (``tempfile.tempdir``)."""
    with short_temp_root("pcr-") as root:
        monkeypatch.setattr(tempfile, "tempdir", str(root))
        yield root


def test_a_killed_engine_takes_its_folder_and_stale_folders_are_swept(tmp_path, temp_root):
    model = tiny_model_folder(tmp_path / "model")
    shared = tmp_path / "shared"
    shared.mkdir()
    stale = temp_root / f"{TEMP_PREFIX}{2**22 + 12345}-gone"  # no such process
    stale.mkdir()
    (stale / "engine.sock").write_text("")
    replica = EngineReplica(["--model", str(model), "--page-size", "4", "--num-pages", "64"],
                            str(shared))
    try:
        mine = Path(replica.socket).parent
        assert replica_folders(temp_root) == [mine.name], "the stale folder was not swept"
        assert mine.name.startswith(f"{TEMP_PREFIX}{os.getpid()}-")
        replica.check_health()
        os.kill(replica.proc.pid, signal.SIGKILL)
        assert wait_until(lambda: not mine.exists(), 10), "the folder outlived its engine"
        with pytest.raises(RuntimeError, match="engine exited"):
            replica.check_health()
    finally:
        replica.__del__()
    assert replica_folders(temp_root) == []


def test_a_stopped_replica_and_a_failed_start_leave_no_folder(tmp_path, temp_root):
    shared = tmp_path / "shared"
    shared.mkdir()
    with pytest.raises(RuntimeError, match="did not start"):
        EngineReplica(["--model", str(tmp_path / "no-such-model")], str(shared))
    assert replica_folders(temp_root) == []
    model = tiny_model_folder(tmp_path / "model")
    replica = EngineReplica(["--model", str(model), "--page-size", "4", "--num-pages", "64"],
                            str(shared))
    engine = replica.proc
    assert len(replica_folders(temp_root)) == 1
    replica.__del__()  # what Serve calls on a graceful stop
    assert engine.exited() and replica_folders(temp_root) == []


def test_the_engine_removes_the_folder_when_its_replica_is_killed(temp_root) -> None:
    folder = temp_root / f"{TEMP_PREFIX}1-x"
    folder.mkdir()
    # A stand-in replica process starts the engine process, then is killed with SIGKILL.
    parent = subprocess.Popen(
        [sys.executable, "-c",
         "import os, subprocess, sys, time\n"
         f"subprocess.Popen([sys.executable, '-m', 'runtime.fleet.engine_proc', "
         f"str(os.getpid()), {str(folder)!r}, 'serve', '--help'], "
         "stdout=subprocess.DEVNULL)\n"
         "time.sleep(60)"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    time.sleep(0.5)
    parent.kill()
    parent.wait()
    assert wait_until(lambda: not folder.exists(), 10)
