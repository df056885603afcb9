"""Samplers: how a token is picked from a row of logits.

Usage::

    Sampler.greedy()
    Sampler.top_p(0.7, 0.95, seed=1)   # temperature 0.7, nucleus 0.95, reproducible
"""

from __future__ import annotations

import math

from pie_ctx.errors import InvalidArgument
from pie_ctx.protocol import SamplerSpec

__all__ = ["Sampler", "SamplerSpec"]


def _temp(t: float) -> float:
    if not isinstance(t, int | float) or isinstance(t, bool) or not math.isfinite(t) or t < 0:
        raise InvalidArgument(f"temperature must be a finite number >= 0, got {t!r}")
    return float(t)


def _seed(seed: int | None) -> int | None:
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or seed < 0):
        raise InvalidArgument(f"seed must be a non-negative int or None, got {seed!r}")
    return seed


class Sampler:
    """Factory of :class:`SamplerSpec` values (plain data, safe to share and send)."""

    @staticmethod
    def greedy() -> SamplerSpec:
        """Always the most likely token."""
        return SamplerSpec()

    @staticmethod
    def temperature(t: float, *, seed: int | None = None) -> SamplerSpec:
        """Sample from softmax(logits / t); ``t == 0`` is greedy."""
        return SamplerSpec(temperature=_temp(t), seed=_seed(seed))

    @staticmethod
    def top_k(t: float, k: int, *, seed: int | None = None) -> SamplerSpec:
        """Sample among the ``k`` most likely tokens at temperature ``t``."""
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise InvalidArgument(f"top_k needs k >= 1, got {k!r}")
        return SamplerSpec(temperature=_temp(t), top_k=k, seed=_seed(seed))

    @staticmethod
    def top_p(t: float, p: float, *, seed: int | None = None) -> SamplerSpec:
        """Nucleus sampling: the smallest set of tokens whose probability reaches ``p``."""
        if not isinstance(p, int | float) or not 0 < p <= 1:
            raise InvalidArgument(f"top_p needs 0 < p <= 1, got {p!r}")
        return SamplerSpec(temperature=_temp(t), top_p=float(p), seed=_seed(seed))

    @staticmethod
    def min_p(t: float, p: float, *, seed: int | None = None) -> SamplerSpec:
        """Keep tokens whose probability is at least ``p`` times the most likely one's."""
        if not isinstance(p, int | float) or not 0 <= p < 1:
            raise InvalidArgument(f"min_p needs 0 <= p < 1, got {p!r}")
        return SamplerSpec(temperature=_temp(t), min_p=float(p), seed=_seed(seed))
