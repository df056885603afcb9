"""int8 KV pages against fp32 ones on the default model: decode speed at a long context, and
how many pages fit in the same memory.

    .venv/bin/python benchmarks/kv_pages.py [--context 4096] [--new-tokens 64] [--repeats 2] [--smoke]

For each of fp32 and int8 weights, a private pool of fp32 pages and one of int8 pages: the
same --context-token prompt is prefilled (in 1,024-token chunks), then --new-tokens greedy
decode steps are timed, batch 1, repeats interleaved. The pages are consecutive ids (what a
fresh prompt gets from the engine's free list), so fp32 attention reads them in place while
int8 dequantizes one layer's context per step: the honest worst case for int8 speed.
Also prints the pages of each format in 1 GiB, and how many greedy tokens int8 pages keep
identical to fp32 pages. The last line is one JSON object (kv_int8_decode_tok_s,
kv_fp32_decode_tok_s, kv_int8_decode_ratio, pages_per_gib_fp32, pages_per_gib_int8,
kv_pages_ratio, and the same decode keys with int8 weights: w8_...).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from common import Ours, emit, parse_args, prompt_tokens, table

from runtime.boot import pool_pages_for
from runtime.model.loader import load_model

CHUNK = 1024


def decode_run(ours: Ours, prompt: list[int], n: int) -> tuple[list[int], float]:
    """Prefill ``prompt`` in chunks, then ``n`` greedy steps; (tokens, decode tok/s)."""
    for a in range(0, len(prompt), CHUNK):
        part = prompt[a:a + CHUNK]
        logits = ours.forward(part, a, [len(part) - 1])
    out = [int(logits[0].argmax())]
    pos = len(prompt)
    t0 = time.perf_counter()
    for _ in range(n - 1):
        logits = ours.forward([out[-1]], pos, [0])
        out.append(int(logits[0].argmax()))
        pos += 1
    return out, (n - 1) / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--no-int8-weights", action="store_true")
    args = parse_args(ap, context=64, new_tokens=4, repeats=1)

    loaded = load_model(None, progress=False)
    cfg = loaded.config
    prompt = prompt_tokens(loaded.tokenizer, args.context)
    max_tokens = args.context + args.new_tokens + 16
    weight_formats = ["fp32"] + ([] if args.no_int8_weights else ["int8"])
    runs = {(w, kv): Ours(loaded, max_tokens, weights=w, kv_dtype=kv)
            for w in weight_formats for kv in ("fp32", "int8")}
    speeds: dict[tuple[str, str], list[float]] = {k: [] for k in runs}
    tokens: dict[tuple[str, str], list[int]] = {}
    for _ in range(args.repeats):
        for key, ours in runs.items():
            tokens[key], tok_s = decode_run(ours, prompt, args.new_tokens)
            speeds[key].append(tok_s)

    def same_run(a: list[int], b: list[int]) -> int:
        return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))

    pages = {kv: pool_pages_for(cfg, 16, torch.float32, 1.0, kv) for kv in ("fp32", "int8")}
    rows = [("model, threads", f"{loaded.name}, {torch.get_num_threads()}"),
            ("context, new tokens", f"{args.context}, {args.new_tokens}")]
    result: dict[str, object] = {}
    for w in weight_formats:
        prefix = "" if w == "fp32" else "w8_"
        best = {kv: max(speeds[(w, kv)]) for kv in ("fp32", "int8")}
        med = {kv: statistics.median(speeds[(w, kv)]) for kv in ("fp32", "int8")}
        same = same_run(tokens[(w, "fp32")], tokens[(w, "int8")])
        rows.append((f"{w} weights: decode tok/s fp32 pages",
                     f"{best['fp32']:.1f} (median {med['fp32']:.1f})"))
        rows.append((f"{w} weights: decode tok/s int8 pages",
                     f"{best['int8']:.1f} (median {med['int8']:.1f}), "
                     f"{best['int8'] / best['fp32']:.2f}x; greedy identical "
                     f"{same}/{args.new_tokens}"))
        result |= {f"{prefix}kv_fp32_decode_tok_s": best["fp32"],
                   f"{prefix}kv_int8_decode_tok_s": best["int8"],
                   f"{prefix}kv_int8_decode_ratio": best["int8"] / best["fp32"],
                   f"{prefix}kv_int8_greedy_identical": same}
    rows.append(("pages of 16 tokens per GiB", f"fp32 {pages['fp32']}, int8 {pages['int8']} "
                                                f"({pages['int8'] / pages['fp32']:.2f}x)"))
    table(rows)
    emit({**result, "pages_per_gib_fp32": pages["fp32"], "pages_per_gib_int8": pages["int8"],
          "kv_pages_ratio": pages["int8"] / pages["fp32"], "context": args.context,
          "new_tokens": args.new_tokens, "repeats": args.repeats,
          "threads": torch.get_num_threads()})


if __name__ == "__main__":
    main()
