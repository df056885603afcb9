"""The projections of one step of SmolLM2 on each block kernel, interleaved in one process.

    python benchmarks/block_kernels.py [--layers 30] [--repeats 5] [--smoke]
    python benchmarks/block_kernels.py --formats [--repeats 5]

Random weights in SmolLM2-135M's shapes (per layer: qkv 960x576, o 576x576, gate_up
3072x576, down 576x1536; the lm_head 49152x576), 4-bit Q4_1 blocks (Q8_0 for the lm_head,
as in the default GGUF), every layer its own weights (so a step reads them from memory, not
a cache). For 1 row (a decode), 8 rows (a decode batch) and 512 rows (a prefill chunk; no
lm_head) it times one pass over every projection on:

* ``blocks``: block_mm.cpp's kernel, fp32 activations (the file's model exactly);
* ``blocks_q8``: block_mm_q8, the activations rounded to int8 per 32 (VNNI);
* ``blocks_q8_split``: the same with its outlier split (``OUTLIERS`` input channels kept
  out of the rounding and multiplied exactly: the default gguf path);
* ``int8``: the int8 weight path (per-row int8 weights, ``torch._int_mm``).

The kernels take turns within each repeat, so a busy machine slows them alike; the best
repeat counts. The last line is one JSON object (milliseconds a pass).

``--formats`` times each block format instead (Q4_1, Q5_0, Q5_1, Q8_0: random valid
blocks) on ``blocks`` and ``blocks_q8`` (no outlier split), 1, 8 and 64 rows, in two shapes
(576x1536, SmolLM2's down_proj; 2048x8192, Llama-3.2-1B's), each format as many distinct
weights as fill ``FORMAT_BYTES`` (read from memory, not a cache, where the last level
cache is smaller), each call timed on its own: per projection the best call,
``ms_<format>_<kernel>_<rows>_<out>x<in>``, and the bytes it read a second there
(``gbs_...``, GB/s).
``--smoke`` runs both parts on tiny shapes.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np
import torch
from common import emit, parse_args, table

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
HEAD = (49152, 576)
FORMATS = ("Q4_1", "Q5_0", "Q5_1", "Q8_0")
FORMAT_SHAPES = [(576, 1536), (2048, 8192)]
FORMAT_BYTES = 96e6  # each format's weights a shape (distinct copies of the shape)


def random_blocks(kind: str, shape: tuple[int, int], rng: np.random.Generator) -> Any:
    """A BlockWeight of random valid ``kind`` blocks (random quants, small scales)."""
    from runtime.model.blocks import _BLOCK_BYTES, BlockWeight

    out_f, in_f = shape
    nb = in_f // 32
    raw = rng.integers(0, 256, (out_f, nb, _BLOCK_BYTES[kind]), dtype=np.uint8)
    heads = 1 if kind in ("Q5_0", "Q8_0") else 2  # d, or d and m
    scales = (rng.standard_normal((out_f, nb, heads)) * 1e-3).astype(np.float16)
    raw[..., :2 * heads] = scales.view(np.uint8).reshape(out_f, nb, 2 * heads)
    return BlockWeight.from_gguf(raw.reshape(out_f, -1), kind, shape)


def time_formats(args: argparse.Namespace) -> dict[str, float]:
    """Each format on ``blocks`` and ``blocks_q8``, interleaved (see the module doc)."""
    from runtime.model.matmul import Projection

    rng = np.random.default_rng(0)
    shapes = [(64, 256)] if args.smoke else FORMAT_SHAPES
    result: dict[str, float] = {}
    rows_out = []
    for shape in shapes:
        projs: dict[tuple[str, str], list[Projection]] = {}
        for kind in FORMATS:
            first = random_blocks(kind, shape, rng)
            copies = 2 if args.smoke else max(2, round(FORMAT_BYTES / first.nbytes))
            weights = [first] + [random_blocks(kind, shape, rng) for _ in range(copies - 1)]
            for name in ("blocks", "blocks_q8"):
                projs[kind, name] = []
                for w in weights:
                    p = Projection(w)
                    p.use([name] * p.buckets)
                    projs[kind, name].append(p)
        for rows in (1, 8, 64):
            x = torch.randn(rows, shape[1])
            best = dict.fromkeys(projs, float("inf"))
            for rep in range(args.repeats + 1):  # the first pass warms up
                for key, ps in projs.items():
                    for p in ps:  # each call timed: its best is the least disturbed
                        t0 = time.perf_counter()
                        p(x)
                        if rep:
                            best[key] = min(best[key], time.perf_counter() - t0)
            for (kind, name), t in best.items():
                tag = f"{kind}_{name}_{rows}_{shape[0]}x{shape[1]}"
                result[f"ms_{tag}"] = t * 1e3
                result[f"gbs_{tag}"] = projs[kind, name][0].nbytes / t / 1e9
            rows_out.append((f"{shape[0]}x{shape[1]}, {rows} row{'s' if rows > 1 else ''}",
                             ", ".join(f"{k} {n} {t * 1e3:.3f} ms"
                                       for (k, n), t in best.items())))
    table(rows_out)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--formats", action="store_true",
                        help="time each block format (Q4_1, Q5_0, Q5_1, Q8_0) instead")
    args = parse_args(parser, layers=1, repeats=1)
    if args.formats:
        emit(time_formats(args))
        return

    from runtime.model.blocks import OUTLIERS, BlockWeight
    from runtime.model.gguf_weights import quantize_q8_0
    from runtime.model.matmul import Int8Weight, Projection

    torch.manual_seed(0)
    kernels = {"blocks": "blocks", "blocks_q8": "blocks_q8", "blocks_q8_split": "blocks_q8",
               "int8": "int_mm"}

    def projections(w: torch.Tensor, block: BlockWeight, buckets: int) -> dict[str, Projection]:
        out = {}
        outliers = torch.randperm(w.shape[1])[:OUTLIERS].sort().values
        for label, name in kernels.items():
            p = Projection(Int8Weight.quantize(w) if label == "int8" else block,
                           buckets=buckets,
                           outliers=outliers if label == "blocks_q8_split" else None)
            p.use([name] * buckets)
            out[label] = p
        return out

    layers = []
    for _ in range(args.layers):
        for shape in SHAPES:
            w = torch.randn(shape) * 0.05
            layers.append(projections(w, BlockWeight.quantize_q4_1(w), 3))
    head = torch.randn(HEAD if not args.smoke else (4096, HEAD[1])) * 0.05
    head_p = projections(head, quantize_q8_0(head), 2)

    result: dict[str, float] = {}
    rows_out = []
    for rows in (1, 8, 512):
        xs = {k: torch.randn(rows, k) for k in (576, 1536)}
        passes = layers + ([head_p] if rows <= 8 else [])
        best = dict.fromkeys(kernels, float("inf"))
        for rep in range(args.repeats + 1):  # the first pass warms up (layouts, caches)
            for label in kernels:
                t0 = time.perf_counter()
                for ps in passes:
                    p = ps[label]
                    p(xs[p.shape[1]])
                if rep:
                    best[label] = min(best[label], time.perf_counter() - t0)
        for label, t in best.items():
            result[f"ms_{label}_{rows}"] = t * 1e3
        rows_out.append((f"{rows} row{'s' if rows > 1 else ''}"
                         + (" (+ lm_head)" if rows <= 8 else ""),
                         ", ".join(f"{k} {t * 1e3:.1f} ms" for k, t in best.items())))
    table(rows_out)
    if args.smoke:  # both parts
        result |= time_formats(args)
    emit(result)


if __name__ == "__main__":
    main()
