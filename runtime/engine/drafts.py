"""Drafts for engine-driven generations: forced tokens (jump-forward) and prompt lookup.

Owns: one generation's draft source, ``Drafter``. Before each decode step the scheduler
asks it for tokens to append after the pending token; the step writes them in the same
pass and verifies them like any speculative draft (``decoding.verify``: each row decoded
as a plain step decodes it, so a seeded generation writes plain decoding's very tokens,
greedy or sampled), with the constraint's mask applied to every row. So a draft costs
rows in the batch, never a token of the output.

Two sources, in order:

1. **Forced tokens** (jump-forward): under a constraint, the tokens the grammar allows
   and nothing else could replace, as llguidance computes them (``compute_ff_tokens``):
   JSON keys, a tool's name, punctuation. Where the model would write the same bytes with
   other tokens, verification keeps the model's choice, so the output is exactly that of
   plain constrained decoding.
2. **Prompt lookup** (n-gram matching, asked for with ``prompt_lookup=k``): the tokens
   that followed the latest earlier occurrence of the last three tokens, in the context
   and what was generated so far, trimmed to what the constraint (if any) accepts. Lookups
   are O(1): an index from each n-gram to where it last ended is kept as tokens arrive.
   Shorter matches are not tried by default (``min_ngram``): in the agents benchmark at 8
   agents (sampled at a temperature) drafts after a 3-token match kept 84-91% of their
   tokens, after a 2-token match 5-40% and after a 1-token match 16-23%, and every
   rejected token is a row of a compute-bound step (plus the backoff it triggers).

Every drafted token is a row of the step, verified or not: on a CPU an 8-row step with
8-token drafts costs about twice the plain one, and sampling at a temperature often keeps
only a token or two of text copied from earlier. So lookups adapt, as the draft length of
adaptive speculative decoding does:

* **Length**: a lookup proposes at most ``length`` tokens, which starts at
  ``prompt_lookup``, doubles (up to it) after a draft kept whole, and drops to one more
  than the tokens kept after a draft kept in part.
* **Backoff**: after a draft of which no token was kept, the next 1, 2, 4, ... up to
  ``MAX_BACKOFF`` decode steps propose no lookup (doubling with each rejected draft in a
  row), and the length drops to 1; one kept token resets the backoff.

The policy reads only the generation's own past (a preemption's ``reset`` starts it over
too), so its steps' rows do not depend on what shares them. The tokens would not depend on
the policy anyway: verification writes plain decoding's tokens whatever the draft.
Forced tokens never back off and are never shortened.

Runs on the event loop, in ``Scheduler.plan``, between two steps (never beside the model
thread's use of the same matcher).
"""

from __future__ import annotations

from typing import Any

__all__ = ["MAX_BACKOFF", "Drafter"]

MAX_BACKOFF = 16  # the most decode steps a rejected prompt-lookup draft pauses lookups


class Drafter:
    """The draft source of one generation.

    Args:
        history: the tokens before the generation (the context's, then the prompt); only
            read when ``prompt_lookup`` is on.
        prompt_lookup: the most tokens a prompt-lookup draft proposes (0: off).
        jump_forward: propose the tokens a constraint forces.
        ngram: the longest trailing n-gram matched (shorter ones are tried next).
        min_ngram: the shortest one tried (module docstring).
    """

    def __init__(self, history: list[int], *, prompt_lookup: int = 0,
                 jump_forward: bool = True, ngram: int = 3, min_ngram: int = 3) -> None:
        self.prompt_lookup = prompt_lookup
        self.jump_forward = jump_forward
        self.ngram = ngram
        self.min_ngram = min(min_ngram, ngram)
        self._base = list(history) if prompt_lookup else []
        self.num_forced = 0  # tokens proposed as forced (for reports and benchmarks)
        self.num_looked_up = 0
        self.reset()

    def reset(self) -> None:
        """Forget every generated token (the generation starts again after a preemption)."""
        self._history: list[int] = []
        self._misses = 0  # prompt-lookup drafts in a row of which no token was kept
        self._pause = 0  # decode steps left that propose no lookup
        self._looked_up = 0  # tokens of the last proposal if it was a lookup, else 0
        self._length = self.prompt_lookup  # the most tokens the next lookup proposes
        # _ends[n - 1][ngram] = the index just after that n-gram's latest occurrence that
        # ends before the last token
        self._ends: list[dict[tuple[int, ...], int]] = [{} for _ in range(self.ngram)]
        for token in self._base:
            self.accept(token)

    def accept(self, token: int) -> None:
        """A token joined the sequence (generated, or drafted and kept)."""
        if not self.prompt_lookup:
            return
        h = self._history
        h.append(token)
        last = len(h) - 1  # index the n-grams that end just before the new token
        for n in range(1, self.ngram + 1):
            if last - n >= 0:
                self._ends[n - 1][tuple(h[last - n:last])] = last

    def propose(self, matcher: Any, limit: int) -> list[int]:
        """Tokens to append after the pending one (the matcher has consumed it), at most
        ``limit``; empty when there is nothing worth verifying."""
        self._looked_up = 0
        if limit <= 0:
            return []
        if matcher is not None and self.jump_forward:
            forced = list(matcher.compute_ff_tokens())[:limit]
            if forced:
                self.num_forced += len(forced)
                return forced
        if not self.prompt_lookup:
            return []
        if self._pause > 0:
            self._pause -= 1
            return []
        draft = self._lookup(min(limit, self._length))
        if draft and matcher is not None:
            draft = draft[: matcher.validate_tokens(draft)]
        self.num_looked_up += len(draft)
        self._looked_up = len(draft)
        return draft

    def judged(self, num_kept: int) -> None:
        """The step verified the last proposal: ``num_kept`` of its tokens were kept (the
        scheduler calls this for every verified draft; only lookups count)."""
        proposed, self._looked_up = self._looked_up, 0
        if not proposed:
            return
        if num_kept >= proposed:
            self._misses = 0
            self._length = min(self.prompt_lookup, 2 * self._length)
            return
        self._length = num_kept + 1
        if num_kept > 0:
            self._misses = 0
            return
        self._misses += 1
        self._pause = min(2 ** (self._misses - 1), MAX_BACKOFF)

    def _lookup(self, k: int) -> list[int]:
        h = self._history
        for n in range(min(self.ngram, len(h) - 1), self.min_ngram - 1, -1):
            end = self._ends[n - 1].get(tuple(h[-n:]))
            if end is not None:
                return h[end: end + k]
        return []
