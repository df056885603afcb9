"""The projections of Llama-3.2-1B's layers on the K-quant kernels, against a memory read.

    python benchmarks/kquant_kernels.py [--layers 4] [--repeats 5] [--threads 2] [--smoke]

Random super-blocks in the Q4_K_M mix at Llama-3.2-1B's shapes (per layer: qkv 3072x2048 as
Q4_K q, k and a Q6_K v; o 2048x2048 Q4_K; gate_up 16384x2048 Q4_K; down 2048x8192 Q6_K:
~38.8 MB a layer, read in place), every layer its own bytes (so a pass reads them from
memory, not a cache). For 1 row (a decode), 8, 64 and 256 rows (a prefill chunk) it times
one pass over every projection on:

* ``kquant_q8``: the activations rounded to q8_K, integer dots (the best code path here);
* ``kquant``: the exact weights times fp32 activations (1 row only).

and, as the roofline, a read of as many bytes (``torch.sum`` of a float32 buffer of the
same size: what the issue's bandwidth figures use). A decode's bandwidth share is
``bytes / time / read bandwidth``. The kernels and the read take turns within each repeat,
so a busy machine slows them alike; the best repeat counts. The last line is one JSON
object.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from common import emit, parse_args, table

HIDDEN, FFN, Q, KV = 2048, 8192, 2048, 512
# (parts of one projection: (format, rows)), input width
SHAPES = [((("Q4_K", Q), ("Q4_K", KV), ("Q6_K", KV)), HIDDEN), ((("Q4_K", HIDDEN),), HIDDEN),
          ((("Q4_K", 2 * FFN),), HIDDEN), ((("Q6_K", HIDDEN),), FFN)]


def super_blocks(kind: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random valid super-blocks: random bytes with small finite float16 scales."""
    from runtime.model.kquants import KQUANT_FORMATS

    size = KQUANT_FORMATS[kind][1]
    raw = rng.integers(0, 256, size=(rows, cols // 256, size), dtype=np.uint8)
    scales = rng.uniform(1e-4, 2e-3, (rows, cols // 256, 2)).astype(np.float16).view(np.uint8)
    if kind == "Q6_K":
        raw[:, :, 208:210] = scales[:, :, :2]
    else:
        raw[:, :, 0:4] = scales
    return raw.reshape(rows, -1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parse_args(parser, layers=1, repeats=1)
    torch.set_num_threads(args.threads)

    from runtime.model.kquants import KQuantWeight, built_isas

    rng = np.random.default_rng(0)
    scale = 8 if args.smoke else 1  # smoke: an eighth of every output dimension
    weights = []
    for _ in range(args.layers):
        for parts, cols in SHAPES:
            ws = [KQuantWeight.from_gguf(super_blocks(k, r // scale, cols, rng), k,
                                         (r // scale, cols)) for k, r in parts]
            weights.append(KQuantWeight.cat(ws))
    total = sum(w.nbytes for w in weights)  # type: ignore[union-attr]
    buffer = torch.ones(total // 4)
    isa = built_isas()[-1]

    result: dict[str, float] = {"weight_mb": total / 1e6}
    rows_out = []
    for rows in (1, 8, 64, 256):
        xs = {k: torch.randn(rows, k) for k in (HIDDEN, FFN)}
        kernels = {"kquant_q8": lambda w, x: w.matmul_q8(x)}
        if rows == 1:
            kernels["kquant"] = lambda w, x: w.matmul(x)
        best = dict.fromkeys([*kernels, "read"], float("inf"))
        for rep in range(args.repeats + 1):  # the first pass warms up
            for label, run in kernels.items():
                t0 = time.perf_counter()
                for w in weights:
                    run(w, xs[w.in_features])
                if rep:
                    best[label] = min(best[label], time.perf_counter() - t0)
            t0 = time.perf_counter()
            float(buffer.sum())
            if rep:
                best["read"] = min(best["read"], time.perf_counter() - t0)
        read_gbs = total / best["read"] / 1e9
        for label in kernels:
            gbs = total / best[label] / 1e9
            result[f"ms_{label}_{rows}"] = best[label] * 1e3
            result[f"gbs_{label}_{rows}"] = gbs
            result[f"roofline_{label}_{rows}"] = gbs / read_gbs
        result[f"gbs_read_{rows}"] = read_gbs
        rows_out.append((f"{rows} row{'s' if rows > 1 else ''}", ", ".join(
            f"{k} {t * 1e3:.1f} ms ({total / t / 1e9:.1f} GB/s)" for k, t in best.items())))
    result["isa"] = isa  # type: ignore[assignment]
    table(rows_out)
    emit(result)


if __name__ == "__main__":
    main()
