"""pie-ctx vs llama.cpp at the sizes people run on a CPU: 1B-8B shapes, one Q4_K_M file each.

    .venv/bin/python benchmarks/scale.py [--shapes 1b,1.5b,8b] [--ftype Q4_K_M]
        [--weights auto] [--threads 2] [--work-dir DIR] [--prompt-len 512]
        [--new-tokens 64] [--long-ctx 8192] [--long-new-tokens 16] [--decode8-n 8]
        [--decode8-prompt-len 1024] [--decode8-new-tokens 16] [--n 8]
        [--bon-prompt-len 1024] [--bon-new-tokens 64] [--big-factor 0.25] [--smoke]

Models: random weights in the exact shapes of Llama-3.2-1B (``1b``: tied embeddings,
llama3 rope scaling factor 32), Qwen2.5-1.5B (``1.5b``, keys ``scale_1p5b_*``: qkv bias,
tied) and Llama-3.1-8B (``8b``: untied, rope factor 8), written as F16 GGUF by the ``gguf``
package and quantized by llama.cpp's own quantizer (``llama_cpp.llama_model_quantize``) to
--ftype (``benchmarks/scale_models.py``); both engines read the same file. The files are
built once into --work-dir (default ``<pie-ctx cache>/bench-scale``; the 1B needs ~2.5 GB
of F16 on the way, the 8B 16 GB, deleted after quantizing) and reused.

Rows, side by side in one process on --threads threads (torch's and llama.cpp's, all on the
engine's model thread as in ``vs_llamacpp.py``, whose llama.cpp driver this reuses):

1. prefill of a --prompt-len prompt, tok/s;
2. greedy decode after it, tok/s (--new-tokens - 1 steps);
3. greedy decode at --long-ctx tokens of context, tok/s (--long-new-tokens - 1 steps);
4. --decode8-n contexts of --decode8-prompt-len tokens decoding together, tok/s over all;
5. best-of---n: a --bon-prompt-len prompt, --n samples of --bon-new-tokens, wall s;
6. load time: a fresh process loads the file (pie-ctx: ``boot_engine`` with --weights,
   kernels chosen; llama.cpp: ``Llama(path)``), seconds. pie-ctx loads twice: first as
   the first load on a machine (``PIE_CTX_MACHINE_CACHE=refresh``: the kernel probe and
   the calibration pass run and are kept; ``scale_L_ours_first_load_s``), then as every
   later load does (the ratio's figure);
7. resident memory (VmRSS) of that process after a 64-token prefill and 8 decode steps,
   MB (the whole process: pie-ctx's includes torch);
8. the machine's memory bandwidth, measured in the same run: a copy loop over 1 GiB on
   --threads threads (bytes read + written per second), and decode's share of it: bytes a
   decode step reads (the file's tensors but the embedding table, plus the KV at that
   context) x tok/s / bandwidth.

The 8B shape runs its contexts times --big-factor (default 0.25: prefill 128, decode at
2,048...); the table says what ran. Prompts are random token ids (the text means nothing
to random weights). Prints a table and, last, one JSON line: per shape label L
``scale_L_{decode,prefill,decode8,bon,decode_8k}_vs_llamacpp`` (> 1: pie-ctx faster),
``scale_L_rss_vs_llamacpp`` and ``scale_L_load_s_vs_llamacpp`` (ours / theirs: < 1 is
less), ``scale_L_decode_roofline_frac`` (pie-ctx's; llama.cpp's under
``scale_L_llamacpp_decode_roofline_frac``) and the raw figures.

Without llama-cpp-python only ``--smoke`` runs (the gguf package writes a Q8_0 file and
only pie-ctx is measured); the full run says how to install it and exits.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import torch
from common import ROOT, emit, parse_args, table
from scale_models import SHAPES, Shape, build, bytes_per_token

INSTALL = ".venv/bin/pip install llama-cpp-python==0.3.36"
PAGE_SIZE = 16


def without_extra_buffers(lib: Any) -> None:
    """Make llama.cpp load models without its extra CPU buffer types (``use_extra_bufts``:
    the AMX and repacked weight layouts), for ``--llamacpp-extra-buffers off``: on some
    machines with AMX its AMX matmul crashes (seen: ``ggml_backend_amx_mul_mat``, SIGSEGV).
    Its figures are then slower than its best; the table says so."""
    import llama_cpp.llama_cpp as low

    default = low.llama_model_default_params

    def params() -> Any:
        p = default()
        p.use_extra_bufts = False
        return p

    low.llama_model_default_params = params


def bandwidth(threads: int, gib: float = 1.0, repeats: int = 5) -> float:
    """Bytes per second a copy of ``gib`` GiB moves (read + written), best of ``repeats``,
    on ``threads`` torch threads (call on the model thread)."""
    torch.set_num_threads(threads)
    n = int(gib * 2**30) // 4
    src = torch.ones(n, dtype=torch.float32)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return 2 * n * 4 / best


def rss_mb() -> float:
    """This process's resident memory (VmRSS), MB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def probe(side: str, gguf: str, threads: int, weights: str,
          extra_buffers: bool = True) -> dict[str, float]:
    """Load ``gguf`` in this (fresh) process on ``side`` and run a 64-token prefill and 8
    decode steps; returns load seconds and resident MB."""
    ids = [int(i) for i in np.random.default_rng(1).integers(300, 900, 64)]
    if side == "llamacpp":
        import llama_cpp

        if not extra_buffers:
            without_extra_buffers(llama_cpp)

        t0 = time.perf_counter()
        llm = llama_cpp.Llama(gguf, n_ctx=256, n_batch=64, n_threads=threads,
                              n_threads_batch=threads, verbose=False)
        load = time.perf_counter() - t0
        llm.eval(ids)
        for _ in range(8):
            llm.eval([ids[0]])
        return {"load_s": load, "rss_mb": rss_mb()}
    from pie_ctx import Context, Runtime, Sampler
    from runtime.boot import boot_engine

    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    engine = boot_engine(gguf, page_size=PAGE_SIZE, kv_memory_gb=0.25, weights=weights,
                         progress=False)
    load = time.perf_counter() - t0

    async def run() -> None:
        async with engine, Runtime.local(engine=engine) as rt:
            await Context(rt).append(ids).generate(Sampler.greedy(), max_tokens=9,
                                                   ignore_eos=True).tokens()

    anyio.run(run)
    return {"load_s": load, "rss_mb": rss_mb()}


