"""The invariant checker: recompute every page count from scratch and compare.

Owns nothing and mutates nothing. ``check_invariants`` raises ``RuntimeError`` naming the
first broken invariant; tests run it after every operation. ``describe_state`` returns a
plain, comparable description of the whole store so tests can assert that a failing call
changed nothing.

Checked:

* every page is exactly one of: free, a working page of one holder, a committed node;
  so ``free + working + committed + cached == total``;
* node counts: ``holders`` = contexts/snapshots whose tip it is, ``num_children`` = nodes
  whose parent it is, ``pins = holders + pinned children``; a node is pinned iff it lies on
  the chain of a live context or snapshot; every unpinned node is registered (cached), and
  the LRU holds exactly the unpinned childless nodes;
* registration: ``by_hash[h]`` is a node with hash ``h``; each node's hash recomputes from
  its parent's hash and contents; private nodes have only private descendants;
* per state: token/position/extra lists aligned and within the working pages' capacity;
  the committed-id cache equals the chain;
* per owner: ``owner_pages`` equals its states' working pages plus the distinct committed
  pages on their chains, and every node's ``owner_pins`` matches;
* disk tier: the page files on disk are exactly the indexed ones (none lost, no orphan),
  each referenced by as many manifests as list it (``DiskTier.check``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

from runtime.kv.context import PageState, chain_nodes
from runtime.kv.hashing import fold_extras, hash_page
from runtime.kv.holds import HoldTable
from runtime.kv.pool import PagePool
from runtime.kv.snapshots import SnapshotRegistry
from runtime.kv.trie import Node, PageTrie
from runtime.kv.types import ContextId, StoreStats

__all__ = ["check_invariants", "describe_state", "StoreView"]


class StoreView(Protocol):
    """What the checker reads of a ``PageStore`` (it never writes)."""

    pool: PagePool
    trie: PageTrie
    page_size: int
    snapshots: SnapshotRegistry
    next_context_id: int
    tier: Any
    holds: HoldTable

    def context_states(self) -> Iterator[tuple[ContextId, PageState]]: ...

    def stats(self) -> StoreStats: ...

    def owners(self) -> list[Any]: ...

    def owner_pages(self, owner: Any) -> int: ...


def _fail(message: str) -> None:
    raise RuntimeError(f"page store invariant broken: {message}")


def _holders(store: StoreView) -> list[tuple[str, PageState]]:
    out: list[tuple[str, PageState]] = [
        (f"context {cid}", state) for cid, state in store.context_states()
    ]
    out.extend((f"snapshot {key}", snap.state) for key, snap in store.snapshots
               if snap.state is not None)
    out.extend((f"saving {save.key}", save.snap.state) for save in store.snapshots.reserved())
    return out


def _all_nodes(store: StoreView, holders: list[tuple[str, PageState]]) -> list[Node]:
    seen: dict[int, Node] = {}
    roots: list[Node] = list(store.trie.by_hash.values()) + store.trie.candidates()
    roots.extend(state.tip for _, state in holders if state.tip is not None)
    for node in roots:
        cur: Node | None = node
        while cur is not None and id(cur) not in seen:
            seen[id(cur)] = cur
            cur = cur.parent
    return list(seen.values())


def check_invariants(store: StoreView) -> None:
    """Raise ``RuntimeError`` if any page-store invariant is broken."""
    pool, trie, ps = store.pool, store.trie, store.page_size
    owner: dict[int, str] = {}

    def claim(page_id: int, who: str) -> None:
        if not 0 <= page_id < pool.num_pages:
            _fail(f"{who} holds out-of-range page {page_id}")
        if page_id in owner:
            _fail(f"page {page_id} owned by both {owner[page_id]} and {who}")
        owner[page_id] = who

    for page_id in pool.free_ids():
        claim(page_id, "the free list")

    holders = _holders(store)
    for who, state in holders:
        if not len(state.tokens) == len(state.positions) == len(state.extras):
            _fail(f"{who}: token/position/extra lists differ in length")
        if len(state.tokens) > len(state.working) * ps:
            _fail(f"{who}: {len(state.tokens)} tokens exceed {len(state.working)} working pages")
        for page_id in state.working:
            claim(page_id, f"{who} (working)")
        chain = [node.page_id for node in chain_nodes(state.tip)]
        if state.committed_ids is not None and state.committed_ids != chain:
            _fail(f"{who}: committed id cache {state.committed_ids} != chain {chain}")

    nodes = _all_nodes(store, holders)
    holder_count: dict[int, int] = {}
    for _, state in holders:
        if state.tip is not None:
            holder_count[id(state.tip)] = holder_count.get(id(state.tip), 0) + 1
    children: dict[int, list[Node]] = {id(n): [] for n in nodes}
    for node in nodes:
        claim(node.page_id, f"committed node (hash {node.page_hash:#x})")
        if node.parent is not None:
            children[id(node.parent)].append(node)
    pinned: set[int] = set()
    adapter_of: dict[int, int] = {}  # node -> the adapter of the chains that hold it
    for who, state in holders:
        for node in chain_nodes(state.tip):
            pinned.add(id(node))
            if adapter_of.setdefault(id(node), state.adapter) != state.adapter:
                _fail(f"{who}: page {node.page_id} is shared by adapters "
                      f"{adapter_of[id(node)]:#x} and {state.adapter:#x}")

    lru_ids = {id(n) for n in trie.candidates()}
    _check_holds(store)
    for node in nodes:
        where = f"node page {node.page_id}"
        parent = node.parent
        expect_hash = hash_page(
            trie.root_hash if parent is None else parent.page_hash,
            node.tokens,
            node.positions,
            fold_extras(node.extras),
        )
        if node.page_hash != expect_hash:
            _fail(f"{where}: stored hash does not match its contents")
        if not len(node.tokens) == len(node.positions) == len(node.extras) == ps:
            _fail(f"{where}: committed page is not exactly full")
        if node.depth != (1 if parent is None else parent.depth + 1):
            _fail(f"{where}: depth {node.depth} inconsistent with parent")
        if node.holders != holder_count.get(id(node), 0):
            _fail(f"{where}: holders {node.holders} != {holder_count.get(id(node), 0)}")
        kids = children[id(node)]
        if node.num_children != len(kids):
            _fail(f"{where}: num_children {node.num_children} != {len(kids)}")
        expect_pins = node.holders + sum(1 for k in kids if id(k) in pinned)
        if node.pins != expect_pins:
            _fail(f"{where}: pins {node.pins} != {expect_pins}")
        if (node.pins > 0) != (id(node) in pinned):
            _fail(f"{where}: pinned flag disagrees with the holders' chains")
        if node.registered:
            if trie.by_hash.get(node.page_hash) is not node:
                _fail(f"{where}: registered but not indexed under its hash")
            if parent is not None and not parent.registered:
                _fail(f"{where}: registered under a private parent")
        elif id(node) not in pinned:
            _fail(f"{where}: private page is unpinned (should have been freed)")
        in_lru = id(node) in lru_ids
        if in_lru != (id(node) not in pinned and not kids):
            _fail(f"{where}: LRU membership {in_lru} wrong (pins {node.pins}, {len(kids)} kids)")
        queue = trie.lru if node.hold_priority is None else trie.held.get(node.hold_priority, {})
        if in_lru and queue.get(node.page_id) is not node:
            _fail(f"{where}: eviction queue wrong for hold priority {node.hold_priority}")

    for h, node in trie.by_hash.items():
        if node.page_hash != h or not node.registered:
            _fail(f"by_hash[{h:#x}] holds a node with another hash or a private node")
    if len(owner) != pool.num_pages:
        missing = sorted(set(range(pool.num_pages)) - set(owner))
        _fail(f"pages leaked (neither free nor owned): {missing}")
    if trie.num_nodes != len(nodes):
        _fail(f"trie.num_nodes {trie.num_nodes} != {len(nodes)}")
    if trie.num_pinned != len(pinned):
        _fail(f"trie.num_pinned {trie.num_pinned} != {len(pinned)}")
    stats = store.stats()
    total = (
        stats.num_pages_free
        + stats.num_pages_working
        + stats.num_pages_committed
        + stats.num_pages_cached
    )
    if total != stats.num_pages_total:
        _fail(f"free + working + committed + cached = {total} != {stats.num_pages_total}")
    num_working = sum(len(state.working) for _, state in holders)
    if stats.num_pages_working != num_working:
        _fail(f"stats working {stats.num_pages_working} != {num_working}")
    _check_owners(store, holders, nodes, children)
    _check_disk(store)


def _check_disk(store: StoreView) -> None:
    """The disk tier against the files on disk and the durable snapshots' manifests;
    resident durable snapshots in the spill order, and only those."""
    resident = {key for key, snap in store.snapshots
                if snap.head is not None and snap.state is not None}
    if set(store.snapshots.resident) != resident:
        _fail(f"spill order {list(store.snapshots.resident)} != resident durable {resident}")
    for key, snap in store.snapshots:
        if snap.state is None and snap.head is None:
            _fail(f"snapshot {key} has neither pages nor a manifest")
    tier = store.tier
    if tier is None:
        return
    refs: dict[Any, int] = {}
    lists = [snap.head.pages for _, snap in store.snapshots if snap.head is not None]
    lists.extend(save.known for save in store.snapshots.reserved())
    for pages in lists:
        for h in pages:
            refs[h] = refs.get(h, 0) + 1
    tier.check(refs)


def _check_holds(store: StoreView) -> None:
    """Each live hold sits on its tip (a registered node in the trie), each node's holds
    are live, and each owner is charged exactly its holds' pages."""
    table, trie = store.holds, store.trie
    charged: dict[Any, int] = {}
    for hold in table.by_id.values():
        charged[hold.owner] = charged.get(hold.owner, 0) + hold.num_pages
        tip = hold.tip
        if tip is None:
            continue
        if trie.by_hash.get(tip.page_hash) is not tip:
            _fail(f"hold {hold.hold_id}: its tip page {tip.page_id} is not in the trie")
        if not tip.holds or hold not in tip.holds:
            _fail(f"hold {hold.hold_id}: not listed on its tip page {tip.page_id}")
    for node in trie.by_hash.values():
        for hold in node.holds or ():
            if table.by_id.get(hold.hold_id) is not hold or hold.tip is not node:
                _fail(f"page {node.page_id} lists hold {hold.hold_id}, which is not live "
                      "or ends elsewhere")
    if charged != table.pages_of:
        _fail(f"held pages charged {table.pages_of} != the holds' pages {charged}")


