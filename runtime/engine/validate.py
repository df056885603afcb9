"""Request validation shared by the engine's handlers.

Owns nothing. Every function raises ``InvalidArgument`` with a message that says what to
do, before any state is touched.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import xxhash

from pie_ctx import protocol as P
from pie_ctx.errors import InvalidArgument
from runtime.sampling import SamplerParams

__all__ = ["check_count", "check_sampler", "mask_and_extras", "seeded"]


def mask_and_extras(rows: list[list[bool]], seq_len: int, n: int) -> tuple[np.ndarray, list[int]]:
    """Check a custom mask's shape; return it as an array and each token's page-hash extra.

    Pages written under a custom mask must never be shared with causal ones: each token's
    mask row folds into its page hash's ``extra`` (0 is reserved for causal).
    """
    width = seq_len + n
    if len(rows) != n or any(len(r) != width for r in rows):
        raise InvalidArgument(
            f"attention_mask needs {n} rows (one per new token) of {width} booleans "
            f"(every KV entry: the context's {seq_len} plus the {n} new ones)"
        )
    mask = np.asarray(rows, dtype=bool)
    extras = [xxhash.xxh3_64_intdigest(np.packbits(r).tobytes()) | 1 for r in mask]
    return mask, extras


def check_count(name: str, n: Any) -> None:
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise InvalidArgument(f"{name} must be a non-negative int, got {n!r}")


def check_sampler(s: P.SamplerSpec) -> None:
    """The sampling module's own checks (``SamplerParams``), before the request is queued:
    a bad value must fail this request, not the model step it would share with others."""
    SamplerParams(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, min_p=s.min_p,
                  seed=s.seed)
    if s.min_p >= 1:  # requests keep a stricter bound than the sampler itself
        raise InvalidArgument(f"min_p must be in [0, 1), got {s.min_p}")


def seeded(s: P.SamplerSpec) -> P.SamplerSpec:
    """Give an unseeded sampler a seed now, so a preempted job replays the same tokens."""
    if s.seed is not None or s.temperature == 0:
        return s
    seed = int.from_bytes(np.random.bytes(8), "little") >> 1
    return P.SamplerSpec(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
                         min_p=s.min_p, seed=seed)
