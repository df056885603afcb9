"""``ContextQueries``: the read-only questions ``PageStore`` answers about one context.

Owner: ``runtime.kv.store`` (``PageStore`` inherits these); each answer is read from the
context's ``PageState`` and changes nothing. Every method raises ``ContextClosed`` for an
unknown context.
"""

from __future__ import annotations

from pie_ctx.proto.messages import ContextState
from runtime.kv.states import ContextStates
from runtime.kv.types import ContextId, PageId


class ContextQueries:
    """Page tables, counters, tokens and positions of a live context."""

    _states: ContextStates
    page_size: int

    def page_table(self, cid: ContextId) -> list[PageId]:
        """Every page of the context in KV order: committed (root..tip), then working.

        Raises:
            ContextClosed: unknown context.
        """
        state = self._states.get(cid)
        return state.committed_page_ids() + state.working

    def state(self, cid: ContextId) -> ContextState:
        """The context's page counters (the same record the SDK receives).

        ``seq_len == num_committed_pages * page_size + num_working_tokens``.

        Raises:
            ContextClosed: unknown context.
        """
        return self._states.get(cid).counters(self.page_size)

    def tokens(self, cid: ContextId) -> list[int]:
        """All token ids of the context, committed then working. O(seq_len).

        Raises:
            ContextClosed: unknown context.
        """
        return self._states.get(cid).all_tokens()

    def positions(self, cid: ContextId) -> list[int]:
        """Every token's rotary position, committed then working. O(seq_len).

        Raises:
            ContextClosed: unknown context.
        """
        return self._states.get(cid).all_positions()

    def working_tokens(self, cid: ContextId) -> list[int]:
        """Token ids written into working pages (a copy).

        Raises:
            ContextClosed: unknown context.
        """
        return self._states.get(cid).tokens.copy()

    def next_position(self, cid: ContextId) -> int:
        """Position after the last written token (equals ``seq_len`` with default positions).

        Raises:
            ContextClosed: unknown context.
        """
        return self._states.get(cid).next_position()
