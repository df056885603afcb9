"""Decodes' share of a step: how many prompt tokens may ride along with running decodes.

Owns: the engine's running estimate of what a step costs (seconds of a decode-only step,
and a model of what a prompt chunk adds to a step), learnt from the steps it times, and
the bound it puts on a step's prompt tokens while generations decode. Plain arithmetic
over floats: the scheduler asks it, the engine feeds it (docs/scheduling.md, "Decodes'
share").

The rule: with ``decode_share`` s, a step that decodes gives its prompt chunks at most
``(1 - s) / s`` times the time of a decode-only step, so a running generation's time
between tokens stays near ``1 / s`` of what it is alone (0.5: 2x) however long a prompt
arrives beside it. The prompts are cut into smaller chunks instead, each riding on a step
the decodes run anyway: every prompt's first token comes later. Off by default (0): on a
busy server nearly every step decodes, and the bound then delays every prompt, not only
the long ones (docs/scheduling.md has the figures). Without decodes a step takes the whole
token budget.

What a chunk of ``n`` tokens after ``c`` cached ones adds to a step is modelled as
``a * n + b * keys + m * (c + n)``: ``a`` per token (its projections), ``b`` per key a
token attends (``keys = n * c + n * (n + 1) / 2``: attention's arithmetic) and ``m`` per
key of the context read once for the chunk (attention's memory traffic, shared by the
chunk's rows). A token's cost grows with its depth, and one row deep in a long context
costs about a whole read of that context, so a per-token average (what a step measured a
moment ago, at a shallower depth) would let too many deep tokens in. The three are fitted
to the timed steps by least squares with non-negative coefficients, recent steps weighing
most.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import numpy as np

from pie_ctx.proto import checks
from pie_ctx.proto.errors import InvalidArgument

DEFAULT_DECODE_SHARE = 0.0
"""No bound: prompt chunks fill the token budget (``serve --decode-share 0.5`` to keep half)."""

_SMOOTHING = 0.25  # weight of the newest decode-only step in its running estimate
_DECAY = 0.9  # weight kept by the older steps of the prompt-cost fit at each new one
_PROBE_PAGES = 4  # a prompt chunk beside decodes before anything is measured
# the fit's unknowns' subsets, largest first (ties: the earlier)
_SUBSETS = [s for k in (3, 2, 1) for s in itertools.combinations(range(3), k)]


def chunk_features(tokens: int, depth: int) -> tuple[float, float, float]:
    """The prompt-cost model's features of one chunk: its tokens, the keys its rows attend,
    the context it reads (``depth``: the tokens cached before it)."""
    return (float(tokens), tokens * depth + tokens * (tokens + 1) / 2, float(depth + tokens))


class StepShare:
    """Learns step costs and bounds the prompt tokens of a step that also decodes.

    Args:
        decode_share: the share of a decoding step's time kept for its decode rows, in
            [0, 1); 0 turns the bound off (prompt chunks fill the token budget).
        page_size: the engine's page size (the probe before anything is timed is four
            pages). The scheduler never gives a step's first prompt chunk less than one
            token, so a prompt always progresses.
    """

    def __init__(self, decode_share: float = DEFAULT_DECODE_SHARE, page_size: int = 16) -> None:
        self.decode_share = check_decode_share(decode_share)
        self.page_size = page_size
        self.decode_s: float | None = None  # a decode-only step, seconds
        self.num_bounded = 0  # steps whose prompt tokens the bound cut
        self._xx = np.zeros((3, 3))  # decayed sums of the features' products
        self._xt = np.zeros(3)  # ... of features times the seconds they added
        self._tt = 0.0
        self.coef: tuple[float, float, float] | None = None  # (a, b, m) once fitted

    def observe(self, decode_tokens: int, chunks: Sequence[tuple[int, int]],
                seconds: float) -> None:
        """One timed step: its decode tokens, its prompt chunks as ``(tokens, depth)``,
        and its wall time."""
        if not math.isfinite(seconds) or seconds <= 0:
            return
        if decode_tokens and not chunks:
            self.decode_s = _smooth(self.decode_s, seconds)
            return
        if not chunks:
            return
        base = self.decode_s if decode_tokens and self.decode_s is not None else 0.0
        added = max(seconds - base, seconds / 4)
        x = np.sum([chunk_features(n, c) for n, c in chunks], axis=0)
        self._xx = _DECAY * self._xx + np.outer(x, x)
        self._xt = _DECAY * self._xt + x * added
        self._tt = _DECAY * self._tt + added * added
        self.coef = self._fit()

    def _fit(self) -> tuple[float, float, float]:
        """Non-negative least squares over three unknowns: the best fit among the subsets
        whose unconstrained solution is non-negative."""
        best, best_r = (0.0, 0.0, 0.0), math.inf
        for subset in _SUBSETS:
            idx = list(subset)
            sol = np.linalg.lstsq(self._xx[np.ix_(idx, idx)], self._xt[idx], rcond=None)[0]
            if (sol < 0).any():
                continue
            r = self._tt - 2 * sol @ self._xt[idx] + sol @ self._xx[np.ix_(idx, idx)] @ sol
            if best_r == math.inf or r < best_r - 1e-12 * max(1.0, abs(best_r)):
                coef = [0.0, 0.0, 0.0]
                for i, v in zip(idx, sol, strict=True):
                    coef[i] = float(v)
                best, best_r = (coef[0], coef[1], coef[2]), r
        return best

    def allowance(self, decoding: bool) -> float | None:
        """Seconds a step's prompt chunks may add (None: no bound, the budget decides)."""
        if not decoding or self.decode_share == 0:
            return None
        if self.decode_s is None or self.coef is None:
            return math.inf  # nothing timed: tokens_within gives a probe
        return (1 - self.decode_share) / self.decode_share * self.decode_s

    def cost(self, tokens: int, depth: int) -> float:
        """Seconds a chunk of ``tokens`` after ``depth`` cached ones adds to a step, as
        fitted (infinite before anything is timed: one probe a step)."""
        if self.coef is None or self.decode_s is None:
            return math.inf
        return float(np.dot(self.coef, chunk_features(tokens, depth)))

    def tokens_within(self, seconds: float, depth: int) -> int:
        """The most tokens of a chunk after ``depth`` cached ones that add at most
        ``seconds`` (before anything is timed: the four-page probe)."""
        if self.coef is None or self.decode_s is None:
            return _PROBE_PAGES * self.page_size if seconds > 0 else 0
        a, b, m = self.coef
        room = seconds - m * depth  # what the chunk's rows may cost beyond its read
        if room <= 0:
            return 0
        lin = a + b * (depth + 0.5) + m  # cost = b/2 n^2 + lin n + m depth
        if b > 0:
            n = (-lin + math.sqrt(lin * lin + 2 * b * room)) / b
        elif lin > 0:
            n = room / lin
        else:
            return 1 << 30
        return int(min(n * (1 + 1e-12), 1 << 30))


def check_decode_share(value: object) -> float:
    """``value`` as a decode share, or ``InvalidArgument`` saying what is allowed."""
    if not 0 <= checks.finite(value, "decode_share") < 1:
        raise InvalidArgument(f"decode_share must be in [0, 1) (0: no bound), got {value!r}")
    return float(value)  # type: ignore[arg-type]


def _smooth(old: float | None, new: float) -> float:
    return new if old is None else old + _SMOOTHING * (new - old)