def probe_in_child(side: str, gguf: Path, threads: int, weights: str,
                   extra_buffers: str, first: bool = False) -> dict[str, float]:
    """:func:`probe` in a fresh interpreter (its load time and memory are its own).
    ``first``: as the first load on this machine (``PIE_CTX_MACHINE_CACHE=refresh``: the
    kernel probe and the calibration run, and are kept for the loads after it)."""
    cmd = [sys.executable, str(Path(__file__)), "--probe", side, "--probe-gguf", str(gguf),
           "--threads", str(threads), "--weights", weights,
           "--llamacpp-extra-buffers", extra_buffers]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    if first:
        env["PIE_CTX_MACHINE_CACHE"] = "refresh"
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"the {side} probe failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def prompts(n: int, length: int, vocab: int, salt: int) -> list[list[int]]:
    """``n`` random prompts of ``length`` ids (no control tokens), distinct by ``salt``."""
    rng = np.random.default_rng(salt)
    return [[int(i) for i in rng.integers(0, vocab - 2, length)] for _ in range(n)]


async def ours_single(engine: Any, prompt: list[int], new_tokens: int) -> tuple[float, float]:
    """(prefill tok/s, decode tok/s over new_tokens - 1 steps) of one context."""
    from pie_ctx import Context, Runtime, Sampler

    async with Runtime.local(engine=engine) as rt:
        ctx = Context(rt).append(prompt)
        t0 = time.perf_counter()
        await ctx.flush()
        t1 = time.perf_counter()
        out = await ctx.generate(Sampler.greedy(), max_tokens=new_tokens,
                                 ignore_eos=True).tokens()
        t2 = time.perf_counter()
    assert len(out) == new_tokens
    return len(prompt) / (t1 - t0), (new_tokens - 1) / (t2 - t1)


