"""``ContextStates``: the live contexts' page states, and every page they take or give back.

Owns: the table of live contexts (``ContextId -> PageState``, ids never reused), the
per-owner count of working pages, and the three steps every part of the store repeats on
a state: allocate pages (evicting cached pages, and asking ``make_room`` to spill resident
snapshots, only when that makes the allocation succeed), fork a state (one trie reference
on the tip, copies of the working pages), and release one (every reference and working
page back). It also moves a chain's tip (``set_tip``: hold the new tip, then let go of the
old one), commits working pages (``commit``, or one page at a time, ``commit_page``, as
pages come back from disk) and keeps the commit and prefix-hit counters.

``PageStore`` validates its callers' input and calls these; the snapshot store
(``runtime.kv.snapshot_store``) forks into and out of the same states. A snapshot's state is
a ``PageState`` too, owned by nobody and listed in the snapshot registry, not here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from pie_ctx.proto.errors import ContextClosed, InvalidArgument, OutOfPages
from runtime.kv.context import PageState, chain_nodes
from runtime.kv.durable import parent_hash
from runtime.kv.pool import PagePool
from runtime.kv.tier import DiskTier
from runtime.kv.trie import Node, PageTrie
from runtime.kv.types import ContextId, PageId

__all__ = ["ContextStates", "Rewrite"]


@dataclass(frozen=True, slots=True)
class Rewrite:
    """New contents for a state whose chain is cut and whose tail is rewritten (a
    compaction, ``runtime.kv.compaction``): computed by its caller, applied by
    ``ContextStates.rewrite`` in one go.

    Fields:
        tip: the committed page the state's chain now ends at (one of its current chain's,
            or None: no committed pages are kept).
        working: fresh working pages (allocated through ``allocate``), already written.
        tokens, positions, extras: what ``working`` holds, in order.
        num_commit: leading pages of ``working`` to commit at once (full, checked by the
            caller).
    """

    tip: Node | None
    working: list[PageId]
    tokens: list[int]
    positions: list[int]
    extras: list[int]
    num_commit: int


class ContextStates:
    """Live context states over one pool and trie.

    Args:
        pool: the physical pages.
        trie: the committed pages.
        page_size: tokens per page.
        make_room: ``n -> bool``: spill resident snapshots until ``n`` pages are free or
            cached, True when they are (None: nothing to spill).
        expire_holds: ends the holds whose time is up; called before every eviction, so
            expired holds protect nothing (None: no holds).
    """

    def __init__(self, pool: PagePool, trie: PageTrie, page_size: int,
                 make_room: Callable[[int], bool] | None = None,
                 expire_holds: Callable[[], object] | None = None) -> None:
        self.pool = pool
        self.trie = trie
        self.expire_holds = expire_holds
        self.page_size = page_size
        self.make_room = make_room
        # ``n -> bool``: the engine suspends idle contexts until ``n`` pages are free or
        # cached (``PageStore.set_room_maker``), True when they are; None: it never does
        self.suspend_idle: Callable[[int], bool] | None = None
        self.by_id: dict[ContextId, PageState] = {}
        self.working_of: dict[Any, int] = {}  # owner -> working pages of its states
        self.next_id = 1
        self.num_commits = 0  # pages committed (counters of ``PageStore.stats``)
        self.num_dedup_hits = 0  # of them, pages found already committed (shared)
        self.num_prefix_hits = 0  # pages attached without compute (trie or disk)

    # -- the table ---------------------------------------------------------------------

    def get(self, cid: ContextId) -> PageState:
        """The live state of ``cid``.

        Raises:
            InvalidArgument: ``cid`` is not hashable. ContextClosed: unknown or released.
        """
        try:
            state = self.by_id.get(cid)
        except TypeError:  # unhashable: certainly not an id we issued
            raise InvalidArgument(f"context id must be an int, got {cid!r}") from None
        if state is None:
            raise ContextClosed(
                f"context {cid!r} is unknown or released; create, fork or open a new one"
            )
        return state

    def register(self, state: PageState) -> ContextId:
        """List ``state`` as a live context under a new id."""
        cid = ContextId(self.next_id)
        self.next_id += 1
        self.by_id[cid] = state
        return cid

    def unregister(self, cid: ContextId) -> PageState:
        """Unlist ``cid`` (already checked by ``get``); its state is the caller's."""
        return self.by_id.pop(cid)

    def __len__(self) -> int:
        return len(self.by_id)

    def items(self) -> Iterator[tuple[ContextId, PageState]]:
        """Every live context and its state (a copy of the table, safe to mutate under)."""
        return iter(list(self.by_id.items()))

    # -- owners ------------------------------------------------------------------------

    def owner_pages(self, owner: Any) -> int:
        """Pages ``owner``'s contexts hold: their working pages plus every distinct committed
        page on their chains (a page shared with another owner counts for both)."""
        return self.working_of.get(owner, 0) + self.trie.pages_of.get(owner, 0)

    def owners(self) -> list[Any]:
        """Every owner holding at least one page."""
        return list({*self.working_of, *self.trie.pages_of})

    def count_working(self, state: PageState, n: int) -> None:
        """``n`` working pages joined (or, negative, left) ``state``: keep its owner's count."""
        if state.owner is None or n == 0:
            return
        left = self.working_of.get(state.owner, 0) + n
        if left:
            self.working_of[state.owner] = left
        else:
            del self.working_of[state.owner]

    def hand_over(self, state: PageState, owner: Any) -> None:
        """Move an ownerless state (a snapshot's) to ``owner``: its tip and working pages
        count against ``owner`` from now on."""
        if state.tip is not None:
            self.trie.add_holder(state.tip, owner)
            self.trie.drop_holder(state.tip)
        state.owner = owner
        self.count_working(state, len(state.working))

    # -- pages -------------------------------------------------------------------------

    def num_available(self) -> int:
        """Pages an allocation could get right now: free + cached (evictable)."""
        return self.pool.num_free + self.trie.num_cached

    def allocate(self, n: int, *, suspend: bool = True) -> list[PageId] | None:
        """Allocate ``n`` pages, evicting cached pages only if that makes it succeed (and
        first spilling resident durable snapshots if the cache is not enough, then, unless
        not ``suspend``, asking ``suspend_idle`` to take idle contexts out of the pool)."""
        if not self.room_for(n, suspend=suspend):
            return None
        short = n - self.pool.num_free
        if short > 0:
            if self.expire_holds is not None:
                self.expire_holds()
            self.trie.evict(short)
        return self.pool.allocate(n)

    def room_for(self, n: int, *, suspend: bool = True) -> bool:
        """Whether ``n`` pages are free or cached, after spilling resident snapshots and
        (with ``suspend``) suspending idle contexts to make it so if they were not."""
        if n - self.pool.num_free <= self.trie.num_cached:
            return True
        if self.make_room is not None and self.make_room(n):
            return True
        return suspend and self.suspend_idle is not None and self.suspend_idle(n)

    def allocate_or_raise(self, n: int, what: str) -> list[PageId]:
        """``allocate``, or ``OutOfPages`` naming ``what`` needed the pages."""
        pages = self.allocate(n)
        if pages is None:
            raise OutOfPages(f"{what}: it needs {n} more pages but only "
                             f"{self.num_available()} can be freed; release contexts "
                             "or delete snapshots")
        return pages

    def set_tip(self, state: PageState, node: Node) -> None:
        """Point ``state``'s chain at ``node``: hold it for the state's owner, then let go of
        the old tip."""
        self.trie.add_holder(node, state.owner)
        if state.tip is not None:
            self.trie.drop_holder(state.tip, state.owner)
        state.tip = node

    def commit_page(self, state: PageState, page_id: PageId, tokens: tuple[int, ...],
                    positions: tuple[int, ...], extras: tuple[int, ...]) -> None:
        """Append one full page (its KV already in ``page_id``) to ``state``'s chain."""
        tip, deduped = self.trie.advance(state.tip, page_id, tokens, positions, extras,
                                         state.owner)
        if deduped:
            self.pool.free([page_id])
        state.tip = tip
        state.extend_committed_ids([tip.page_id])

    def commit(self, state: PageState, k: int) -> None:
        """Commit the first ``k`` working pages of ``state`` (full, checked by the caller),
        sharing each one already committed and freeing its working copy."""
        if k == 0:
            return
        ps = self.page_size
        tip, new_ids, duplicates = self.trie.advance_pages(
            state.tip, state.working[:k], state.tokens, state.positions, state.extras, ps,
            state.owner,
        )
        self.count_working(state, -k)  # committed now: counted through the trie
        state.tip = tip
        state.extend_committed_ids(new_ids)
        del state.working[:k], state.tokens[: k * ps], state.positions[: k * ps]
        del state.extras[: k * ps]
        self.pool.free(duplicates)
        self.num_commits += k
        self.num_dedup_hits += len(duplicates)

    def rewrite(self, state: PageState, rewrite: Rewrite) -> None:
        """Give ``state`` the contents ``rewrite`` describes: hold its new tip, let go of
        the rest of its old chain and of its old working pages, take the new working pages
        and commit the first ``rewrite.num_commit`` of them."""
        if rewrite.tip is not None:
            self.set_tip(state, rewrite.tip)
        elif state.tip is not None:
            self.trie.drop_holder(state.tip, state.owner)
            state.tip = None
        self.count_working(state, len(rewrite.working) - len(state.working))
        self.pool.free(state.working)
        state.working = list(rewrite.working)
        state.tokens = list(rewrite.tokens)
        state.positions = list(rewrite.positions)
        state.extras = list(rewrite.extras)
        state.committed_ids = [n.page_id for n in chain_nodes(rewrite.tip)]
        state.ids_shared = False
        self.commit(state, rewrite.num_commit)

    def release_working(self, state: PageState, n: int) -> None:
        """Give the last ``n`` working pages of ``state`` back to the pool (checked by the
        caller), with the tokens written into them."""
        keep = len(state.working) - n
        if len(state.tokens) > keep * self.page_size:
            state.keep_tokens(keep * self.page_size)
        released = state.working[keep:]
        del state.working[keep:]
        self.count_working(state, -n)
        self.pool.free(released)

    def attach(self, state: PageState, hits: list[Node], tier: DiskTier | None,
               toks: list[int], poss: list[int], extras: list[int]) -> int:
        """Continue ``state``'s chain with the trie's matching pages ``hits``, then with what
        the disk tier holds after them; count the hits. Returns the pages attached."""
        if hits:
            self.set_tip(state, hits[-1])
            state.extend_committed_ids([node.page_id for node in hits])
        num = len(hits)
        if tier is not None:
            num += self.attach_from_disk(tier, state, toks, poss, extras, num)
        self.num_prefix_hits += num
        return num

    def attach_from_disk(self, tier: DiskTier, state: PageState, toks: list[int],
                         poss: list[int], extras: list[int], start: int) -> int:
        """Continue ``state``'s chain with full pages from ``start`` on that the disk tier
        holds: each is read, verified, copied into a new page and committed. Stops at the
        first page not on disk (or when the pool has no room). Returns the pages attached."""
        ps = self.page_size
        num = 0
        for i in range(start, len(toks) // ps):
            lo, hi = i * ps, (i + 1) * ps
            record = tier.find(parent_hash(state.tip, self.trie.root_hash),
                               toks[lo:hi], poss[lo:hi], extras[lo:hi])
            if record is None:
                break
            pages = self.allocate(1)  # state's chain is held: never evicted for this
            if pages is None:
                break
            tier.install(pages[0], record.payload)
            self.commit_page(state, pages[0], record.tokens, record.positions, record.extras)
            num += 1
        return num

    def fork(self, state: PageState, owner: Any) -> PageState:
        """Copy of ``state`` owned by ``owner``, sharing its chain (one reference), with
        fresh working pages.

        Raises:
            OutOfPages: the working copies cannot be allocated even after eviction.
        """
        n = len(state.working)
        new_pages = self.allocate(n)
        if new_pages is None:
            raise OutOfPages(
                f"fork needs {n} free pages to copy the working pages but only "
                f"{self.num_available()} are available; commit or release working "
                "pages first, or release other contexts"
            )
        child = state.share_bookkeeping()
        child.working = new_pages
        child.owner = owner
        self.count_working(child, n)
        if child.tip is not None:
            self.trie.add_holder(child.tip, owner)
        num_used = -(-len(state.tokens) // self.page_size)
        self.pool.copy_pages(new_pages[:num_used], state.working[:num_used])
        return child

    def release(self, state: PageState) -> None:
        """Give back every reference and working page of ``state`` (left empty)."""
        if state.tip is not None:
            self.trie.drop_holder(state.tip, state.owner)
            state.tip = None
        self.count_working(state, -len(state.working))
        self.pool.free(state.working)
        state.working = []
        state.tokens.clear()
        state.positions.clear()
        state.extras.clear()
        state.committed_ids = []
        state.ids_shared = False
