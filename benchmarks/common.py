"""Shared pieces of the engine benchmarks: the HF baseline on the same weights, prompts,
small statistics and the command line's ``--smoke``. Every benchmark prints a table and, as
its last line, one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

# The repository (for ``tests.sdk.harness``; pie_ctx and runtime are installed).
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

TEXT = ("Paged attention stores the key and value vectors of every token in fixed-size pages, "
        "so contexts that share a prefix can share the pages that hold it. ") * 400


def load_hf(folder: Path, device: Any = "cpu", dtype: torch.dtype = torch.float32) -> Any:
    """transformers' own model on the model's folder (a GGUF's dense cache entry: its
    weights dequantized, ``runtime.model.loader.dense_folder``): the same weights as ours."""
    from transformers import AutoModelForCausalLM

    from runtime.model.loader import dense_folder

    model = AutoModelForCausalLM.from_pretrained(str(dense_folder(folder)), dtype=dtype)
    model.to(device).eval()
    return model


class Ours:
    """Single-stream driver over our runner with a private pool: greedy generation, one-pass
    scoring, timing. ``weights``: "fp32" or "int8" (see docs/models.md); ``kv_dtype``: the
    pool's pages, "fp32" or "int8" (docs/forward.md); ``deterministic``: the runner's
    batch-invariant kernels (docs/performance.md), off by default here: the model
    benchmarks time the fastest kernels, and report the invariant ones' cost as ratios."""

    def __init__(self, loaded: Any, max_tokens: int, page_size: int = 16,
                 weights: str = "fp32", kv_dtype: str = "fp32",
                 deterministic: bool = False) -> None:
        from runtime.kv.pool import PagePool, PoolShape
        from runtime.model.layers import is_block_weight
        from runtime.model.loader import load_blocks
        from runtime.model.quant import calibration_tokens
        from runtime.model.runner import ModelRunner

        c = loaded.config
        num_pages = max_tokens // page_size + 2
        w = loaded  # (its dtype and device: those of the float weights)
        pool = PagePool(PoolShape(num_pages, page_size, c.num_layers, c.num_kv_heads, c.head_dim,
                        dtype=w.dtype, device=w.device, kv_dtype=kv_dtype))
        calibration = (calibration_tokens(loaded.tokenizer) if weights in ("int8", "gguf")
                       else None)
        in_place = any(is_block_weight(t) for t in loaded.weights.values())
        blocks = (({} if in_place else load_blocks(loaded.path)) if weights == "gguf"
                  else None)  # {}: loaded with blocks=True, the file's blocks in place
        self.runner = ModelRunner(c, loaded.weights, pool.kv, page_size, weight_format=weights,
                                  calibration=calibration, dtype=w.dtype, blocks=blocks,
                                  deterministic=deterministic)
        self.pages = list(range(num_pages))

    def forward(self, tokens: list[int], start: int, rows: list[int]) -> torch.Tensor:
        from runtime.model.runner import SeqInput

        n = len(tokens)
        return self.runner.forward([SeqInput(tokens, list(range(start, start + n)), self.pages,
                                             start, rows)])

    def prefill(self, tokens: list[int], all_logits: bool = False) -> torch.Tensor:
        rows = list(range(len(tokens))) if all_logits else [len(tokens) - 1]
        return self.forward(tokens, 0, rows)

    def logits(self, tokens: list[int], chunk: int = 512) -> torch.Tensor:
        """fp32 logits [len(tokens), V] of every position, in passes of ``chunk`` tokens."""
        out = [self.forward(tokens[a:a + chunk], a, list(range(len(tokens[a:a + chunk]))))
               for a in range(0, len(tokens), chunk)]
        return torch.cat(out).float()

    def generate(self, prompt: list[int], n: int) -> tuple[list[int], float, float]:
        """Greedy n tokens; returns (tokens, prefill seconds, decode seconds for n-1 steps)."""
        t0 = time.perf_counter()
        logits = self.prefill(prompt)
        out = [int(logits[0].argmax())]  # (a device sync)
        t1 = time.perf_counter()
        pos = len(prompt)
        for _ in range(n - 1):
            logits = self.forward([out[-1]], pos, [0])
            out.append(int(logits[0].argmax()))
            pos += 1
        return out, t1 - t0, time.perf_counter() - t1

    def decode_batch(self, prompts: list[list[int]], n: int) -> float:
        """Prefill each prompt on its share of the pool, then ``n`` greedy decode steps of
        all of them in one batch; returns the seconds of the decode steps."""
        from runtime.model.runner import SeqInput

        span = len(self.pages) // len(prompts)
        tables = [self.pages[i * span:(i + 1) * span] for i in range(len(prompts))]
        last = [int(self.runner.forward([SeqInput(p, list(range(len(p))), t, 0,
                                                  [len(p) - 1])])[0].argmax())
                for p, t in zip(prompts, tables, strict=True)]
        pos = [len(p) for p in prompts]
        t0 = time.perf_counter()
        for _ in range(n):
            logits = self.runner.forward([SeqInput([tok], [at], t, at, [0])
                                          for tok, at, t in zip(last, pos, tables, strict=True)])
            last = logits.argmax(dim=-1).tolist()
            pos = [at + 1 for at in pos]
        return time.perf_counter() - t0


def prompt_tokens(tokenizer: Any, n: int, salt: str = "") -> list[int]:
    ids = tokenizer.encode(salt + TEXT)
    if len(ids) < n:
        raise ValueError("TEXT is too short for this prompt length")
    return ids[:n]


def kv_bytes_per_token(config: Any, itemsize: int = 4) -> int:
    return config.num_layers * 2 * config.num_kv_heads * config.head_dim * itemsize


def parse_args(parser: argparse.ArgumentParser, **smoke: Any) -> argparse.Namespace:
    """Parse the command line, with ``--smoke`` added: the benchmark's real code path with
    the small settings in ``smoke`` (a few tokens, one repeat), so that it runs in seconds;
    its figures mean nothing. tests/benchmarks/test_smoke.py runs every benchmark so."""
    parser.add_argument("--smoke", action="store_true",
                        help="run the real code path on a few tokens, in seconds (a test "
                             "that the script works; its figures mean nothing)")
    args = parser.parse_args()
    if args.smoke:
        for name, value in smoke.items():
            if not hasattr(args, name):
                raise RuntimeError(f"--smoke sets {name!r}, which is not an option")
            setattr(args, name, value)
    return args


def summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def table(rows: list[tuple[str, str]]) -> None:
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k.ljust(width)}  {v}")


def _rounded(v: Any) -> Any:
    """Floats to 4 decimals, small ones (logit differences) to 4 significant digits."""
    if not isinstance(v, float):
        return v
    return round(v, 4) if abs(v) >= 1e-2 or v == 0 else float(f"{v:.4g}")


def emit(result: dict[str, Any]) -> None:
    print(json.dumps({k: _rounded(v) for k, v in result.items()}))
