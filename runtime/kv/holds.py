"""Holds: a client's request to keep a range of committed pages cached for a while.

Owns: every live :class:`~runtime.kv.trie.Hold` record (by id), its owner's charge and its
deadline on an injectable clock. The trie owns where a held page stands in the eviction
order (``PageTrie.add_hold``/``drop_hold``); the disk tier owns the held pages it kept on
disk (``DiskTier.release_held``). Nothing else creates or ends a hold.

The rule (docs/pages.md, "Holds"): a hold covers a context's leading committed pages,
root..tip. Held pages stay findable by prefix matching after their context is released,
and eviction takes them only after every unheld cached page; among held pages, the lowest
priority goes first, least recently used first within a priority. A hold ends when it is
released or when its time to live runs out; expiry is checked before every eviction
(``expire``), and an ended hold's pages are next in line, like any cached page whose
last user is long gone. A page evicted while held goes to the disk tier first, when there
is one, and stays there until the hold ends.

Bounds: an owner's live holds together may cover at most ``max_pages_per_owner`` pages
(each counted at the length it had when taken); a hold over it raises ``HoldLimit`` and
changes nothing. A priority is an int in ``[0, 100]``, a time to live a finite number of
seconds in ``(0, 86400]`` (``pie_ctx.proto.checks.hold_terms``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

from pie_ctx.proto.checks import hold_terms
from pie_ctx.proto.errors import HoldLimit, HoldNotFound
from runtime.kv.context import PageState
from runtime.kv.tier import DiskTier
from runtime.kv.trie import Hold, Node, PageTrie

__all__ = ["HoldTable", "SUSPENDED"]

# The owner of suspended contexts' holds: not a client, so never over a client's limit, and
# no ``release_hold`` can name it.
SUSPENDED = object()


class HoldTable:
    """The live holds of one page store.

    Args:
        trie: the committed pages the holds cover.
        tier: the disk tier (None: evicted held pages are lost like any other).
        page_size: tokens per page.
        max_pages_per_owner: the most pages one owner's holds may cover together (0: a
            quarter of the pool).
        clock: seconds, monotonic (tests pass a fake one).
    """

    def __init__(self, trie: PageTrie, tier: DiskTier | None, page_size: int,
                 max_pages_per_owner: int = 0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.trie = trie
        self.tier = tier
        self.page_size = page_size
        self.max_pages_per_owner = max_pages_per_owner or max(1, trie.pool.num_pages // 4)
        self.clock = clock
        self.by_id: dict[int, Hold] = {}
        self.pages_of: dict[Any, int] = {}  # owner -> pages its live holds are charged
        self.next_id = 1
        self.num_expired = 0

    def __len__(self) -> int:
        return len(self.by_id)

    def hold(self, state: PageState, owner: Any, ttl: Any, priority: Any,
             num_tokens: int | None = None) -> Hold:
        """Hold the context's leading committed pages (all of them, or the whole pages of
        its first ``num_tokens`` tokens).

        Returns:
            The new hold (its ``num_pages`` may be 0: nothing committed yet to hold).

        Raises:
            InvalidArgument: bad ``ttl``, ``priority`` or ``num_tokens``.
            HoldLimit: the owner's holds would cover more than ``max_pages_per_owner``.
        """
        ttl, priority, num_tokens = hold_terms(ttl, priority, num_tokens)
        depth = 0 if state.tip is None else state.tip.depth
        if num_tokens is not None:
            depth = min(depth, num_tokens // self.page_size)
        tip = _registered_ancestor(state.tip, depth)
        num_pages = 0 if tip is None else tip.depth
        self.expire()
        charged = self.pages_of.get(owner, 0)
        if charged + num_pages > self.max_pages_per_owner:
            raise HoldLimit(f"retain: holding {num_pages} more pages would give this client "
                            f"{charged + num_pages} held pages, over its limit of "
                            f"{self.max_pages_per_owner}; release a hold or hold fewer tokens")
        return self._start(owner, priority, self.clock() + ttl, tip)

    def hold_suspended(self, state: PageState, priority: int) -> Hold:
        """Hold a suspended context's whole chain (``runtime.kv.suspend``) until its
        resume or release ends it: no time limit, charged to no client (its owner is
        ``SUSPENDED``), evicted by ``priority`` among the other holds."""
        return self._start(SUSPENDED, priority, math.inf, _registered_ancestor(
            state.tip, 0 if state.tip is None else state.tip.depth))

    def end(self, hold: Hold) -> None:
        """End ``hold`` (a suspended context's, which no client can name) if still live."""
        if self.by_id.get(hold.hold_id) is hold:
            self._end(hold)

    def _start(self, owner: Any, priority: int, expires_at: float, tip: Node | None) -> Hold:
        num_pages = 0 if tip is None else tip.depth
        hold = Hold(hold_id=self.next_id, owner=owner, priority=priority,
                    expires_at=expires_at, num_pages=num_pages, tip=tip, on_disk=[])
        self.next_id += 1
        self.by_id[hold.hold_id] = hold
        self.pages_of[owner] = self.pages_of.get(owner, 0) + num_pages
        if tip is not None:
            self.trie.add_hold(hold)
        return hold

    def release(self, hold_id: Any, owner: Any) -> None:
        """End the owner's hold ``hold_id`` now.

        Raises:
            HoldNotFound: no such live hold of this owner (expired, released, or another's).
        """
        hold = self.by_id.get(hold_id) if isinstance(hold_id, int) else None
        if hold is None or hold.owner != owner:
            raise HoldNotFound(f"release_hold: no live hold {hold_id!r} of this client (it "
                               "expired or was released)")
        self._end(hold)

    def expire(self) -> int:
        """End every hold whose time is up; return how many ended."""
        now = self.clock()
        ended = [h for h in self.by_id.values() if h.expires_at <= now]
        for hold in ended:
            self._end(hold)
        self.num_expired += len(ended)
        return len(ended)

    def _end(self, hold: Hold) -> None:
        del self.by_id[hold.hold_id]
        left = self.pages_of[hold.owner] - hold.num_pages
        if left:
            self.pages_of[hold.owner] = left
        else:
            del self.pages_of[hold.owner]
        self.trie.drop_hold(hold)
        if self.tier is not None and hold.on_disk:
            self.tier.release_held(hold.on_disk)
        hold.on_disk = []

    def held_pages(self) -> dict[int, int]:
        """Pages in the pool some live hold covers, by the highest priority covering them.

        O(held pages): each page is walked once, from the highest-priority holds down.
        """
        seen: set[int] = set()
        by_priority: dict[int, int] = {}
        for hold in sorted(self.by_id.values(), key=lambda h: -h.priority):
            node, n = hold.tip, 0
            while node is not None and id(node) not in seen:
                seen.add(id(node))
                n += 1
                node = node.parent
            if n:
                by_priority[hold.priority] = by_priority.get(hold.priority, 0) + n
        return by_priority


def _registered_ancestor(tip: Node | None, depth: int) -> Node | None:
    """The deepest registered node on ``tip``'s chain at most ``depth`` pages deep (private
    pages are never cached, so a hold ends before them)."""
    node = tip
    while node is not None and (node.depth > depth or not node.registered):
        node = node.parent
    return node
