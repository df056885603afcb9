"""Choosing an attention backend by timing it, as the projections' kernels are chosen.

Owner: ``select_backend`` (``runtime.model.attention``), when no backend is forced and
flash-attn is not at hand on CUDA, or with ``PIE_CTX_ATTENTION=measure``. Each candidate
attends one layer of two steps on a pool shaped like the model's (the model's heads, head
dim, dtype and page size, non-consecutive page tables as in a busy engine):

* a decode batch: 8 sequences of ~1,000 tokens, one new token each;
* a prefill chunk: 256 new tokens over 512 cached ones.

The score is the sum of the two steps' median times (``prepare`` included: it is paid once
per forward, the attention once per layer, so a step's cost is ``prepare + layers x
attend``; the score weighs the layers by ``LAYERS``). The first runs warm up (and compile,
for flex); the result is logged at INFO and kept per shape for the process.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable

import torch

from runtime.model.attention.base import AttentionBackend, AttentionMetadata

__all__ = ["measure_backends", "choose_fastest"]

log = logging.getLogger(__name__)
LAYERS = 16  # attends per prepare in the score (a small model's layer count)
_DECODES, _DECODE_LEN, _CHUNK, _CHUNK_CACHED = 8, 1000, 256, 512
_cache: dict[tuple, dict[str, float]] = {}


def _workloads(page_size: int, device: torch.device) -> tuple[int, list[AttentionMetadata]]:
    """The two steps' metadata and the pool pages they need."""
    s = page_size
    lens = [(_DECODE_LEN + 37 * i, 1) for i in range(_DECODES)]  # (cached, new)
    steps = [lens, [(_CHUNK_CACHED, _CHUNK)]]
    need = sum(-(-(c + n) // s) for step in steps for c, n in step)
    num_pages = need + 8
    order = list(range(num_pages))
    order = order[1::2] + order[::2]  # non-consecutive tables: no in-place shortcut
    metas, at = [], 0
    for step in steps:
        tables, wp, ws = [], [], []
        for c, n in step:
            k = -(-(c + n) // s)
            table = order[at:at + k]
            at += k
            tables.append(table)
            for j in range(c, c + n):
                wp.append(table[j // s])
                ws.append(j % s)
        metas.append(AttentionMetadata(
            s, [n for _, n in step], [c for c, _ in step], [c + n for c, n in step], tables,
            torch.zeros(len(wp), dtype=torch.int64, device=device),
            torch.tensor(wp, device=device), torch.tensor(ws, device=device),
            [None] * len(step)))
    return num_pages, metas


def measure_backends(candidates: dict[str, Callable[[], AttentionBackend]],
                     device: torch.device, dtype: torch.dtype, page_size: int,
                     num_heads: int, num_kv_heads: int, head_dim: int,
                     repeats: int = 5) -> dict[str, float]:
    """Milliseconds per step (see the module docstring) of each candidate backend.

    Args:
        candidates: name -> factory of a fresh backend.
        device, dtype, page_size, num_heads, num_kv_heads, head_dim: the model's.
        repeats: timed runs per step after two warm-up runs.

    Returns:
        ``{name: score_ms}``; a candidate that raises is left out (and logged).
    """
    key = (tuple(sorted(candidates)), str(device), dtype, page_size, num_heads, num_kv_heads,
           head_dim)
    if key in _cache:
        return _cache[key]
    num_pages, metas = _workloads(page_size, device)
    g = torch.Generator(device="cpu").manual_seed(0)
    pool = torch.randn(num_pages, page_size, 1, 2, num_kv_heads, head_dim, generator=g,
                       dtype=torch.float32).to(device=device, dtype=dtype)
    inputs = []
    for meta in metas:
        t = meta.num_tokens
        inputs.append((torch.randn(t, num_heads, head_dim, generator=g).to(device, dtype),
                       torch.randn(t, 2, num_kv_heads, head_dim, generator=g).to(device, dtype)))

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    scores: dict[str, float] = {}
    for name, make in candidates.items():
        try:
            backend = make()
            total = 0.0
            for meta, (q, kv) in zip(metas, inputs, strict=True):
                times = []
                for i in range(2 + repeats):
                    sync()
                    t0 = time.perf_counter()
                    backend.prepare(meta, pool)
                    t1 = time.perf_counter()
                    backend.forward(0, q, kv, pool, meta)
                    sync()
                    t2 = time.perf_counter()
                    if i >= 2:
                        times.append((t1 - t0) + LAYERS * (t2 - t1))
                total += statistics.median(times)
            scores[name] = total * 1e3
        except Exception as e:  # a backend that cannot run here is not a candidate
            log.warning("attention backend %s failed its measurement (%s: %s)", name,
                        type(e).__name__, e)
    _cache[key] = scores
    return scores


def choose_fastest(candidates: dict[str, Callable[[], AttentionBackend]],
                   device: torch.device, dtype: torch.dtype, page_size: int,
                   num_heads: int, num_kv_heads: int, head_dim: int) -> AttentionBackend:
    """A fresh backend of the candidate that measured fastest (the first if none ran)."""
    with torch.inference_mode():
        scores = measure_backends(candidates, device, dtype, page_size, num_heads,
                                  num_kv_heads, head_dim)
    name = min(scores, key=scores.__getitem__) if scores else next(iter(candidates))
    log.info("attention backend: %s by measurement (%s; ms per step of %d layers, %s, "
             "page size %d)", name, ", ".join(f"{k} {v:.2f}" for k, v in scores.items()),
             LAYERS, dtype, page_size)
    return candidates[name]()
