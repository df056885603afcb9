"""Durable snapshots: reopen after a restart vs recompute, save speed vs the raw disk, and
how many snapshots fit when the pool holds a tenth of them.

    python benchmarks/snapshots.py [--tokens 4096] [--snapshots 1000] [--snapshot-tokens 1000]
                                   [--pool-fraction 0.1] [--dir DIR] [--no-hf] [--model M]
                                   [--settle 60] [--smoke]

1. Default model (SmolLM2-135M, fp32, page size 16; ``--model`` picks another, ``--smoke``
   the tiny test model): prefill ``--tokens`` tokens (timed: the recompute), save the
   context (timed; repeated after deleting it, so every page file is written each time),
   write the same bytes as one file with one fsync (the raw disk's write speed), stop the
   engine, evict the folder's files from the OS page cache, boot a new engine on the
   folder in a new process, read that raw file back cold in one sequential stream (the
   raw disk's read speed, ``disk_read_mb_s``), then reopen the snapshot (timed:
   ``reopen_mb_s`` is the bytes it loaded from disk over that time) and compare 16 greedy
   tokens with the ones before the restart. The restart is done twice: at once after the
   save (``reopen_at_once_*``) and ``--settle`` seconds later (the headline; once if
   ``--settle`` is 0): on the VMs we run on, reading back data written seconds ago can be
   ~3x slower than a minute later. transformers' own prefill of the same tokens is timed
   too.
2. The tiny test model: save ``--snapshots`` snapshots of ``--snapshot-tokens`` distinct
   tokens with a pool that holds ``--pool-fraction`` of their pages, reopen every one
   (continuations of a sample compared), restart, reopen the sample again.

The last line is one JSON object (``reopen_after_restart_over_recompute``, ``reopen_mb_s``,
``disk_read_mb_s``, ``reopen_over_disk_read``, ``save_mb_s``, ``disk_write_mb_s``,
``snapshots_saved``, ``pool_fraction``, ``identical_after_restart``...).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import anyio
import msgspec
from common import ROOT, emit, load_hf, parse_args, prompt_tokens, table

from pie_ctx import Context, Runtime, Sampler
from pie_ctx.proto import messages as P

GREEDY = Sampler.greedy()
N_TOKENS = 16
RAW_FILE = "raw-disk.bin"  # in the snapshot directory: the raw disk's write and read


def evict_from_page_cache(folder: Path) -> None:
    """Drop the folder's files (or the file) from the OS page cache, so a reopen reads the
    disk."""
    for path in [folder] if folder.is_file() else folder.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def raw_write_seconds(path: Path, nbytes: int, chunk: int) -> float:
    """Seconds to write ``nbytes`` to the new file ``path`` in ``chunk``-byte writes, then
    fsync it: the disk's sequential write speed as this process sees it. The file stays
    (``raw_read_seconds`` reads it back)."""
    data = os.urandom(chunk)
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        left = nbytes
        while left > 0:
            left -= os.write(fd, data[: min(chunk, left)])
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - t0


def raw_read_seconds(path: Path, chunk: int = 8 << 20) -> tuple[int, float]:
    """(bytes, seconds) to read ``path`` from the disk (evicted from the page cache first)
    in one sequential stream of ``chunk``-byte reads into one buffer: the disk's cold read
    speed as this process sees it."""
    evict_from_page_cache(path)
    buf = memoryview(bytearray(chunk))
    total = 0
    t0 = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    try:
        while n := os.readv(fd, [buf]):
            total += n
    finally:
        os.close(fd)
    return total, time.perf_counter() - t0


async def continuation(ctx: Context) -> list[int]:
    fork = ctx.fork()
    try:
        return await fork.generate(GREEDY, max_tokens=N_TOKENS, ignore_eos=True).tokens()
    finally:
        await fork.release()


async def reopen_after_restart(args: argparse.Namespace, folder: Path) -> tuple[dict, list[int]]:
    from runtime.boot import boot_engine

    engine = boot_engine(args.model, page_size=16, kv_memory_gb=1.0, snapshot_dir=folder)
    tokens = prompt_tokens(engine.tokenizer, args.tokens)
    async with engine, Runtime.local(engine=engine) as rt:
        warm = Context(rt).append(prompt_tokens(engine.tokenizer, 64, salt="Warm up. "))
        await warm.generate(GREEDY, max_tokens=2).tokens()
        await warm.release()
        ctx = Context(rt).append(tokens)
        t0 = time.perf_counter()
        report = await ctx.flush()
        prefill_s = time.perf_counter() - t0
        assert report.tokens_computed == len(tokens), report
        before = await continuation(ctx)
        save_s, raw_s = [], []
        nbytes = 0
        for rep in range(args.repeats):
            if rep:
                await Context.delete(rt, "long")  # its page files go: the next save writes all
            written = (await rt.stats()).disk_bytes_written
            t0 = time.perf_counter()
            await ctx.save("long")
            save_s.append(time.perf_counter() - t0)
            nbytes = (await rt.stats()).disk_bytes_written - written
            page = engine.store.tier.page_bytes
            raw_s.append(raw_write_seconds(folder / RAW_FILE, nbytes, page))
        await ctx.release()
    at_once = reopen_in_new_process(folder, 0.0, args.model)
    reopened = (reopen_in_new_process(folder, args.settle, args.model) if args.settle > 0
                else at_once)
    reopen_s, boot_s, after = reopened["reopen_s"], reopened["boot_s"], reopened["tokens"]
    open_report = P.PassReport(**reopened["report"])
    save_med, raw_med = statistics.median(save_s), statistics.median(raw_s)
    out = {
        "tokens": len(tokens), "prefill_s": prefill_s, "reopen_s": reopen_s,
        "boot_s": boot_s, "reopen_after_restart_over_recompute": reopen_s / prefill_s,
        "reopen_mb_s": reopened["reopen_mb_s"], "disk_read_mb_s": reopened["disk_read_mb_s"],
        "reopen_over_disk_read": reopened["reopen_mb_s"] / reopened["disk_read_mb_s"],
        "reopen_at_once_s": at_once["reopen_s"],
        "reopen_at_once_over_recompute": at_once["reopen_s"] / prefill_s,
        "reopen_at_once_mb_s": at_once["reopen_mb_s"],
        "disk_read_at_once_mb_s": at_once["disk_read_mb_s"],
        "reopen_at_once_over_disk_read": at_once["reopen_mb_s"] / at_once["disk_read_mb_s"],
        "reopen_bytes": reopened["bytes_loaded"],
        "pages_from_disk": open_report.pages_from_disk,
        "pages_computed_on_open": open_report.pages_computed,
        "save_bytes": nbytes, "save_s": save_med,
        "save_mb_s": nbytes / save_med / 1e6, "disk_write_mb_s": nbytes / raw_med / 1e6,
        "save_mb_s_range": [nbytes / max(save_s) / 1e6, nbytes / min(save_s) / 1e6],
        "disk_write_mb_s_range": [nbytes / max(raw_s) / 1e6, nbytes / min(raw_s) / 1e6],
        "identical_after_restart": after == before and at_once["tokens"] == before,
    }
    out["save_over_raw"] = out["save_mb_s"] / out["disk_write_mb_s"]
    return out, tokens


def reopen_in_new_process(folder: Path, settle: float, model: str | None) -> dict:
    """The restart: a new process, as after a crash or an upgrade, with the folder's files
    evicted from the OS page cache (so the reopen reads the disk, and so does the raw
    read of the file the raw write left there)."""
    time.sleep(settle)
    evict_from_page_cache(folder)
    cmd = [sys.executable, __file__, "--reopen", str(folder)]
    out = subprocess.run(cmd + (["--model", model] if model else []), check=True,
                         capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


async def reopen(folder: Path, model: str | None) -> dict:
    """The restarted process: boot on ``folder``, read the raw file (the disk's speed, just
    before the reopen), reopen "long", generate."""
    from runtime.boot import boot_engine

    t0 = time.perf_counter()
    engine = boot_engine(model, page_size=16, kv_memory_gb=1.0, snapshot_dir=folder,
                         progress=False)
    boot_s = time.perf_counter() - t0
    raw_bytes, raw_s = raw_read_seconds(folder / RAW_FILE)
    async with engine, Runtime.local(engine=engine) as rt:
        t0 = time.perf_counter()
        opened = await Context.open(rt, "long")
        reopen_s = time.perf_counter() - t0
        loaded = (await rt.stats()).disk_bytes_loaded
        tokens = await opened.generate(GREEDY, max_tokens=N_TOKENS, ignore_eos=True).tokens()
        await opened.release()
    return {"reopen_s": reopen_s, "boot_s": boot_s, "tokens": tokens,
            "bytes_loaded": loaded, "reopen_mb_s": loaded / reopen_s / 1e6,
            "disk_read_mb_s": raw_bytes / raw_s / 1e6,
            "report": msgspec.structs.asdict(opened.open_report)}


def hf_prefill_seconds(tokens: list[int], model: str | None) -> float:
    """transformers' prefill of the same tokens on the same weights."""
    import torch

    from runtime.model.loader import resolve_model

    _, folder = resolve_model(model, progress=False)
    hf = load_hf(folder)
    ids = torch.tensor([tokens])
    with torch.inference_mode():
        hf(ids[:, :64])  # warm up
        t0 = time.perf_counter()
        hf(ids)
        return time.perf_counter() - t0