def _check_owners(store: StoreView, holders: list[tuple[str, PageState]], nodes: list[Node],
                  children: dict[int, list[Node]]) -> None:
    """Per-owner page counts, recomputed from the holders' chains."""
    working: dict[Any, int] = {}
    chains: dict[Any, set[int]] = {}
    at_node: dict[tuple[int, Any], int] = {}
    for _, state in holders:
        if state.owner is None:
            continue
        working[state.owner] = working.get(state.owner, 0) + len(state.working)
        pinned = chains.setdefault(state.owner, set())
        pinned.update(id(n) for n in chain_nodes(state.tip))
        if state.tip is not None:
            key = (id(state.tip), state.owner)
            at_node[key] = at_node.get(key, 0) + 1
    for owner in {*store.owners(), *working, *chains}:
        expect = working.get(owner, 0) + len(chains.get(owner, ()))
        if store.owner_pages(owner) != expect:
            _fail(f"owner {owner!r}: owner_pages {store.owner_pages(owner)} != {expect}")
    for node in nodes:
        expect_pins: dict[Any, int] = {}
        for owner, pinned in chains.items():
            n = at_node.get((id(node), owner), 0)
            n += sum(1 for k in children[id(node)] if id(k) in pinned)
            if n:
                expect_pins[owner] = n
        if (node.owner_pins or {}) != expect_pins:
            _fail(f"node page {node.page_id}: owner pins {node.owner_pins} != {expect_pins}")


def describe_state(store: StoreView) -> dict[str, Any]:
    """A plain, comparable description of the whole store (for unchanged-state tests)."""

    def state_desc(state: PageState) -> tuple[Any, ...]:
        return (
            tuple(node.page_id for node in chain_nodes(state.tip)),
            tuple(state.working),
            tuple(state.tokens),
            tuple(state.positions),
            tuple(state.extras),
        )

    holders = _holders(store)
    nodes = _all_nodes(store, holders)
    return {
        "free": tuple(store.pool.free_ids()),
        "contexts": {cid: state_desc(s) for cid, s in store.context_states()},
        "snapshots": {key: s.state and state_desc(s.state) for key, s in store.snapshots},
        "nodes": sorted(
            (n.page_id, n.page_hash, n.holders, n.num_children, n.pins, n.registered) for n in nodes
        ),
        "lru": tuple(store.trie.cached_page_ids()),
        "holds": sorted((h.hold_id, h.priority, h.expires_at, h.num_pages,
                         None if h.tip is None else h.tip.page_id)
                        for h in store.holds.by_id.values()),
        "by_hash": sorted((h, n.page_id) for h, n in store.trie.by_hash.items()),
        "next_id": store.next_context_id,
        "stats": store.stats(),
    }
