"""``serve``/``stats`` as real subprocesses on a tiny random Llama folder; import hygiene."""

from __future__ import annotations

import json
import os
import re
import signal
import stat
import subprocess
import sys
from pathlib import Path

import anyio
import pytest

from pie_ctx.errors import ProtocolError
from pie_ctx.proto import messages as P
from pie_ctx.socket_transport import SocketTransport
from tests.server.helpers import REPO, ServeProcess, serve_env


def _stats(tmp_path: Path, *args: str) -> dict[str, object]:
    out = subprocess.run([sys.executable, "-m", "runtime", "stats", *args, "--json"],
                         capture_output=True, text=True, env=serve_env(tmp_path), cwd=REPO, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_serve_on_unix_socket_exits_0_on_sigterm_mid_generation(tmp_path):
    sock = tmp_path / "s.sock"
    srv = ServeProcess(tmp_path, "--socket", str(sock))
    try:
        srv.wait_for(r"serving .* on unix:")
        assert stat.S_IMODE(sock.stat().st_mode) == 0o600
        stats = _stats(tmp_path, f"unix:{sock}")
        assert stats["num_pages_total"] == 64 and stats["num_contexts"] == 0

        async def client() -> None:
            async with SocketTransport.open(f"unix:{sock}") as t:
                assert t.tokenizer.encode("hello") and t.info.page_size == 16
                ctx = (await t.request(P.CreateContext())).ctx
                stream = await t.generate(P.Generate(ctx=ctx, tokens=[5, 6, 7], max_tokens=200,
                                                     stop_token_ids=[]))
                assert isinstance(await stream.__anext__(), P.GenerateChunk)
                srv.proc.send_signal(signal.SIGTERM)
                with pytest.raises(ProtocolError), anyio.fail_after(30):
                    async for _ in stream:
                        pass

        anyio.run(client)
        assert srv.proc.wait(30) == 0
        srv.wait_for("stopped", timeout=5)
        assert not sock.exists()
    finally:
        srv.stop()


def test_serve_on_tcp_writes_a_0600_token_file_and_stops_on_sigint(tmp_path):
    token_file = tmp_path / "token"
    srv = ServeProcess(tmp_path, "--port", "0", "--token-file", str(token_file))
    try:
        address = srv.wait_for(r"serving .* on (tcp:127\.0\.0\.1:\d+)").group(1)
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
        refused = subprocess.run([sys.executable, "-m", "runtime", "stats", address],
                                 capture_output=True, text=True, env=serve_env(tmp_path), cwd=REPO)
        assert refused.returncode == 2 and "token" in refused.stderr
        assert _stats(tmp_path, address, "--token-file", str(token_file))["page_size"] == 16
        srv.proc.send_signal(signal.SIGINT)
        assert srv.proc.wait(30) == 0
    finally:
        srv.stop()


def test_imports_stay_light():
    code = ("import sys, argparse, pie_ctx.loading, runtime.cli, pie_ctx.socket_transport, runtime.server.cli, "
            "runtime.server.testing\n"
            "p = argparse.ArgumentParser(); runtime.server.cli.register(p.add_subparsers())\n"
            "print(sorted(m for m in ('torch', 'numpy', 'runtime.engine.engine') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": REPO}, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_pie_ctx_run_connect_runs_an_inferlet_in_its_own_process(tmp_path):
    """`pie-ctx run FILE --connect ADDR`: two client processes, one engine; the second
    reuses the snapshot the first saved."""
    from tests.sdk.harness import tiny_model_folder

    sock = tmp_path / "s.sock"
    model = tiny_model_folder(tmp_path)

    def run_example() -> str:
        out = subprocess.run(
            [sys.executable, "-m", "runtime", "run", "examples/prefix_snapshot.py",
             "--connect", f"unix:{sock}", "--", "--max-tokens", "4"],
            capture_output=True, text=True, env=serve_env(tmp_path), cwd=REPO, timeout=120)
        assert out.returncode == 0, out.stderr
        return out.stdout

    srv = ServeProcess(tmp_path, "--socket", str(sock), model=model)
    try:
        srv.wait_for(r"snapshots: 0 in .*/data/pie-ctx/snapshots/")  # the default folder
        runs = [run_example(), run_example()]
        assert "saved 'lighthouse-handbook'" in runs[0]
        assert "saved" not in runs[1] and runs[1].count("pages shared from the snapshot") == 3
        stats = _stats(tmp_path, f"unix:{sock}")
        assert stats["num_contexts"] == 0 and stats["num_snapshots"] == 1
    finally:
        srv.stop()
    # A restart keeps the snapshot (serve's default snapshot directory); its pages come
    # back from disk, not recomputed.
    srv = ServeProcess(tmp_path, "--socket", str(sock), model=model)
    try:
        srv.wait_for(r"snapshots: 1 in ")
        after = run_example()
        assert "saved" not in after
        shared, from_disk = map(int, re.search(
            r"\((\d+) pages shared from the snapshot, (\d+) loaded from disk", after).groups())
        assert shared > 0 and from_disk >= shared
        stats = _stats(tmp_path, f"unix:{sock}")
        assert stats["disk_pages_loaded"] >= shared and stats["snapshot_dir"].startswith(
            str(tmp_path / "data"))
    finally:
        srv.stop()


def test_kv_memory_gb_sizes_the_pool_and_a_bad_size_is_refused(tiny_folder_path):
    import argparse

    from pie_ctx.proto.errors import InvalidArgument
    from runtime.boot import boot_engine
    from runtime.server.cli import add_engine_arguments, engine_options

    parser = argparse.ArgumentParser(exit_on_error=False)
    add_engine_arguments(parser)
    args = parser.parse_args(["--model", str(tiny_folder_path), "--kv-memory-gb", "0.01",
                              "--decode-share", "0.5", "--page-size", "4"])
    options = engine_options(args)
    assert options["kv_memory_gb"] == 0.01 and options["decode_share"] == 0.5
    with pytest.raises(argparse.ArgumentError, match="not allowed with"):  # one size or the other
        parser.parse_args(["--kv-memory-gb", "1", "--num-pages", "64"])
    async def main() -> None:
        async with boot_engine(args.model, progress=False, **options) as engine:
            page = engine.store.pool.kv[0].nbytes  # one page, every layer, K and V
            assert engine.store.num_pages_total == int(0.01 * 2**30) // page
            assert engine.scheduler.share.decode_share == 0.5

    anyio.run(main)
    for bad in (0, -1.0, float("inf")):
        with pytest.raises(InvalidArgument, match="kv_memory_gb"):
            boot_engine(str(tiny_folder_path), kv_memory_gb=bad, progress=False)
