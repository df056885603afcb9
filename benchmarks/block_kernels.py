"""The projections of one step of SmolLM2 on each block kernel, interleaved in one process.

    python benchmarks/block_kernels.py [--layers 30] [--repeats 5] [--smoke]

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
"""

from __future__ import annotations

import argparse
import time

import torch
from common import emit, parse_args, table

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
HEAD = (49152, 576)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=5)
    args = parse_args(parser, layers=1, repeats=1)

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
    emit(result)


if __name__ == "__main__":
    main()
