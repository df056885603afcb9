"""``pie-ctx serve --tensor-parallel 2`` with a worker killed mid-generation: the client's
pending generation gets a ModelError and the server exits with status 2, no hang."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import anyio
import pytest

from pie_ctx import Context, Runtime, Sampler
from pie_ctx.errors import ModelError
from tests.parallel.tiny import tp_model_folder


def _children(pid: int) -> list[int]:
    """The processes ``pid``'s threads started (the worker comes from the model thread)."""
    return [int(c) for task in Path(f"/proc/{pid}/task").iterdir()
            for c in (task / "children").read_text().split()]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc for the worker")
async def test_server_exits_non_zero_when_a_worker_dies(tmp_path):
    folder = tp_model_folder(tmp_path)
    sock = tmp_path / "tp.sock"
    server = subprocess.Popen(
        [sys.executable, "-m", "runtime.server", "serve", "--model", str(folder),
         "--tensor-parallel", "2", "--page-size", "4", "--num-pages", "256",
         "--memory-snapshots", "--socket", str(sock)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while not sock.exists():
            assert server.poll() is None, server.stdout.read()
            assert time.monotonic() < deadline
            await anyio.sleep(0.1)
        [worker] = _children(server.pid)
        with anyio.fail_after(60):
            async with Runtime.connect(f"unix:{sock}") as rt:
                got = []
                with pytest.raises(ModelError, match="tensor-parallel rank was lost"):
                    async for token in Context(rt).user("hello world").generate(
                            Sampler.greedy(), max_tokens=400, ignore_eos=True):
                        got.append(token)
                        if len(got) == 3:
                            os.kill(worker, signal.SIGKILL)
        assert server.wait(timeout=30) == 2
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def test_torchrun_ranks_run_the_command_line_and_match_one_device(tmp_path):
    """Under ``torchrun`` every rank runs ``python -m runtime``: rank 0 the command, the
    others the worker loop; greedy output equals the single-device engine's."""
    folder = tp_model_folder(tmp_path)
    args = ["run", "examples/hello.py", "--model", str(folder), "--", "--max-tokens", "8"]
    root = Path(__file__).resolve().parents[2]
    single = subprocess.run([sys.executable, "-m", "runtime", *args], cwd=root,
                            capture_output=True, text=True, timeout=120)
    assert single.returncode == 0, single.stderr
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    ranks = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--standalone", "-m", "runtime", *args[:4], "--tensor-parallel", "2",
         *args[4:]], cwd=root, capture_output=True, text=True, timeout=180, env=env)
    assert ranks.returncode == 0, ranks.stderr[-3000:]
    assert ranks.stdout == single.stdout
