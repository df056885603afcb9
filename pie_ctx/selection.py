"""How ``Context.select`` turns per-token log-probabilities into one score per option.

The three methods are the ones SGLang offers for its ``choices`` (described in our own words
in docs/decoding.md):

* ``token_length_normalized``: the mean log-probability of the option's tokens. Fair
  between options of different lengths, but a long option whose later tokens follow
  almost surely from its first ones gets a flattering mean.
* ``greedy_token``: the log-probability of the option's first token decides; options
  tied there are compared on their second token, and so on. A shorter option is
  compared, past its end, with its own mean log-probability.
* ``unconditional_likelihood_normalized``: the mean, over the option's tokens, of how much
  more likely the context makes each token than it is without the context (the first
  token's context-free log-probability counts as 0). It discounts options that are
  likely whatever was asked.
"""

from __future__ import annotations

__all__ = ["SELECT_METHODS", "select_scores"]

SELECT_METHODS = ("token_length_normalized", "greedy_token",
                  "unconditional_likelihood_normalized")


def select_scores(method: str, logprobs: list[list[float]],
                  unconditional: list[list[float]]) -> tuple[int, list[float]]:
    """``(best index, per-option scores)`` for one method (see the module docstring)."""
    if method == "token_length_normalized":
        scores = [sum(lp) / len(lp) for lp in logprobs]
        return _argmax(scores), scores
    if method == "greedy_token":
        return _greedy(logprobs), [lp[0] for lp in logprobs]
    scores = [sum(c - u for c, u in zip(lp, un, strict=True)) / len(lp)
              for lp, un in zip(logprobs, unconditional, strict=True)]
    return _argmax(scores), scores


def _argmax(values: list[float]) -> int:
    return max(range(len(values)), key=values.__getitem__)  # first of equals


def _greedy(logprobs: list[list[float]]) -> int:
    width = max(len(lp) for lp in logprobs)
    rows = [lp + [sum(lp) / len(lp)] * (width - len(lp)) for lp in logprobs]
    left = list(range(len(rows)))
    for j in range(width):
        top = max(rows[i][j] for i in left)
        left = [i for i in left if rows[i][j] == top]
        if len(left) == 1:
            break
    return left[0]
