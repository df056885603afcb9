"""The output limit of a request that sets none: one default for every API.

Owner: :data:`DEFAULT_MAX_OUTPUT_TOKENS` and :func:`output_limit`, used by chat and text
completions (``max_tokens`` / ``max_completion_tokens``) and by Responses
(``max_output_tokens``). Anthropic's Messages API requires ``max_tokens``, so it never
needs one. The default is capped by the room the prompt leaves in the model's context, so a
long prompt without a limit is answered (until the context is full) rather than refused; a
limit the client gives is its own, and one past the context is a 400 as vLLM answers it.
Why 2048: docs/http.md ("Output limit").
"""

from __future__ import annotations

__all__ = ["DEFAULT_MAX_OUTPUT_TOKENS", "output_limit"]

DEFAULT_MAX_OUTPUT_TOKENS = 2048


def output_limit(asked: int | None, max_seq_len: int, used: int) -> int:
    """The most tokens one generation may write: ``asked`` if the client gave it, else the
    default capped by the ``max_seq_len - used`` tokens left in the context (at least 1: a
    full context is then refused by the SDK with ``ContextTooLong``)."""
    if asked is not None:
        return asked
    return max(1, min(DEFAULT_MAX_OUTPUT_TOKENS, max_seq_len - used))
