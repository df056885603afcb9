"""``pie-ctx fleet`` as a user runs it: a local Ray instance, 2 replicas, the front on the
given port, a request answered through it, and exit 0 on SIGTERM."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("ray.serve")
openai = pytest.importorskip("openai")

from tests.sdk.harness import tiny_model_folder  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def test_pie_ctx_fleet_serves_and_stops_on_sigterm(tmp_path) -> None:
    model = tiny_model_folder(tmp_path / "model")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "runtime", "fleet", "--replicas", "2", "--model", str(model),
         "--page-size", "4", "--num-pages", "256", "--http", f"127.0.0.1:{port}",
         "--snapshot-dir", str(tmp_path / "shared")],
        stderr=subprocess.PIPE, text=True, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "XDG_DATA_HOME": str(tmp_path / "d")})
    try:
        lines = []
        for line in proc.stderr:  # type: ignore[union-attr]
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
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0
