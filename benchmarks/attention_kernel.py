"""The paged attention kernel alone (``cpu_ops.cpp`` ``paged_attention``), warm and cold.

    python benchmarks/attention_kernel.py [--repeats 20] [--baseline FILE] [--march ARCH] [--smoke]

SmolLM2-135M's attention shapes (9 query heads, 3 KV heads, head dim 64, pages of 16
slots), one layer's call, for:

* ``1x512``, ``1x2048``: one decode row over 512 / 2,048 keys;
* ``8x1024``: 8 unrelated decode rows, 1,024 keys each;
* ``fork8x1024``: 8 forks of one 1,024-token prompt (its 64 pages shared), each with 8
  keys of its own (the shared splits are read once for the 8 rows);
* ``verify8x1024``: 8 unrelated sequences of 1,024 keys with 9 new tokens each (a decode
  row and an 8-token draft: the agents benchmark's ReAct steps are mostly these);
* ``chunk128x1024``: one sequence's 128-token prefill chunk after 1,024 cached keys
  (ReAct's tool observations);
* ``chunk48x448``: a 48-token chunk after 448 cached keys (a Swarm agent's received
  message);
* ``chunk512x8192``: a 512-token prefill chunk ending at 8,192 keys (a long prompt's last
  chunk: 32 splits a row, run in waves of rows);

over fp32, bf16 and int8 pools (``--kv-dtype``), in two settings:

* ``warm``: a one-layer pool, called over and over (its KV stays in the caches: the
  kernel's arithmetic);
* ``cold``: a pool of the real model's 30 layers, a different layer each call, and a
  64 MB buffer read between calls (as the step's ~96 MB of weights do between two calls
  of one layer): keys come from DRAM with the real strides (all layers of a slot
  together, so consecutive keys of one layer sit 23 KB apart).

Each case is also timed as ``F.scaled_dot_product_attention`` over its keys gathered
beforehand into dense tensors (fp32, warm: what free numerics runs for a chunk, less the
gather), key ``sdpa_us_warm_<case>``.

``--baseline FILE`` also builds another ``cpu_ops.cpp`` (e.g. main's: ``git show
main:runtime/model/kernels/cpu_ops.cpp > /tmp/old.cpp``) and runs its kernel interleaved with
this one, call for call, so a busy machine slows both alike. Times are the best call's, in µs (on a
shared machine a descheduled thread stretches single calls by milliseconds). The last line is one JSON object: ``us_<kv>_<setting>_<case>`` (and
``base_us_...`` for the baseline).

``--march ARCH`` (x86) builds this checkout's kernel too, and the baseline, for another
instruction set than the machine's (``haswell``: AVX2 and FMA, no AVX-512), so an AVX-512
machine can time and compare the code an AVX2-only CPU runs (both run on it).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch
from common import emit, parse_args, table

S, KVH, D, H = 16, 3, 64, 9
FLUSH_MB = 64


def build_baseline(source: Path, march: str | None = None) -> Any:
    """The kernels of another ``cpu_ops.cpp`` (e.g. main's: ``git show
    main:runtime/model/kernels/cpu_ops.cpp > /tmp/old.cpp``), built alone under its own name
    (its decode step and strip kernels left out: two modules cannot both register them),
    with this checkout's ``vec16.h``; for ``-march=march`` (x86) if given, else the
    machine's own."""
    import hashlib
    import platform
    import tempfile

    from torch.utils.cpp_extension import load

    digest = hashlib.blake2b(source.read_bytes() + (march or "native").encode(),
                             digest_size=6).hexdigest()
    folder = Path(tempfile.gettempdir()) / f"pie-ctx-attention-baseline-{digest}"
    folder.mkdir(exist_ok=True)
    stub = folder / "no_decode_step.cpp"
    stub.write_text("#include <torch/extension.h>\n"
                    "void register_decode_step(pybind11::module_&) {}\n"
                    "void register_strips_mm(pybind11::module_&) {}\n")
    flags = ["-O3", "-std=c++17", "-fopenmp"]
    if platform.machine() in ("x86_64", "AMD64"):
        flags += [f"-march={march or 'native'}", "-mprefer-vector-width=512"]
    headers = Path(__file__).resolve().parent.parent / "runtime" / "model" / "kernels"
    return load(name=f"pie_ctx_attention_baseline_{digest}", sources=[str(source), str(stub)],
                extra_cflags=flags, extra_ldflags=["-fopenmp"], build_directory=str(folder),
                extra_include_paths=[str(headers)])  # vec16.h