async def capacity(args: argparse.Namespace, folder: Path) -> dict:
    from tests.sdk.harness import tiny_engine, tiny_model_folder

    model = tiny_model_folder(folder / "model")
    page_size = 16
    pages_each = -(-args.snapshot_tokens // page_size)
    total_pages = args.snapshots * pages_each
    pool = max(2 * pages_each, int(total_pages * args.pool_fraction))
    rng = random.Random(7)
    sample = set(range(0, args.snapshots, max(1, args.snapshots // 20)))
    expected: dict[str, list[int]] = {}
    snaps = folder / "tiny-snapshots"
    snaps.mkdir()
    kw = {"snapshot_dir": snaps, "page_size": page_size, "num_pages": pool}
    t0 = time.perf_counter()
    async with tiny_engine(model, **kw) as engine, Runtime.local(engine=engine) as rt:
        for i in range(args.snapshots):
            ctx = Context(rt).append([rng.randrange(3, 250) for _ in range(args.snapshot_tokens)])
            await ctx.flush()
            if i in sample:
                expected[f"s{i}"] = await continuation(ctx)
            await ctx.save(f"s{i}")
            await ctx.release()
        save_all_s = time.perf_counter() - t0
        stats = await rt.stats()
        reopened, same = 0, True
        for i in range(args.snapshots):
            ctx = await Context.open(rt, f"s{i}")
            reopened += ctx.seq_len == args.snapshot_tokens
            if f"s{i}" in expected:
                same &= await continuation(ctx) == expected[f"s{i}"]
            await ctx.release()
        engine.store.check_invariants()
    async with tiny_engine(model, **kw) as engine, Runtime.local(engine=engine) as rt:
        for name, tokens in expected.items():
            ctx = await Context.open(rt, name)
            same &= await continuation(ctx) == tokens
            await ctx.release()
        listed = len(await rt.snapshots())
    return {
        "snapshots_saved": listed, "snapshots_reopened": reopened,
        "snapshot_tokens": args.snapshot_tokens, "pool_pages": pool,
        "pool_fraction": pool / total_pages, "capacity_disk_mb": stats.disk_bytes / 1e6,
        "capacity_spills": stats.num_snapshots_spilled, "capacity_save_all_s": save_all_s,
        "capacity_identical": same,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--snapshots", type=int, default=1000)
    ap.add_argument("--snapshot-tokens", type=int, default=1000)
    ap.add_argument("--pool-fraction", type=float, default=0.1)
    ap.add_argument("--dir", default=None, help="where to write (default: a temp folder)")
    ap.add_argument("--settle", type=float, default=60.0,
                    help="seconds between the save and the (second) restart: the disk's "
                         "write-back of a fresh save slows reads of it for a while here")
    ap.add_argument("--no-hf", action="store_true", help="skip transformers' prefill")
    ap.add_argument("--model", default=None,
                    help="part 1's model (default: the default model; --smoke: the tiny "
                         "test model)")
    ap.add_argument("--reopen", default=None, help=argparse.SUPPRESS)  # the restarted process
    args = parse_args(ap, tokens=64, repeats=1, snapshots=4, snapshot_tokens=40, settle=0.0,
                      no_hf=True)
    if args.reopen:
        print(json.dumps(anyio.run(reopen, Path(args.reopen), args.model)))
        return
    os.chdir(ROOT)
    folder = Path(tempfile.mkdtemp(prefix="pie-ctx-bench-", dir=args.dir))
    try:
        if args.smoke and args.model is None:
            from tests.sdk.harness import tiny_model_folder

            args.model = str(tiny_model_folder(folder / "model"))
        (folder / "default").mkdir()
        result, tokens = anyio.run(reopen_after_restart, args, folder / "default")
        if not args.no_hf:
            hf_s = hf_prefill_seconds(tokens, args.model)
            result["hf_prefill_s"] = hf_s
            result["reopen_over_hf_prefill"] = result["reopen_s"] / hf_s
        result.update(anyio.run(capacity, args, folder))
        result["identical_after_restart"] = (result["identical_after_restart"]
                                             and result["capacity_identical"])
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    table([(k, f"{v:.4g}" if isinstance(v, float) else str(v)) for k, v in result.items()])
    emit(result)


if __name__ == "__main__":
    main()
