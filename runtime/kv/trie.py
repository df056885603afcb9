"""The committed-page trie: chained-hash index, reference counts, LRU cache of free pages.

Owns: every committed page (a ``Node`` per physical page) from the moment it is committed
until it is evicted or dropped; it gives pages back to the pool itself.

Structure. Each node points at its parent (the previous page of the chain), so a chain is
identified by its *tip*. A context or snapshot holds only its tip (``holders``); a node is
kept alive by its holders and its children (``refcount = holders + num_children``). That
makes ``fork`` one count bump, whatever the committed length.

Pinning. A node is *pinned* when some holder's chain runs through it:
``pins = holders + number of pinned children`` and pinned means ``pins > 0``. Pins
propagate up only on a 0 <-> 1 transition, so the cost is the number of pages whose state
changes. Unpinned registered nodes are *cached*: findable by ``lookup`` and evictable.

Owners. A holder may carry an owner (the engine's client that holds the context); the trie
then also counts, per owner, the distinct committed pages its holders' chains run
through (``owner_pins``/``pages_of``), with the same 0 <-> 1 propagation as pins. This is
what per-owner page shares are measured in: a page shared by two contexts of one owner
counts once for it, and once for every other owner that uses it too.

LRU. ``lru`` holds exactly the unheld cached nodes that have no children (the only ones
that can be evicted without breaking a chain), least recently used first. A node whose
last holder leaves is appended (most recent); a parent left childless by an eviction is
put at the front, because its last use was its child's, the oldest in the cache. So a
chain cached together is evicted tip-first, contiguously. Lookup hits pin nodes, taking
them out.

Holds (``runtime.kv.holds`` owns their records). A :class:`Hold` keeps the chain
root..``hold.tip`` cached longer: a childless cached node that is the tip of some hold sits
in ``held[priority]`` (its holds' highest priority) instead of ``lru``, and eviction takes
``lru`` first, then ``held`` by priority, lowest first, each least recently used first. A
held range's inner pages have children, so only its tip is ever a candidate; evicting a
held tip moves its holds to its parent (the range shrinks by one page), and a hold whose
first page goes covers nothing in the pool.

Registration and collisions. ``by_hash`` maps a hash to one registered node. On commit, a
hash hit is verified (same parent node, tokens, positions, per-token extras); only then is
the existing page shared. If the hash is taken by a *different* page (a 64-bit collision,
or a chain under a private node), the new node is *private*: it is not registered, never
found by lookup, never cached (freed as soon as it is unpinned), and its descendants are
private too. A collision therefore costs sharing, never correctness.

Listeners. Whoever must follow the trie's pages (the disk tier keeps evicted pages, the KV
event log tells routers) is a :class:`TrieListener` given at construction; the trie calls
them in order, synchronously: ``stored`` when a page is registered (findable), ``evicting``
just before an evicted page goes back to the pool (its bytes still there), ``removed``
once it is gone. Private pages are neither stored nor removed.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from runtime.kv.hashing import chain_root, fold_extras, hash_page
from runtime.kv.pool import PagePool
from runtime.kv.types import PageHash, PageId

__all__ = ["Hold", "Node", "PageTrie", "TrieListener"]


@dataclass(slots=True, eq=False)
class Hold:
    """A request to keep the committed pages root..``tip`` cached (``runtime.kv.holds``)."""

    hold_id: int
    owner: Any
    priority: int
    expires_at: float  # on the hold table's clock
    num_pages: int  # the range's length when it was taken (what its owner is charged)
    tip: Node | None  # the range's last page still in the pool (None: none left)
    on_disk: list[PageHash]  # its pages the disk tier kept when they left the pool


@dataclass(slots=True, eq=False)
class Node:
    """One committed page: its physical id, identity (hash + contents) and counts."""

    page_id: PageId
    page_hash: PageHash
    parent: Node | None
    tokens: tuple[int, ...]
    positions: tuple[int, ...]
    extras: tuple[int, ...]
    depth: int  # pages on the chain root..self, inclusive
    registered: bool
    holders: int = 0
    num_children: int = 0
    pins: int = 0
    # owner -> that owner's holders here + children its chains run through (None: none yet)
    owner_pins: dict[Any, int] | None = None
    holds: list[Hold] | None = None  # the holds whose range ends here (None: none)

    @property
    def hold_priority(self) -> int | None:
        """The highest priority of the holds ending here (None: not a hold's tip)."""
        return max(h.priority for h in self.holds) if self.holds else None

    @property
    def refcount(self) -> int:
        """References keeping this page alive: holders (contexts, snapshots) + children."""
        return self.holders + self.num_children

    def matches(
        self,
        parent: Node | None,
        tokens: Sequence[int],
        positions: Sequence[int],
        extras: Sequence[int],
    ) -> bool:
        """True when this node stores exactly this page after exactly this parent."""
        return (
            self.parent is parent
            and self.tokens == tuple(tokens)
            and self.positions == tuple(positions)
            and self.extras == tuple(extras)
        )


class TrieListener:
    """What follows the trie's registered pages; every method does nothing by default.

    Methods are called on the thread that changes the trie (the engine's), in the order
    the changes happen, and must not change the trie themselves.
    """

    __slots__ = ()

    def stored(self, node: Node) -> None:
        """``node`` was committed and registered (lookups find it from now on)."""

    def evicting(self, node: Node) -> None:
        """``node`` is being evicted: its page still holds its bytes, until this returns."""

    def removed(self, node: Node) -> None:
        """``node`` was evicted: no lookup finds it any more; its page is back in the pool."""


class PageTrie:
    """Hash-indexed committed pages with holder counts, pinning and an LRU of cached pages."""

    __slots__ = ("pool", "root_hash", "by_hash", "lru", "held", "num_nodes", "num_pinned",
                 "num_evictions", "pages_of", "listeners")

    def __init__(self, pool: PagePool, listeners: Sequence[TrieListener] = ()) -> None:
        """Create an empty trie that frees evicted pages into ``pool``.

        Args:
            pool: where evicted pages go back.
            listeners: told of every registered page and every eviction, in this order
                (see :class:`TrieListener`).
        """
        self.pool = pool
        self.listeners = tuple(listeners)
        self.root_hash = chain_root(pool.kv_dtype)  # the format seeds every chain
        self.by_hash: dict[PageHash, Node] = {}
        self.lru: OrderedDict[PageId, Node] = OrderedDict()
        self.held: dict[int, OrderedDict[PageId, Node]] = {}  # priority -> held candidates
        self.num_nodes = 0
        self.num_pinned = 0
        self.num_evictions = 0
        self.pages_of: dict[Any, int] = {}  # owner -> distinct committed pages it pins

    @property
    def num_cached(self) -> int:
        """Committed pages no holder needs; all of them can be evicted (leaves first)."""
        return self.num_nodes - self.num_pinned

    # -- lookup and commit -------------------------------------------------------------

    def lookup(
        self,
        parent: Node | None,
        tokens: Sequence[int],
        positions: Sequence[int],
        extras: Sequence[int],
    ) -> Node | None:
        """The registered node holding this page after ``parent``, verified, or ``None``."""
        h = hash_page(
            self.root_hash if parent is None else parent.page_hash, tokens, positions,
            fold_extras(extras)
        )
        node = self.by_hash.get(h)
        if node is not None and node.matches(parent, tokens, positions, extras):
            return node
        return None

    def advance(
        self,
        tip: Node | None,
        page_id: PageId,
        tokens: Sequence[int],
        positions: Sequence[int],
        extras: Sequence[int],
        owner: Any = None,
    ) -> tuple[Node, bool]:
        """Commit one full page after ``tip`` and move one holder from ``tip`` to it.

        Args:
            tip: the holder's current tip (``None`` for an empty chain); the caller holds it.
            page_id: the working page whose KV holds these tokens.
            tokens, positions, extras: the page contents (exactly ``page_size`` each).
            owner: the holder's owner (None: not counted per owner).

        Returns:
            ``(new_tip, deduped)``. When ``deduped`` is True an identical page already
            existed and ``page_id`` was NOT taken: the caller must free it.
        """
        parent_hash = self.root_hash if tip is None else tip.page_hash
        h = hash_page(parent_hash, tokens, positions, fold_extras(extras))
        existing = self.by_hash.get(h)
        if existing is not None and existing.matches(tip, tokens, positions, extras):
            self.add_holder(existing, owner)
            if tip is not None:
                self.drop_holder(tip, owner)
            return existing, True
        registered = existing is None and (tip is None or tip.registered)
        node = Node(
            page_id=page_id,
            page_hash=h,
            parent=tip,
            tokens=tuple(tokens),
            positions=tuple(positions),
            extras=tuple(extras),
            depth=1 if tip is None else tip.depth + 1,
            registered=registered,
        )
        self.num_nodes += 1
        if registered:
            self.by_hash[h] = node
            for listener in self.listeners:
                listener.stored(node)
        if tip is not None:
            tip.num_children += 1
        self.add_holder(node, owner)
        if tip is not None:
            self.drop_holder(tip, owner)
        return node, False

    def advance_pages(
        self,
        tip: Node | None,
        page_ids: Sequence[PageId],
        tokens: Sequence[int],
        positions: Sequence[int],
        extras: Sequence[int],
        page_size: int,
        owner: Any = None,
    ) -> tuple[Node | None, list[PageId], list[PageId]]:
        """Commit ``len(page_ids)`` consecutive full pages after ``tip`` (see ``advance``).

        Page ``i`` holds ``tokens[i * page_size:(i + 1) * page_size]`` (same for positions
        and extras).

        Returns:
            ``(new_tip, committed_ids, duplicates)``: the chain's new page ids, and the
            working pages that were deduplicated, which the caller must free.
        """
        new_ids: list[PageId] = []
        duplicates: list[PageId] = []
        for i, page_id in enumerate(page_ids):
            lo, hi = i * page_size, (i + 1) * page_size
            tip, deduped = self.advance(
                tip, page_id, tokens[lo:hi], positions[lo:hi], extras[lo:hi], owner
            )
            new_ids.append(tip.page_id)
            if deduped:
                duplicates.append(page_id)
        return tip, new_ids, duplicates

    def match_pages(
        self,
        tip: Node | None,
        tokens: Sequence[int],
        positions: Sequence[int],
        extras: Sequence[int],
        page_size: int,
    ) -> list[Node]:
        """Verified nodes continuing ``tip`` for the leading full pages of these tokens.

        Stops at the first miss; read-only (pins and LRU order unchanged).
        """
        node, hits = tip, []
        for i in range(len(tokens) // page_size):
            lo, hi = i * page_size, (i + 1) * page_size
            found = self.lookup(node, tokens[lo:hi], positions[lo:hi], extras[lo:hi])
            if found is None:
                break
            hits.append(found)
            node = found
        return hits

    # -- holders and pins --------------------------------------------------------------

    def add_holder(self, node: Node, owner: Any = None) -> None:
        """A context or snapshot (of ``owner``, if any) now has ``node`` as its tip."""
        node.holders += 1
        self._pin(node)
        if owner is not None:
            self._pin_owner(node, owner)

    def drop_holder(self, node: Node, owner: Any = None) -> None:
        """A context or snapshot (of ``owner``, if any) no longer has ``node`` as its tip."""
        if node.holders <= 0:
            raise RuntimeError(f"PageTrie: page {node.page_id} dropped with no holder")
        node.holders -= 1
        if owner is not None:
            self._unpin_owner(node, owner)
        self._unpin(node)

    def _pin_owner(self, node: Node | None, owner: Any) -> None:
        added = 0
        while node is not None:
            counts = node.owner_pins
            if counts is None:
                counts = node.owner_pins = {}
            n = counts.get(owner, 0) + 1
            counts[owner] = n
            if n > 1:
                break
            added += 1
            node = node.parent
        if added:
            self.pages_of[owner] = self.pages_of.get(owner, 0) + added

    def _unpin_owner(self, node: Node | None, owner: Any) -> None:
        removed = 0
        while node is not None:
            counts = node.owner_pins
            n = (counts or {}).get(owner, 0) - 1
            if n < 0:
                raise RuntimeError(f"PageTrie: page {node.page_id} unpinned by an owner "
                                   "that did not pin it")
            if n:
                counts[owner] = n  # type: ignore[index]
                break
            del counts[owner]  # type: ignore[union-attr]
            removed += 1
            node = node.parent
        if removed:
            left = self.pages_of[owner] - removed
            if left:
                self.pages_of[owner] = left
            else:
                del self.pages_of[owner]

    def _pin(self, node: Node | None) -> None:
        while node is not None:
            node.pins += 1
            if node.pins > 1:
                return
            self.num_pinned += 1
            if node.num_children == 0:
                self._take(node)
            node = node.parent

    def _unpin(self, node: Node | None) -> None:
        while node is not None:
            node.pins -= 1
            if node.pins > 0:
                return
            if node.pins < 0:
                raise RuntimeError(f"PageTrie: page {node.page_id} has negative pins")
            self.num_pinned -= 1
            parent = node.parent
            if node.num_children == 0:
                if node.registered:
                    self._place(node, front=False)  # most recently used end
                else:
                    self._drop_node(node)  # private pages are never cached
            node = parent

    # -- holds -------------------------------------------------------------------------

    def add_hold(self, hold: Hold) -> None:
        """Start ``hold`` on its tip (a registered node): the range is evicted last."""
        node = hold.tip
        if node is None or not node.registered:
            raise RuntimeError("PageTrie: a hold needs a registered tip")
        candidate = self._take(node)
        node.holds = [*(node.holds or ()), hold]
        if candidate:
            self._place(node, front=False)

    def drop_hold(self, hold: Hold) -> None:
        """End ``hold``: its tip, if nothing else holds it, is next in line for eviction."""
        node = hold.tip
        if node is None:
            return
        if not node.holds or hold not in node.holds:
            raise RuntimeError(f"PageTrie: hold {hold.hold_id} is not on its tip")
        candidate = self._take(node)
        node.holds = [h for h in node.holds if h is not hold] or None
        hold.tip = None
        if candidate:
            self._place(node, front=True)

    def _take(self, node: Node) -> bool:
        """Take ``node`` out of the eviction candidates; True when it was one."""
        if self.lru.pop(node.page_id, None) is not None:
            return True
        priority = node.hold_priority
        if priority is None:
            return False
        queue = self.held.get(priority)
        if queue is None or queue.pop(node.page_id, None) is None:
            return False
        if not queue:
            del self.held[priority]
        return True

    def _place(self, node: Node, front: bool) -> None:
        """Make ``node`` (cached, childless) an eviction candidate, at the front (next
        victim) or the back of its queue: ``lru``, or ``held`` at its hold priority."""
        priority = node.hold_priority
        if priority is None:
            queue = self.lru
        else:
            queue = self.held.get(priority)
            if queue is None:
                queue = self.held[priority] = OrderedDict()
        queue[node.page_id] = node
        if front:
            queue.move_to_end(node.page_id, last=False)

    def _next_victim(self) -> Node | None:
        """The next page to evict: unheld first (LRU), then held by priority."""
        if self.lru:
            return self.lru.popitem(last=False)[1]
        if not self.held:
            return None
        priority = min(self.held)
        queue = self.held[priority]
        node = queue.popitem(last=False)[1]
        if not queue:
            del self.held[priority]
        return node

    # -- eviction ----------------------------------------------------------------------

    def evict(self, n: int) -> list[PageId]:
        """Evict up to ``n`` cached pages, unheld ones first, least recently used first;
        return their ids.

        The evicted pages go back to the pool in eviction order.
        """
        evicted: list[PageId] = []
        gone: list[Node] = []
        while len(evicted) < n:
            node = self._next_victim()
            if node is None:
                break
            for listener in self.listeners:
                listener.evicting(node)
            del self.by_hash[node.page_hash]
            self._unlink(node)
            gone.append(node)
            evicted.append(node.page_id)
            parent = node.parent
            if node.holds:  # the holds shrink to the parent (or to nothing)
                for hold in node.holds:
                    hold.tip = parent
                if parent is not None:
                    parent.holds = [*(parent.holds or ()), *node.holds]
                node.holds = None
            if parent is not None and parent.num_children == 0 and parent.pins == 0:
                self._place(parent, front=True)
        self.num_evictions += len(evicted)
        self.pool.free(evicted)  # handed out again in eviction order
        for node in gone:
            for listener in self.listeners:
                listener.removed(node)
        return evicted

    def _unlink(self, node: Node) -> None:
        """Detach an unpinned, childless node from its parent (its page is not freed)."""
        self.num_nodes -= 1
        if node.parent is not None:
            node.parent.num_children -= 1

    def _drop_node(self, node: Node) -> None:
        """Unlink an unpinned, childless node and free its page."""
        self._unlink(node)
        self.pool.free([node.page_id])

    def candidates(self) -> list[Node]:
        """Evictable-now pages in eviction order (next victim first)."""
        out = list(self.lru.values())
        for priority in sorted(self.held):
            out.extend(self.held[priority].values())
        return out

    def cached_page_ids(self) -> list[PageId]:
        """Evictable-now pages in eviction order (next victim first); for tests and stats."""
        return [node.page_id for node in self.candidates()]
