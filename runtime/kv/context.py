"""Per-context page state: the committed chain tip plus the working pages and their tokens.

Owns: a context's working pages (private, mutable) and the tokens, positions and per-token
extras written into them. It holds one trie reference, on its tip; the trie owns the
committed pages themselves. Snapshots are ``PageState`` objects too (frozen: nothing
mutates a state while it sits in the registry).

Invariants:

* ``len(tokens) == len(positions) == len(extras) <= len(working) * page_size``; tokens fill
  the working pages in order (working token ``i`` is in ``working[i // page_size]``, slot
  ``i % page_size``), so only the last non-empty page can be partial.
* ``committed_ids`` is ``None`` (not computed yet) or exactly the page ids root..tip. It may
  be shared with forks (``ids_shared``): copy before appending.
* ``seq_len == num_committed_pages * page_size + len(tokens)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pie_ctx.proto.messages import ContextState
from runtime.kv.trie import Node
from runtime.kv.types import PageId

__all__ = ["PageState", "chain_nodes"]


def chain_nodes(tip: Node | None) -> list[Node]:
    """The nodes of a committed chain, root first. O(chain length)."""
    nodes: list[Node] = []
    node = tip
    while node is not None:
        nodes.append(node)
        node = node.parent
    nodes.reverse()
    return nodes


@dataclass(slots=True)
class PageState:
    """The page state of one context or snapshot."""

    tip: Node | None = None
    working: list[PageId] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    extras: list[int] = field(default_factory=list)
    committed_ids: list[PageId] | None = field(default_factory=list)
    ids_shared: bool = False
    owner: Any = None  # whose page share this state counts against (None: nobody's)
    adapter: int = 0  # the LoRA adapter's key its tokens are computed under (0: none)

    @property
    def num_committed_pages(self) -> int:
        """Pages on the committed chain."""
        return 0 if self.tip is None else self.tip.depth

    def counters(self, page_size: int) -> ContextState:
        """The state's page counters (the record the SDK receives)."""
        num_committed = self.num_committed_pages
        return ContextState(
            seq_len=num_committed * page_size + len(self.tokens), page_size=page_size,
            num_committed_pages=num_committed, num_working_pages=len(self.working),
            num_working_tokens=len(self.tokens), next_position=self.next_position())

    def next_position(self) -> int:
        """Position after the last written token (0 for an empty state)."""
        if self.positions:
            return self.positions[-1] + 1
        if self.tip is not None:
            return self.tip.positions[-1] + 1
        return 0

    def all_tokens(self) -> list[int]:
        """Every token id, committed then working. O(seq_len)."""
        out: list[int] = []
        for node in chain_nodes(self.tip):
            out.extend(node.tokens)
        out.extend(self.tokens)
        return out

    def all_positions(self) -> list[int]:
        """Every token's position, committed then working. O(seq_len)."""
        out: list[int] = []
        for node in chain_nodes(self.tip):
            out.extend(node.positions)
        out.extend(self.positions)
        return out

    def keep_tokens(self, n: int) -> None:
        """Keep the first ``n`` working tokens (with their positions and extras)."""
        del self.tokens[n:], self.positions[n:], self.extras[n:]

    def write(self, tokens: list[int], positions: list[int], extras: list[int],
              page_size: int) -> list[tuple[PageId, int]]:
        """Record tokens after the last one (room checked by the caller): one
        ``(page_id, slot)`` per token, where its K and V go."""
        start = len(self.tokens)
        self.tokens.extend(tokens)
        self.positions.extend(positions)
        self.extras.extend(extras)
        working = self.working
        return [(working[i // page_size], i % page_size)
                for i in range(start, start + len(tokens))]

    def committed_page_ids(self) -> list[PageId]:
        """Committed page ids root..tip; computed once, then kept in step with commits.

        The returned list may be shared: callers must not mutate it.
        """
        ids = self.committed_ids
        if ids is None:
            ids = [node.page_id for node in chain_nodes(self.tip)]
            self.committed_ids = ids
            self.ids_shared = False
        return ids

    def extend_committed_ids(self, new_ids: list[PageId]) -> None:
        """Record pages just appended to the chain (copy-on-write when shared)."""
        if self.committed_ids is None:
            return  # recomputed lazily from the tip
        if self.ids_shared:
            self.committed_ids = self.committed_ids + new_ids
            self.ids_shared = False
        else:
            self.committed_ids.extend(new_ids)

    def share_bookkeeping(self) -> PageState:
        """A new state with the same tip and token lists copied, but NO working pages.

        The caller takes the trie reference on the tip and fills ``working``. The committed
        id cache is shared copy-on-write, so this is O(working tokens), not O(committed).
        """
        child = PageState(
            tip=self.tip,
            working=[],
            tokens=self.tokens.copy(),
            positions=self.positions.copy(),
            extras=self.extras.copy(),
            committed_ids=self.committed_ids,
            ids_shared=self.committed_ids is not None,
            owner=self.owner,
            adapter=self.adapter,
        )
        if self.committed_ids is not None:
            self.ids_shared = True
        return child
