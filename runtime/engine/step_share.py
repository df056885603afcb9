"""Decodes' share of a step: how many prompt tokens may ride along with running decodes.

Owns: the engine's running estimate of what a step costs (seconds of a decode-only step,
seconds per prompt token on top of it), learnt from the steps it times, and the bound it
puts on a step's prompt tokens while generations decode. Plain arithmetic over floats: the
scheduler asks it, the engine feeds it (docs/scheduling.md, "Decodes' share").

The rule: with ``decode_share`` s, a step that decodes gives its prompt rows at most
``(1 - s) / s`` times the time of a decode-only step, so a running generation's time
between tokens stays near ``1 / s`` of what it is alone (0.5: 2x) however long a prompt
arrives beside it. The prompts are cut into smaller chunks instead, each riding on a step
the decodes run anyway: every prompt's first token comes later. Off by default (0): on a
busy server nearly every step decodes, and the bound then delays every prompt, not only
the long ones (docs/scheduling.md has the figures). Without decodes a step takes the whole
token budget.
"""

from __future__ import annotations

import math

from pie_ctx.proto import checks
from pie_ctx.proto.errors import InvalidArgument

DEFAULT_DECODE_SHARE = 0.0
"""No bound: prompt chunks fill the token budget (``serve --decode-share 0.5`` to keep half)."""

_SMOOTHING = 0.25  # weight of the newest observation in each running estimate
_PROBE_PAGES = 4  # a prompt chunk beside decodes before anything is measured


class StepShare:
    """Learns step costs and bounds the prompt tokens of a step that also decodes.

    Args:
        decode_share: the share of a decoding step's time kept for its decode rows, in
            [0, 1); 0 turns the bound off (prompt chunks fill the token budget).
        page_size: the engine's page size (the probe before anything is timed is four
            pages). A bound is never below one token, so a prompt always progresses.
    """

    def __init__(self, decode_share: float = DEFAULT_DECODE_SHARE, page_size: int = 16) -> None:
        self.decode_share = check_decode_share(decode_share)
        self.page_size = page_size
        self.decode_s: float | None = None  # a decode-only step, seconds
        self.prompt_token_s: float | None = None  # one more prompt token in a step, seconds
        self.num_bounded = 0  # steps whose prompt tokens the bound cut

    def observe(self, decode_tokens: int, prompt_tokens: int, seconds: float) -> None:
        """One timed step: how many decode and prompt tokens it ran, and its wall time."""
        if not math.isfinite(seconds) or seconds <= 0:
            return
        if decode_tokens and not prompt_tokens:
            self.decode_s = _smooth(self.decode_s, seconds)
        elif prompt_tokens:
            base = self.decode_s if decode_tokens and self.decode_s is not None else 0.0
            extra = max(seconds - base, seconds / 4) / prompt_tokens
            self.prompt_token_s = _smooth(self.prompt_token_s, extra)

    def prompt_bound(self, decoding: bool, budget: int) -> int:
        """The prompt tokens a step may take (``budget``: what the token budget leaves)."""
        if not decoding or self.decode_share == 0:
            return budget
        if self.decode_s is None or self.prompt_token_s is None:
            bound = _PROBE_PAGES * self.page_size
        else:
            ratio = (1 - self.decode_share) / self.decode_share
            bound = int(ratio * self.decode_s / self.prompt_token_s)
        bound = max(bound, 1)
        if bound < budget:
            self.num_bounded += 1
            return bound
        return budget


def check_decode_share(value: object) -> float:
    """``value`` as a decode share, or ``InvalidArgument`` saying what is allowed."""
    if not 0 <= checks.finite(value, "decode_share") < 1:
        raise InvalidArgument(f"decode_share must be in [0, 1) (0: no bound), got {value!r}")
    return float(value)  # type: ignore[arg-type]


def _smooth(old: float | None, new: float) -> float:
    return new if old is None else old + _SMOOTHING * (new - old)
