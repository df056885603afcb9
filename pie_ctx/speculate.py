"""Speculators: propose tokens for ``ctx.generate(..., speculator=...)`` to verify.

Each round, the generator asks the speculator for a draft, and the engine verifies the
whole draft in one pass (batched with everyone else's rows): each row is decoded as a plain
step decodes it (the sampler's draw: temperature, top-k, top-p, min-p, bias, allowed
tokens), and the draft is kept up to the first token that differs, which is replaced by
the row's own. A drafted token is so kept with probability ``p`` (the sampler's for it):
speculative rejection sampling for a drafter whose own probability is 1, so the output has
exactly the distribution of plain sampling, for every sampler; under greedy it is exactly
greedy decoding. Rejected tokens are dropped from the context's working pages without a
trace. (Engine-driven drafts, ``speculator="prompt_lookup"``, go further: one generator
for the whole generation, so a seeded one writes plain decoding's very tokens.)

Usage::

    await ctx.generate(Sampler.greedy(), speculator="prompt_lookup").text()
    await ctx.generate(Sampler.greedy(), speculator=MySpeculator()).text()
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

__all__ = ["Speculator", "PromptLookup"]


@runtime_checkable
class Speculator(Protocol):
    """Proposes tokens; told what the engine kept.

    Each round: ``draft()`` returns the proposed next tokens (any number, possibly none);
    the engine verifies them; then ``rollback(n)`` says how many of that draft's last
    tokens were rejected, and ``accept(tokens)`` gives every token that joined the sequence
    this round (the kept draft tokens, then the one the engine sampled after them).
    """

    def draft(self) -> Sequence[int]: ...

    def accept(self, tokens: Sequence[int]) -> None: ...

    def rollback(self, n: int) -> None: ...


class PromptLookup:
    """Drafts by prompt lookup (n-gram matching): find the latest earlier occurrence of
    the last ``ngram`` tokens in the sequence and propose what followed it.

    It pays off when the output copies its input (edits, quotes, code, extraction); when
    nothing matches it proposes nothing, and the round is a plain decode step.

    Args:
        history: the tokens so far (the context's, then the prompt).
        ngram: how many trailing tokens must match (shorter matches are tried next).
        max_draft: the most tokens proposed per round.
    """

    def __init__(self, history: Sequence[int], *, ngram: int = 3, max_draft: int = 8) -> None:
        self.history = list(history)
        self.ngram = ngram
        self.max_draft = max_draft

    def draft(self) -> list[int]:
        h = self.history
        for n in range(min(self.ngram, len(h) - 1), 0, -1):
            tail = h[-n:]
            for start in range(len(h) - n - 1, -1, -1):
                if h[start:start + n] == tail:
                    return h[start + n:start + n + self.max_draft]
        return []

    def accept(self, tokens: Sequence[int]) -> None:
        self.history.extend(tokens)

    def rollback(self, n: int) -> None:
        pass  # drafts never entered the history
