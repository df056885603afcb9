"""Page counters read from the runtime's latest ``ContextState`` (never computed here)."""

from __future__ import annotations

from pie_ctx.proto import messages as P

__all__ = ["Counters"]


class Counters:
    """Counter properties over ``_context_state()``, shared by ``Context`` and ``RawContext``."""

    __slots__ = ()

    def _context_state(self) -> P.ContextState:
        raise NotImplementedError

    @property
    def seq_len(self) -> int:
        """Tokens in the KV cache: committed pages x page_size + working tokens."""
        return self._context_state().seq_len

    @property
    def page_size(self) -> int:
        """Tokens per page."""
        return self._context_state().page_size

    @property
    def num_committed_pages(self) -> int:
        """Full, immutable pages (shared with every context that has the same prefix)."""
        return self._context_state().num_committed_pages

    @property
    def num_working_pages(self) -> int:
        """Private, mutable pages: the partly written tail and pages reserved ahead."""
        return self._context_state().num_working_pages

    @property
    def num_working_tokens(self) -> int:
        """Tokens written in working pages."""
        return self._context_state().num_working_tokens

    @property
    def next_position(self) -> int:
        """Position the next token gets by default (``seq_len`` unless positions were set)."""
        return self._context_state().next_position
