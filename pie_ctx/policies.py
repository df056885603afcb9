"""Memory policies' arithmetic: which token indices to keep under a budget.

Owns nothing but small, pure functions over lengths and score arrays (numpy), used by the
StreamingLLM, H2O and SnapKV inferlets (examples/) and benchmarks/compaction.py; each
returns sorted indices for ``Context.compact``. How the policies use them:
docs/compaction.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pie_ctx.proto.errors import InvalidArgument

__all__ = ["streaming_keep", "heavy_hitters_keep", "pooled"]


def _budget(seq_len: int, budget: int, reserved: int) -> None:
    if budget <= reserved:
        raise InvalidArgument(f"a budget of {budget} tokens leaves no room beside the "
                              f"{reserved} always kept; raise the budget")
    if seq_len < 0:
        raise InvalidArgument(f"seq_len must be >= 0, got {seq_len}")


def streaming_keep(seq_len: int, budget: int, sinks: int = 4) -> list[int]:
    """StreamingLLM: the first ``sinks`` tokens and the most recent ones, ``budget`` in all
    (every index when the context fits)."""
    _budget(seq_len, budget, sinks)
    if seq_len <= budget:
        return list(range(seq_len))
    return list(range(sinks)) + list(range(seq_len - (budget - sinks), seq_len))


def heavy_hitters_keep(scores: Sequence[float] | Any, budget: int, window: int,
                       sinks: int = 0) -> list[int]:
    """H2O / SnapKV: the last ``window`` tokens, the first ``sinks``, and the highest
    scoring of the rest, ``budget`` in all. ``scores`` has one value per token (ties go
    to the earlier token)."""
    import numpy as np

    s = np.asarray(scores, dtype=np.float64).reshape(-1)
    n = s.shape[0]
    _budget(n, budget, window + sinks)
    if n <= budget:
        return list(range(n))
    middle = np.arange(sinks, n - window)
    order = np.argsort(-s[middle], kind="stable")[: budget - window - sinks]
    chosen = set(range(sinks)) | set(middle[order].tolist()) | set(range(n - window, n))
    return sorted(chosen)


def pooled(scores: Sequence[float] | Any, kernel: int = 7) -> Any:
    """SnapKV's smoothing: a max over each token's ``kernel`` neighbours, so the tokens
    around a heavy hitter are kept with it (a clause, not a lone word)."""
    import numpy as np

    s = np.asarray(scores, dtype=np.float64).reshape(-1)
    half = kernel // 2
    padded = np.pad(s, half, mode="edge")
    windows = np.lib.stride_tricks.sliding_window_view(padded, kernel)
    return windows.max(axis=1)[: s.shape[0]]