def sizes(args: argparse.Namespace, shape: Shape) -> dict[str, int]:
    """The token counts this shape runs (the 8B shape's contexts scaled by --big-factor)."""
    f = args.big_factor if shape.label == "8b" else 1.0

    def scaled(v: int) -> int:
        return max(PAGE_SIZE, int(v * f))

    return {"prompt": scaled(args.prompt_len), "long": scaled(args.long_ctx),
            "d8_prompt": scaled(args.decode8_prompt_len), "bon_prompt": scaled(args.bon_prompt_len),
            "d8_n": args.decode8_n, "new": args.new_tokens, "long_new": args.long_new_tokens,
            "d8_new": args.decode8_new_tokens, "bon_new": args.bon_new_tokens}


async def measure(args: argparse.Namespace, shape: Shape, gguf: Path,
                  lib: Any | None) -> dict[str, Any]:
    """Every speed row of one shape, both engines (llama.cpp when ``lib``)."""
    from best_of_n import run_ours
    from vs_llamacpp import LlamaCpp, decode_many_ours

    from runtime.boot import boot_engine

    sz = sizes(args, shape)
    kv_tokens = max(sz["long"] + sz["long_new"], args.decode8_n * (sz["d8_prompt"] + sz["d8_new"]),
                    sz["bon_prompt"] + args.n * sz["bon_new"]) + 64 * PAGE_SIZE
    kv_gb = kv_tokens * shape.layers * 2 * shape.kv_heads * shape.head_dim * 4 / 2**30
    engine = boot_engine(str(gguf), page_size=PAGE_SIZE, kv_memory_gb=kv_gb,
                         weights=args.weights, progress=False)
    on_model = engine.run_on_model_thread
    model_thread = on_model(threading.current_thread)
    vocab = engine.info().vocab_size
    res: dict[str, Any] = {"sizes": sz,
                           "weights": getattr(engine.info(), "weights", args.weights)}
    res["bandwidth"] = on_model(bandwidth, args.threads)
    llama = None
    try:
        if lib is not None:
            n_ctx = max(sz["prompt"] + sz["new"], sz["long"] + sz["long_new"]) + 64
            llama = on_model(LlamaCpp, lib, gguf, args.threads, -(-n_ctx // 256) * 256, 512)
            need = sz["bon_prompt"] + args.n * sz["bon_new"]
            why = on_model(llama.open_shared, args.n, -(-need // 256) * 256)
            res["bon_mode"] = "independent" if why else "shared-prompt"
            need = args.decode8_n * (sz["d8_prompt"] + sz["d8_new"])
            why = on_model(llama.open_many, args.decode8_n, -(-need // 256) * 256)
            res["decode8_mode"] = why or "one llama_decode per step"
        async with engine:
            warm = prompts(1, 32, vocab, 99)[0]
            await ours_single(engine, warm, 4)
            if llama is not None:
                on_model(llama.generate, warm, 4)
            rows: dict[str, dict[str, float]] = {"ours": {}, "llamacpp": {}}
            p = prompts(1, sz["prompt"], vocab, 1)[0]
            long = prompts(1, sz["long"], vocab, 2)[0]
            many = prompts(args.decode8_n, sz["d8_prompt"], vocab, 3)
            bon = prompts(1, sz["bon_prompt"], vocab, 4)[0]
            rows["ours"]["pf"], rows["ours"]["dec"] = await ours_single(engine, p, sz["new"])
            _, rows["ours"]["dec_long"] = await ours_single(engine, long, sz["long_new"])
            rows["ours"]["d8"] = await decode_many_ours(engine, many, sz["d8_new"])
            rows["ours"]["bon"] = (await run_ours(engine, bon, args.n, sz["bon_new"], 0))[0]
            if llama is not None:
                _, pf, dec = on_model(llama.generate, p, sz["new"])
                rows["llamacpp"]["pf"], rows["llamacpp"]["dec"] = len(p) / pf, (sz["new"] - 1) / dec
                _, _, dec = on_model(llama.generate, long, sz["long_new"])
                rows["llamacpp"]["dec_long"] = (sz["long_new"] - 1) / dec
                if llama.many_ctx is not None:
                    rows["llamacpp"]["d8"] = on_model(llama.decode_many, many, sz["d8_new"])
                rows["llamacpp"]["bon"] = on_model(llama.best_of, bon, args.n, sz["bon_new"], 0)
        res["rows"] = rows
    finally:
        if llama is not None:  # (the engine's thread is gone once it has exited)
            llama.close()
    del engine, on_model
    model_thread.join(timeout=60)
    return res


def report(shape: Shape, gguf: Path, res: dict[str, Any], loads: dict[str, dict[str, float]],
           out: dict[str, Any]) -> None:
    """Print one shape's table and add its keys to ``out``."""
    sz, rows, bw = res["sizes"], res["rows"], res["bandwidth"]
    ours, theirs = rows["ours"], rows["llamacpp"]
    b_dec = bytes_per_token(gguf, sz["prompt"])

    def ratio(key: str, wall: bool = False) -> float | None:
        a, b = ours.get(key), theirs.get(key)
        if a is None or b is None:
            return None
        return b / a if wall else a / b

    def cell(side: dict[str, Any], key: str) -> str:
        v = side.get(key)
        return f"{v:10.2f}" if v is not None else f"{'-':>10}"

    def fmt(v: float | None) -> str:
        return f"{v:.2f}" if v is not None else "-"

    lines = [("row", f"{'pie-ctx':>10}{'llama.cpp':>10}  ratio (> 1: pie-ctx faster)")]
    for key, label, wall in (("pf", f"prefill {sz['prompt']} tok/s", False),
                             ("dec", f"decode @{sz['prompt']} tok/s", False),
                             ("dec_long", f"decode @{sz['long']} tok/s", False),
                             ("d8", f"{sz['d8_n']}x decode @{sz['d8_prompt']} tok/s", False),
                             ("bon", f"best-of-n ({sz['bon_prompt']} + {sz['bon_new']}) s", True)):
        lines.append((label, f"{cell(ours, key)}{cell(theirs, key)}  {fmt(ratio(key, wall))}"))
    lo, lt = loads.get("ours", {}), loads.get("llamacpp", {})
    for key, label in (("first_load_s", "first load on a machine s"),
                       ("load_s", "load s (fresh process)"), ("rss_mb", "resident MB")):
        a, b = lo.get(key), lt.get(key)
        lines.append((label, f"{cell(lo, key)}{cell(lt, key)}  "
                             f"{fmt(a / b if a and b else None)} (ours / theirs)"))
    frac = {s: side["dec"] * b_dec / bw for s, side in (("ours", ours), ("llamacpp", theirs))
            if "dec" in side}
    lines.append(("bytes a decode step reads", f"{b_dec / 1e6:.1f} MB"))
    lines.append(("memory bandwidth (copy)", f"{bw / 1e9:.1f} GB/s"))
    lines.append(("decode share of roofline", f"{fmt(frac.get('ours'))} pie-ctx, "
                                              f"{fmt(frac.get('llamacpp'))} llama.cpp"))
    print(f"\n{shape.title} shape, random weights, {gguf.name} "
          f"({gguf.stat().st_size / 1e9:.2f} GB), pie-ctx weights={res['weights']}")
    table(lines)
    L = f"scale_{shape.label}_"
    out.update({L + "decode_vs_llamacpp": ratio("dec"), L + "prefill_vs_llamacpp": ratio("pf"),
                L + "decode8_vs_llamacpp": ratio("d8"), L + "bon_vs_llamacpp": ratio("bon", True),
                L + "decode_8k_vs_llamacpp": ratio("dec_long"),
                L + "rss_vs_llamacpp": (lo["rss_mb"] / lt["rss_mb"]) if lt else None,
                L + "load_s_vs_llamacpp": (lo["load_s"] / lt["load_s"]) if lt else None,
                L + "decode_roofline_frac": frac.get("ours"),
                L + "llamacpp_decode_roofline_frac": frac.get("llamacpp"),
                L + "bandwidth_gb_s": bw / 1e9, L + "decode_bytes_per_token": b_dec,
                L + "gguf": gguf.name, L + "sizes": sz})
    for side, vals in (("ours", ours), ("llamacpp", theirs)):
        for key, name in (("pf", "prefill_tok_s"), ("dec", "decode_tok_s"),
                          ("dec_long", "decode_long_tok_s"), ("d8", "decode8_tok_s"),
                          ("bon", "bon_wall_s")):
            out[f"{L}{side}_{name}"] = vals.get(key)
    for side, vals in (("ours", lo), ("llamacpp", lt)):
        out[f"{L}{side}_load_s"] = vals.get("load_s")
        if side == "ours":
            out[f"{L}ours_first_load_s"] = vals.get("first_load_s")
        out[f"{L}{side}_rss_mb"] = vals.get("rss_mb")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="1b", help="comma-separated: 1b, 1.5b, 8b")
    ap.add_argument("--ftype", default="Q4_K_M", help="llama.cpp's quantization of the files")
    ap.add_argument("--weights", default="auto", help="pie-ctx's --weights (auto: the blocks)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--work-dir", default=None, help="where the GGUF files are kept")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--long-ctx", type=int, default=8192)
    ap.add_argument("--long-new-tokens", type=int, default=16)
    ap.add_argument("--decode8-n", type=int, default=8)
    ap.add_argument("--decode8-prompt-len", type=int, default=1024)
    ap.add_argument("--decode8-new-tokens", type=int, default=16)
    ap.add_argument("--n", type=int, default=8, help="best-of-n samples")
    ap.add_argument("--bon-prompt-len", type=int, default=1024)
    ap.add_argument("--bon-new-tokens", type=int, default=64)
    ap.add_argument("--big-factor", type=float, default=0.25,
                    help="the 8B shape's prompt and context lengths, times this")
    ap.add_argument("--llamacpp-extra-buffers", choices=("on", "off"), default="on",
                    help="off: llama.cpp without its AMX and repacked weight layouts (for "
                         "machines where its AMX matmul crashes; slower llama.cpp figures)")
    ap.add_argument("--probe", choices=("ours", "llamacpp"), help=argparse.SUPPRESS)
    ap.add_argument("--probe-gguf", help=argparse.SUPPRESS)
    args = parse_args(ap, shapes="tiny", llamacpp_extra_buffers="off", prompt_len=32, new_tokens=4, long_ctx=64,
                      long_new_tokens=3, decode8_n=2, decode8_prompt_len=32,
                      decode8_new_tokens=3, n=2, bon_prompt_len=32, bon_new_tokens=3)
    if args.probe:
        print(json.dumps(probe(args.probe, args.probe_gguf, args.threads, args.weights,
                               args.llamacpp_extra_buffers == "on")))
        return
    torch.set_num_threads(args.threads)
    try:
        import llama_cpp as lib
    except (ImportError, OSError) as err:
        if not args.smoke:
            print(f"llama-cpp-python is not usable ({err}); install it with `{INSTALL}`.")
            emit({"skipped": f"llama-cpp-python not usable: {err}"})
            return
        lib = None
        print(f"llama-cpp-python is not usable ({err}): measuring pie-ctx only")
    if lib is not None and args.llamacpp_extra_buffers == "off":
        without_extra_buffers(lib)
        print("llama.cpp runs without its extra buffer types (no AMX, no repacked layouts)")
    from runtime.model.loader import cache

    work = Path(args.work_dir) if args.work_dir else cache.cache_root() / "bench-scale"
    out: dict[str, Any] = {"threads": args.threads, "ftype": args.ftype if lib else "Q8_0",
                           "llamacpp_extra_buffers": args.llamacpp_extra_buffers,
                           "llamacpp_version": getattr(lib, "__version__", None)}
    for key in args.shapes.split(","):
        if key not in SHAPES:
            raise SystemExit(f"unknown shape {key!r}; choose from {', '.join(SHAPES)}")
        shape = SHAPES[key]
        gguf = build(shape, work, args.ftype, lib, args.threads)
        extra = args.llamacpp_extra_buffers
        first = probe_in_child("ours", gguf, args.threads, args.weights, extra, first=True)
        loads = {"ours": probe_in_child("ours", gguf, args.threads, args.weights, extra)}
        loads["ours"]["first_load_s"] = first["load_s"]
        if lib is not None:
            loads["llamacpp"] = probe_in_child("llamacpp", gguf, args.threads, args.weights,
                                               extra)
        res = anyio.run(measure, args, shape, gguf, lib)
        report(shape, gguf, res, loads, out)
    emit(out)


if __name__ == "__main__":
    main()
