"""Engines booted before their replicas (``runtime.fleet.engines``), outside Ray Serve:
a replica adopts an early engine instead of starting one; an engine adopted by a process
that is then killed exits and takes its folder; the engines no replica took are stopped
when the fleet serves; and nothing is left after ``close``."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("ray.serve")

from pie_ctx.proto.errors import InvalidArgument  # noqa: E402
from runtime.fleet.app import boot_early, build_app  # noqa: E402
from runtime.fleet.engines import OWNER, EarlyEngines  # noqa: E402
from runtime.fleet.replica import EngineReplica  # noqa: E402
from tests.fleet.temp_roots import replica_folders, short_temp_root, wait_until  # noqa: E402
from tests.sdk.harness import tiny_model_folder  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def temp_root() -> Iterator[Path]:
    with short_temp_root("pce-") as root:
        yield root


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is gone (its parent reaps it)
        return f.read().split(") ", 1)[1][0] != "Z"


def test_replicas_adopt_early_engines_and_die_with_them(tmp_path, temp_root) -> None:
    model = tiny_model_folder(tmp_path / "model")
    shared = tmp_path / "shared"
    shared.mkdir()
    args = ["--model", str(model), "--page-size", "4", "--num-pages", "64"]
    early = boot_early(args, shared, replicas=2, temp_dir=str(temp_root))
    try:
        assert len(replica_folders(temp_root)) == 2
        pids = [int((Path(f) / "pid").read_text()) for f in early.folders]
        # a stand-in replica process takes the first free engine, then is killed
        other = subprocess.Popen(
            [sys.executable, "-c",
             "import sys, time\nfrom runtime.fleet.engines import claim\n"
             f"print(claim({early.folders!r})[0], flush=True)\ntime.sleep(120)"],
            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE,
            text=True)
        taken = other.stdout.readline().strip()  # type: ignore[union-attr]
        assert taken == early.folders[0]
        replica = EngineReplica(args, str(shared.resolve()), early=early.folders)
        try:
            assert replica.adopted and replica.proc.pid == pids[1]
            assert Path(replica.socket).parent == Path(early.folders[1])
            assert replica.info()["engine_pid"] == pids[1]
            replica.check_health()
            assert early.release() == 0  # both taken: nothing to stop
            other.kill()
            other.wait()
            assert wait_until(lambda: not alive(pids[0]), 20), "the engine outlived its owner"
            assert wait_until(lambda: not Path(early.folders[0]).exists(), 10)
            assert alive(pids[1])  # the other engine's owner lives
        finally:
            replica.__del__()  # what Serve calls on a graceful stop
        assert replica.proc.exited() and replica_folders(temp_root) == []
    finally:
        early.close()
    assert replica_folders(temp_root) == [] and not any(alive(p) for p in pids)


def test_engines_no_replica_took_are_stopped_and_options_must_match(tmp_path,
                                                                     temp_root) -> None:
    early = EarlyEngines(lambda sock: [sys.executable, "-c", "import time; time.sleep(60)"],
                         2, temp_dir=str(temp_root))
    try:
        (Path(early.folders[0]) / OWNER).write_text(str(os.getpid()))  # a replica took it
        assert early.release() == 1
        pid = int((Path(early.folders[1]) / "pid").read_text())
        assert wait_until(lambda: not alive(pid), 10)
    finally:
        early.close()
    assert replica_folders(temp_root) == []
    shared = tmp_path / "shared"
    shared.mkdir()
    early = boot_early(["--model", str(tmp_path / "m")], shared, replicas=0,
                       temp_dir=str(temp_root))
    with pytest.raises(InvalidArgument, match="other engine options"):
        build_app(["--model", str(tmp_path / "other")], shared, early=early)
    early.close()
