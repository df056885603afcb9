"""``pie-ctx fleet`` as a user runs it: a local Ray instance, 2 replicas, the front on the
given port, a request answered through it, and on SIGTERM a clean stop: exit 0, no
temporary folder of a replica left, and a log without Serve's misleading lines (a
reconnection "will not be applied", a failed ``graceful_shutdown``) or a traceback. The
same for a SIGTERM while the replicas are still starting."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

pytest.importorskip("ray.serve")
openai = pytest.importorskip("openai")

from runtime.fleet.replica import TEMP_PREFIX  # noqa: E402
from tests.sdk.harness import tiny_model_folder  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def start(tmp_path: Path, port: int, temp_root: Path) -> subprocess.Popen:
    """``pie-ctx fleet`` of 2 tiny replicas, its output (stdout and stderr) piped."""
    model = tiny_model_folder(tmp_path / "model")
    return subprocess.Popen(
        [sys.executable, "-m", "runtime", "fleet", "--replicas", "2", "--model", str(model),
         "--page-size", "4", "--num-pages", "256", "--http", f"127.0.0.1:{port}",
         "--snapshot-dir", str(tmp_path / "shared")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "XDG_DATA_HOME": str(tmp_path / "d"),
             "TMPDIR": str(temp_root)})


def replica_folders(temp_root: Path) -> list[str]:
    return [p.name for p in temp_root.iterdir() if p.name.startswith(TEMP_PREFIX)]


def assert_clean_stop(proc: subprocess.Popen, log: str, temp_root: Path) -> None:
    try:
        assert proc.returncode == 0, log[-3000:]
        assert log.rstrip().endswith("pie-ctx: stopped"), log[-3000:]
        for bad in ("Connecting to existing Serve app", "will not be applied",
                    "graceful_shutdown", "Traceback"):
            assert bad not in log, (bad, log[-3000:])
        assert replica_folders(temp_root) == []
    finally:
        shutil.rmtree(temp_root, ignore_errors=True)


def test_pie_ctx_fleet_serves_and_stops_on_sigterm(tmp_path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    temp_root = Path(tempfile.mkdtemp(prefix="pcc-"))  # short: Ray's sockets live in it
    proc = start(tmp_path, port, temp_root)
    lines: list[str] = []
    try:
        for line in proc.stdout:  # type: ignore[union-attr]
            lines.append(line)
            if "serving HTTP on" in line:
                break
        else:
            raise AssertionError("pie-ctx fleet did not start:\n" + "".join(lines[-30:]))
        assert f"http://127.0.0.1:{port} (2 engine replicas" in lines[-1]
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                               max_retries=0, timeout=300)
        got = client.completions.create(model="tiny-llama", prompt="Hello", max_tokens=2)
        assert got.usage.completion_tokens == 2
        assert len(replica_folders(temp_root)) == 2
    finally:
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=120)
        lines.append(rest)
    assert_clean_stop(proc, "".join(lines), temp_root)


def test_a_sigterm_while_replicas_start_stops_everything(tmp_path) -> None:
    temp_root = Path(tempfile.mkdtemp(prefix="pcc-"))
    proc = start(tmp_path, 0, temp_root)
    lines: list[str] = []
    try:
        for line in proc.stdout:  # type: ignore[union-attr]
            lines.append(line)
            if "Started Serve" in line:
                break
        deadline = time.monotonic() + 120
        while not replica_folders(temp_root):  # a replica is booting its engine
            assert time.monotonic() < deadline, "".join(lines)
            time.sleep(0.05)
        assert proc.poll() is None and not any("serving HTTP" in ln for ln in lines)
    finally:
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=120)
        lines.append(rest)
    assert_clean_stop(proc, "".join(lines), temp_root)