def cases(context: int) -> dict[str, tuple[list[list[int]], list[int], int]]:
    """name -> (page tables, num_cached, new tokens a sequence); pages numbered from 0."""
    out = {}
    out["1x512"] = ([list(range(context // 2 // S))], [context // 2 - 1], 1)
    out["1x2048"] = ([list(range(2 * context // S))], [2 * context - 1], 1)
    per = context // S
    out["8x1024"] = ([list(range(i * per, (i + 1) * per)) for i in range(8)], [context - 1] * 8,
                     1)
    out["fork8x1024"] = ([list(range(per)) + [per + i] for i in range(8)], [context + 7] * 8, 1)
    per = (context + 9 + S - 1) // S  # room for the 9 new tokens
    out["verify8x1024"] = ([list(range(i * per, (i + 1) * per)) for i in range(8)],
                           [context] * 8, 9)
    out["chunk128x1024"] = ([list(range((context + 128 + S - 1) // S))], [context], 128)
    cached = context * 7 // 16  # 448 of 1,024
    out["chunk48x448"] = ([list(range((cached + 48 + S - 1) // S))], [cached], 48)
    out["chunk512x8192"] = ([list(range(8 * context // S))], [8 * context - 512], 512)
    return out


def sdpa_us(pool: torch.Tensor, tables: list[list[int]], cached: list[int], new: int,
            calls: int) -> float:
    """Best µs a call of SDPA over the case's keys gathered beforehand (one layer, fp32),
    each sequence causal over its own keys, GQA broadcast."""
    import torch.nn.functional as F

    best = []
    problems = []
    for pages, nc in zip(tables, cached, strict=True):
        kv = pool[torch.tensor(pages), :, 0].float().reshape(-1, 2, KVH, D)[: nc + new]
        k, v = (kv[:, i].transpose(0, 1).unsqueeze(0) for i in (0, 1))  # [1, KVH, L, D]
        mask = torch.arange(nc + new)[None, :] <= (nc + torch.arange(new))[:, None]
        problems.append((torch.randn(1, H, new, D), k, v, mask))
    for i in range(calls + 2):
        t0 = time.perf_counter()
        for q, k, v, mask in problems:
            F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        if i >= 2:
            best.append(time.perf_counter() - t0)
    return min(best) * 1e6


def make_pool(kv: str, pages: int, layers: int) -> torch.Tensor:
    """Random K/V in the engine's pool format, on huge pages as the engine's pool is."""
    from runtime.kv import hugepages
    from runtime.kv.layout import encode

    torch.manual_seed(0)
    x = torch.randn(pages, S, layers, 2, KVH, D)
    if kv == "bf16":
        x = x.to(torch.bfloat16)
    elif kv == "int8":
        x = encode(x, torch.empty(0, dtype=torch.int8))
    pool = hugepages.zeros(tuple(x.shape), x.dtype)
    return pool.copy_(x)


def run_case(kernels: dict[str, Any], pool: torch.Tensor, tables: list[list[int]],
             cached: list[int], new: int, calls: int, flush: torch.Tensor | None
             ) -> dict[str, float]:
    """Best µs a call of each kernel, called in turns on the same layers."""
    layers = pool.shape[2]
    width = max(map(len, tables))
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    starts = torch.arange(len(tables) + 1, dtype=torch.int32) * new
    nc = torch.tensor(cached, dtype=torch.int32)
    q = torch.randn(len(tables) * new, H, D)
    times: dict[str, list[float]] = {k: [] for k in kernels}
    for i in range(calls + 2):  # two calls warm up
        for label, ops in kernels.items():
            if flush is not None:
                flush.sum()
            t0 = time.perf_counter()
            ops.paged_attention(q, pool, i % layers, padded, starts, nc, D ** -0.5)
            if i >= 2:
                times[label].append(time.perf_counter() - t0)
    return {k: min(v) * 1e6 for k, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=20, help="calls a case, per kernel")
    parser.add_argument("--context", type=int, default=1024, help="keys of the 8-row cases")
    parser.add_argument("--kv-dtype", default="fp32,bf16,int8")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cases", default="1x512,1x2048,8x1024,fork8x1024,verify8x1024,"
                                            "chunk128x1024,chunk48x448,chunk512x8192")
    parser.add_argument("--baseline", type=Path, default=None,
                        help="another cpu_ops.cpp (e.g. main's) to build and run interleaved")
    parser.add_argument("--march", default=None, metavar="ARCH",
                        help="build both kernels for -march=ARCH (e.g. haswell: AVX2 only)")
    args = parse_args(parser, repeats=2, context=64)

    from runtime.model import kernels as kmod

    torch.set_num_threads(args.threads)
    ops = kmod.ops()
    if ops is None:
        raise SystemExit("the CPU kernels did not build here")
    kernels = {"new": ops if args.march is None else build_baseline(kmod.SOURCE, args.march)}
    if args.baseline is not None:
        kernels["base"] = build_baseline(args.baseline, args.march)
    flush = torch.ones(FLUSH_MB * 2**20 // 4 if not args.smoke else 2**16)
    all_cases = {k: v for k, v in cases(args.context).items() if k in args.cases.split(",")}
    pages = max(max(map(max, t)) for t, _, _ in all_cases.values()) + 1
    result: dict[str, float] = {}
    rows = []
    for kv in args.kv_dtype.split(","):
        for setting, layers in (("warm", 1), ("cold", 30 if not args.smoke else 2)):
            pool = make_pool(kv, pages, layers)
            for name, (tables, cached, new) in all_cases.items():
                got = run_case(kernels, pool, tables, cached, new, args.repeats,
                               flush if setting == "cold" else None)
                for label, us in got.items():
                    prefix = "" if label == "new" else "base_"
                    result[f"{prefix}us_{kv}_{setting}_{name}"] = us
                line = f"{got['new']:.1f} us"
                if kv == "fp32" and setting == "warm":
                    dense = sdpa_us(pool, tables, cached, new, args.repeats)
                    result[f"sdpa_us_{setting}_{name}"] = dense
                    line += f" (SDPA {dense:.1f} us, x{dense / got['new']:.2f})"
                if "base" in got:
                    line += f" (baseline {got['base']:.1f} us, x{got['base'] / got['new']:.2f})"
                rows.append((f"{kv} {setting} {name}", line))
            del pool
    table(rows)
    emit(result)


if __name__ == "__main__":
    main()
