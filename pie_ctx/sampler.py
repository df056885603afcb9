"""Samplers: how a token is picked from a row of logits.

Each factory returns a ``SamplerSpec`` (plain data, safe to share and send), which checks
its own fields when it is built: a bad value raises ``InvalidArgument`` here, before any
request exists.

Usage::

    Sampler.greedy()
    Sampler.top_p(0.7, 0.95, seed=1)   # temperature 0.7, nucleus 0.95, reproducible
"""

from __future__ import annotations

from pie_ctx.proto.checks import positive
from pie_ctx.proto.messages import SamplerSpec

__all__ = ["Sampler", "SamplerSpec"]


class Sampler:
    """Factory of :class:`SamplerSpec` values."""

    @staticmethod
    def greedy() -> SamplerSpec:
        """Always the most likely token."""
        return SamplerSpec()

    @staticmethod
    def temperature(t: float, *, seed: int | None = None) -> SamplerSpec:
        """Sample from softmax(logits / t); ``t == 0`` is greedy."""
        return SamplerSpec(temperature=t, seed=seed)

    @staticmethod
    def top_k(t: float, k: int, *, seed: int | None = None) -> SamplerSpec:
        """Sample among the ``k`` most likely tokens at temperature ``t`` (``k >= 1``)."""
        return SamplerSpec(temperature=t, top_k=positive(k, "top_k k"), seed=seed)

    @staticmethod
    def top_p(t: float, p: float, *, seed: int | None = None) -> SamplerSpec:
        """Nucleus sampling: the smallest set of tokens whose probability reaches ``p``."""
        return SamplerSpec(temperature=t, top_p=p, seed=seed)

    @staticmethod
    def min_p(t: float, p: float, *, seed: int | None = None) -> SamplerSpec:
        """Keep tokens whose probability is at least ``p`` times the most likely one's."""
        return SamplerSpec(temperature=t, min_p=p, seed=seed)
