"""Exact unit tests of PageStore: page ids, dedup, LRU order, edge cases, snapshots."""

from __future__ import annotations

import pytest

from pie_ctx.errors import (
    ContextClosed,
    InvalidArgument,
    OutOfPages,
    SnapshotExists,
    SnapshotNotFound,
)
from runtime.kv import ContextId, PageHash, PageStore

from .helpers import assert_unchanged, fill, make_store, prefill

P1 = [1, 2, 3, 4]
P2 = [5, 6, 7, 8]
P3 = [9, 10, 11, 12]


def counters(store: PageStore, cid: ContextId) -> tuple[int, int, int, int, int]:
    """(num_committed_pages, num_working_pages, num_working_tokens, seq_len, page_size)."""
    s = store.state(cid)
    return (s.num_committed_pages, s.num_working_pages, s.num_working_tokens, s.seq_len,
            s.page_size)


def test_page_ids_slots_and_counters() -> None:
    store = make_store()
    cid = store.create_context()
    assert counters(store, cid) == (0, 0, 0, 0, 4)
    assert store.reserve_working_pages(cid, 2)
    slots = store.write_tokens(cid, [1, 2, 3, 4, 5, 6], list(range(6)))
    assert slots == [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1)]
    assert counters(store, cid) == (0, 2, 6, 6, 4)
    assert store.commit_full_pages(cid) == 1
    assert counters(store, cid) == (1, 1, 2, 6, 4)
    assert store.page_table(cid) == [0, 1]
    assert store.tokens(cid) == [1, 2, 3, 4, 5, 6]
    assert store.working_tokens(cid) == [5, 6]
    assert store.next_position(cid) == 6
    assert store.reserve_working_pages(cid, 1)
    assert store.page_table(cid) == [0, 1, 2]
    assert store.write_tokens(cid, [7, 8, 9], [6, 7, 8]) == [(1, 2), (1, 3), (2, 0)]
    store.check_invariants()


def test_dedup_on_commit_shares_pages_and_frees_duplicates() -> None:
    store = make_store()
    a = prefill(store, P1 + P2)
    assert store.page_table(a) == [0, 1]
    b = store.create_context()
    fill(store, b, P1 + P2)
    assert store.page_table(b) == [2, 3]
    assert store.commit_full_pages(b) == 2
    assert store.page_table(b) == [0, 1]  # same physical pages as a
    assert store.pool.free_ids()[:2] == [2, 3]  # the duplicates went back to the pool
    stats = store.stats()
    assert (stats.num_dedup_hits, stats.num_commits, stats.num_pages_committed) == (2, 4, 2)
    # Same first page, different second page: shares only page 0.
    c = prefill(store, P1 + P3)
    assert store.page_table(c) == [0, 3]
    store.check_invariants()


def test_dedup_is_chained_not_per_page() -> None:
    store = make_store()
    prefill(store, P1 + P2)
    c = prefill(store, P3 + P2)  # P2 after a different parent is a different page
    assert store.page_table(c) == [2, 3]
    assert store.stats().num_dedup_hits == 0


def test_positions_and_extras_separate_pages() -> None:
    store = make_store()
    prefill(store, P1)
    shifted = store.create_context()
    assert store.reserve_working_pages(shifted, 1)
    store.write_tokens(shifted, P1, [10, 11, 12, 13])
    store.commit_full_pages(shifted)
    masked = prefill(store, P1, extra=1)
    mixed = store.create_context()
    assert store.reserve_working_pages(mixed, 1)
    store.write_tokens(mixed, P1, [0, 1, 2, 3], [0, 0, 1, 0])
    store.commit_full_pages(mixed)
    assert [store.page_table(c) for c in (shifted, masked, mixed)] == [[1], [2], [3]]
    again = prefill(store, P1, extra=1)
    assert store.page_table(again) == [2]  # same extra does dedup
    store.check_invariants()


def test_lru_eviction_order_is_exact() -> None:
    store = make_store(num_pages=6, page_size=2)
    a = prefill(store, [1, 2, 3, 4])  # pages 0 <- 1
    b = prefill(store, [5, 6])  # page 2
    c = prefill(store, [7, 8])  # page 3
    store.release(b)
    store.release(a)
    store.release(c)
    # Only childless cached pages are evictable; page 0 waits behind its child 1.
    assert store.cached_page_ids() == [2, 1, 3]
    assert store.num_pages_available() == 6
    d = store.create_context()
    assert store.reserve_working_pages(d, 3)  # free 4, 5 + evict 2
    assert store.page_table(d) == [2, 4, 5]
    assert store.cached_page_ids() == [1, 3]
    assert store.reserve_working_pages(d, 1)  # evict 1; its parent 0 becomes next victim
    assert store.page_table(d)[-1] == 1
    assert store.cached_page_ids() == [0, 3]
    assert store.reserve_working_pages(d, 2)
    assert store.page_table(d) == [2, 4, 5, 1, 0, 3]
    assert store.stats().num_evictions == 4
    before = store.stats()
    assert store.reserve_working_pages(d, 1) is False
    assert store.stats() == before
    store.check_invariants()


def test_reserve_false_never_evicts() -> None:
    store = make_store(num_pages=4, page_size=2)
    a = prefill(store, [1, 2])
    store.release(a)  # page 0 cached
    b = store.create_context()
    assert store.reserve_working_pages(b, 1)
    assert store.reserve_working_pages(b, 4) is False  # 2 free + 1 cached < 4
    assert store.cached_page_ids() == [0]
    assert store.reserve_working_pages(b, 2)
    assert store.cached_page_ids() == [0]  # two free pages sufficed, nothing evicted


def test_prefix_hits_leave_the_lru_and_count() -> None:
    store = make_store(num_pages=8, page_size=2)
    a = prefill(store, [1, 2, 3, 4, 5, 6])  # 0 <- 1 <- 2
    other = prefill(store, [9, 9])  # 3
    store.release(a)
    store.release(other)
    assert store.cached_page_ids() == [2, 3]
    b = store.create_context()
    assert store.match_prefix(b, [1, 2, 3, 4, 7, 7], [0, 1, 2, 3, 4, 5]) == 2
    assert store.cached_page_ids() == [2, 3]  # match_prefix is read-only
    assert store.attach_prefix(b, [1, 2, 3, 4, 7], [0, 1, 2, 3, 4]) == 2
    assert store.page_table(b) == [0, 1]
    assert store.state(b).seq_len == 4 and store.next_position(b) == 4
    assert store.cached_page_ids() == [2, 3]  # page 1 is pinned again, 2 still cached
    assert store.stats().num_prefix_hits == 2
    c = store.create_context()
    assert store.attach_prefix(c, [1, 2, 3, 4, 5, 6], list(range(6))) == 3
    assert store.cached_page_ids() == [3]
    # Attaching continues a context's own chain.
    assert store.attach_prefix(b, [5, 6], [4, 5]) == 1
    assert store.page_table(b) == [0, 1, 2]
    # Wrong positions or extra miss.
    d = store.create_context()
    assert store.attach_prefix(d, [1, 2], [5, 6]) == 0
    assert store.attach_prefix(d, [1, 2], [0, 1], extra=3) == 0
    store.check_invariants()


def test_attach_allows_reserved_empty_pages() -> None:
    store = make_store(page_size=2)
    prefill(store, [1, 2])
    b = store.create_context()
    assert store.reserve_working_pages(b, 1)
    assert store.attach_prefix(b, [1, 2, 3], [0, 1, 2]) == 1
    assert store.page_table(b) == [0, 1]
    store.write_tokens(b, [3], [2])
    assert store.tokens(b) == [1, 2, 3]


def test_truncate_reaches_only_working_tokens() -> None:
    store = make_store()
    cid = store.create_context()
    fill(store, cid, P1 + [5, 6])
    store.commit_full_pages(cid)
    assert_unchanged(store, lambda: store.truncate_working_page_tokens(cid, 3), InvalidArgument)
    store.truncate_working_page_tokens(cid, 0)
    store.truncate_working_page_tokens(cid, 2)
    assert counters(store, cid) == (1, 1, 0, 4, 4)  # page count unchanged
    assert store.next_position(cid) == 4
    store.write_tokens(cid, [7], [4])
    assert store.tokens(cid) == P1 + [7]


def test_commit_working_pages_is_all_or_nothing() -> None:
    store = make_store()
    cid = store.create_context()
    fill(store, cid, P1 + [5, 6])  # page 0 full, page 1 partial
    assert_unchanged(store, lambda: store.commit_working_pages(cid, 2), InvalidArgument)
    assert_unchanged(store, lambda: store.commit_working_pages(cid, 3), InvalidArgument)
    store.commit_working_pages(cid, 0)
    store.commit_working_pages(cid, 1)
    assert counters(store, cid) == (1, 1, 2, 6, 4)
    assert store.commit_full_pages(cid) == 0


def test_commit_with_reserved_pages_ahead() -> None:
    store = make_store()
    cid = store.create_context()
    assert store.reserve_working_pages(cid, 3)
    store.write_tokens(cid, P1, [0, 1, 2, 3])
    store.commit_working_pages(cid, 1)
    assert store.page_table(cid) == [0, 1, 2]
    assert counters(store, cid) == (1, 2, 0, 4, 4)


def test_release_working_pages_from_the_tail_drops_their_tokens() -> None:
    store = make_store()
    cid = store.create_context()
    fill(store, cid, P1 + [5, 6])
    assert store.reserve_working_pages(cid, 1)
    assert_unchanged(store, lambda: store.release_working_pages(cid, 4), InvalidArgument)
    store.release_working_pages(cid, 1)  # the empty reserved page 2
    assert store.page_table(cid) == [0, 1]
    assert store.pool.free_ids()[0] == 2
    store.release_working_pages(cid, 1)  # page 1 holds tokens 5, 6: dropped
    assert counters(store, cid) == (0, 1, 4, 4, 4)
    assert store.tokens(cid) == P1
    store.check_invariants()


def test_fork_shares_committed_and_copies_working() -> None:
    store = make_store()
    a = store.create_context()
    fill(store, a, P1 + P2 + [9])
    store.commit_full_pages(a)
    b = store.fork(a)
    assert store.page_table(a) == [0, 1, 2]
    assert store.page_table(b) == [0, 1, 3]
    assert store.state(b) == store.state(a)
    assert store.tokens(b) == store.tokens(a)
    # Only the tip gained a reference.
    state_a = store._states.by_id[a]
    assert state_a.tip is not None and state_a.tip.holders == 2
    assert state_a.tip.parent is not None and state_a.tip.parent.holders == 0
    # Forks evolve independently.
    store.write_tokens(b, [10, 11, 12], [9, 10, 11])
    store.commit_full_pages(b)
    assert store.page_table(b) == [0, 1, 3]
    assert store.page_table(a) == [0, 1, 2]
    assert store.tokens(a) == P1 + P2 + [9]
    empty = store.fork(store.create_context())
    assert store.page_table(empty) == []
    store.check_invariants()


def test_fork_out_of_pages_changes_nothing() -> None:
    store = make_store(num_pages=3)
    a = store.create_context()
    assert store.reserve_working_pages(a, 2)
    assert_unchanged(store, lambda: store.fork(a), OutOfPages)
    assert_unchanged(store, lambda: store.save_snapshot(a, "s"), OutOfPages)


def test_release_frees_everything_and_closes_the_id() -> None:
    store = make_store()
    a = prefill(store, P1 + [5])
    store.release(a)
    assert store.stats().num_pages_free == 15 and store.cached_page_ids() == [0]
    calls = [
        lambda: store.fork(a),
        lambda: store.release(a),
        lambda: store.reserve_working_pages(a, 1),
        lambda: store.commit_working_pages(a, 0),
        lambda: store.release_working_pages(a, 0),
        lambda: store.truncate_working_page_tokens(a, 0),
        lambda: store.write_tokens(a, [], []),
        lambda: store.commit_full_pages(a),
        lambda: store.attach_prefix(a, [], []),
        lambda: store.page_table(a),
        lambda: store.state(a),
        lambda: store.tokens(a),
        lambda: store.working_tokens(a),
        lambda: store.next_position(a),
        lambda: store.save_snapshot(a, "x"),
        lambda: store.page_table(ContextId(999)),
    ]
    for call in calls:
        assert_unchanged(store, call, ContextClosed)


def test_snapshot_lifecycle() -> None:
    store = make_store()
    a = store.create_context()
    fill(store, a, P1 + [5, 6])
    store.commit_full_pages(a)
    store.save_snapshot(a, "s")
    assert store.list_snapshots() == ["s"]
    assert store.list_snapshots("other") == []
    assert_unchanged(store, lambda: store.save_snapshot(a, "s"), SnapshotExists)
    store.save_snapshot(a, "s", namespace="other")  # namespaces are separate
    store.release(a)  # snapshots outlive their context
    opened = store.open_snapshot("s")
    assert store.tokens(opened) == P1 + [5, 6]
    assert store.list_snapshots() == ["s"]
    pages_before = store.stats()
    taken = store.take_snapshot("s")  # O(1) move: no page changes hands with the pool
    after = store.stats()
    assert (after.num_pages_free, after.num_pages_working) == (
        pages_before.num_pages_free,
        pages_before.num_pages_working,
    )
    assert store.list_snapshots() == []
    assert store.tokens(taken) == P1 + [5, 6]
    assert counters(store, taken) == (1, 1, 2, 6, 4)
    for call in (
        lambda: store.open_snapshot("s"),
        lambda: store.take_snapshot("s"),
        lambda: store.delete_snapshot("s"),
    ):
        assert_unchanged(store, call, SnapshotNotFound)
    for call in (lambda: store.open_snapshot(""), lambda: store.save_snapshot(taken, 3)):  # type: ignore[arg-type]
        assert_unchanged(store, call, InvalidArgument)
    free_before = store.stats().num_pages_free
    store.delete_snapshot("s", namespace="other")
    assert store.stats().num_pages_free == free_before + 1  # its working copy came back
    store.check_invariants()


def test_snapshot_keeps_pages_alive_against_eviction() -> None:
    store = make_store(num_pages=3, page_size=2)
    a = prefill(store, [1, 2, 3, 4])
    store.save_snapshot(a, "keep")
    store.release(a)
    b = store.create_context()
    assert store.num_pages_available() == 1
    assert store.reserve_working_pages(b, 2) is False
    store.delete_snapshot("keep")
    assert store.reserve_working_pages(b, 3)


def test_write_tokens_validation() -> None:
    store = make_store()
    cid = store.create_context()
    assert store.reserve_working_pages(cid, 1)
    bad_calls = [
        lambda: store.write_tokens(cid, [1, 2], [0]),
        lambda: store.write_tokens(cid, [-1], [0]),
        lambda: store.write_tokens(cid, [1], [-1]),
        lambda: store.write_tokens(cid, [1.5], [0]),  # type: ignore[list-item]
        lambda: store.write_tokens(cid, [1], [0], extra=True),
        lambda: store.write_tokens(cid, [1], [0], extra=-1),
        lambda: store.write_tokens(cid, [1], [0], extra=[0, 0]),
        lambda: store.write_tokens(cid, [1] * 5, list(range(5))),  # more than reserved
        lambda: store.reserve_working_pages(cid, -1),
        lambda: store.reserve_working_pages(cid, True),  # type: ignore[arg-type]
        lambda: store.release_working_pages(cid, -1),
        lambda: store.truncate_working_page_tokens(cid, 1),
        lambda: store.commit_working_pages(cid, "1"),  # type: ignore[arg-type]
    ]
    for call in bad_calls:
        assert_unchanged(store, call, InvalidArgument)
    assert_unchanged(store, lambda: store.state([1]), InvalidArgument)  # type: ignore[arg-type]
    store.write_tokens(cid, [1], [0])
    assert_unchanged(store, lambda: store.attach_prefix(cid, P1, [0, 1, 2, 3]), InvalidArgument)
    assert_unchanged(store, lambda: store.match_prefix(cid, P1, [0, 1, 2, 3]), InvalidArgument)


def test_next_position_follows_explicit_positions() -> None:
    store = make_store()
    cid = store.create_context()
    assert store.reserve_working_pages(cid, 2)
    store.write_tokens(cid, P1, [100, 101, 102, 103])
    assert store.next_position(cid) == 104
    store.commit_full_pages(cid)
    assert store.next_position(cid) == 104


def test_fork_page_table_cache_is_copy_on_write() -> None:
    store = make_store(num_pages=32)
    a = prefill(store, list(range(16)))
    b = store.fork(a)
    assert store.page_table(b) == [0, 1, 2, 3]
    fill(store, a, [1, 1, 1, 1])
    store.commit_full_pages(a)
    assert store.page_table(a) == [0, 1, 2, 3, 4]
    assert store.page_table(b) == [0, 1, 2, 3]
    store.check_invariants()


def test_capacity_queries() -> None:
    store = make_store(num_pages=5)
    assert store.num_pages_total == 5 and store.num_pages_available() == 5
    a = prefill(store, P1 + [1])
    assert store.num_pages_available() == 3
    store.release(a)
    assert store.num_pages_available() == 5


def _collide(monkeypatch: pytest.MonkeyPatch) -> None:
    def constant(parent: object, tokens: object, positions: object, extra: int = 0) -> PageHash:
        return PageHash(42)

    monkeypatch.setattr("runtime.kv.trie.hash_page", constant)
    monkeypatch.setattr("runtime.kv.invariants.hash_page", constant)


def test_hash_collision_never_aliases(monkeypatch: pytest.MonkeyPatch) -> None:
    _collide(monkeypatch)
    store = make_store(page_size=2)
    a = prefill(store, [1, 2])
    b = prefill(store, [3, 4])  # same hash, different tokens: private page
    assert store.page_table(a) == [0] and store.page_table(b) == [1]
    assert store.tokens(b) == [3, 4]
    c = prefill(store, [1, 2])  # identical content still dedups against the registered one
    assert store.page_table(c) == [0]
    fill(store, b, [1, 2])  # a child of a private page is private too
    store.commit_full_pages(b)
    d = store.create_context()
    assert store.attach_prefix(d, [3, 4], [0, 1]) == 0  # private pages are never found
    store.check_invariants()
    store.release(b)  # private pages are freed at once, never cached
    assert store.cached_page_ids() == []
    assert store.pool.free_ids()[:2] == [1, 2]  # child page 2 was freed first
    store.release(a)
    store.release(c)
    assert store.cached_page_ids() == [0]
    store.check_invariants()


def test_store_rejects_bad_sizes() -> None:
    with pytest.raises(ValueError):
        PageStore(0, 4, 1, 1, 1)


def test_children_of_a_private_page_are_never_registered(monkeypatch: pytest.MonkeyPatch) -> None:
    from runtime.kv import hash_page as real

    def collide_root(parent: object, tokens: object, positions: object, extra: int = 0) -> PageHash:
        if parent is None and list(tokens) == [3, 4]:  # type: ignore[call-overload]
            tokens = [1, 2]  # page [3, 4] at the root collides with page [1, 2]
        return real(parent, tokens, positions, extra)  # type: ignore[arg-type]

    monkeypatch.setattr("runtime.kv.trie.hash_page", collide_root)
    monkeypatch.setattr("runtime.kv.invariants.hash_page", collide_root)
    store = make_store(page_size=2)
    prefill(store, [1, 2])  # page 0, registered
    b = prefill(store, [3, 4, 5, 6])  # page 1 private (collision), so its child 2 is private
    assert store.page_table(b) == [1, 2]
    store.check_invariants()
    c = prefill(store, [1, 2, 5, 6])  # the legit chain registers its own page 4
    assert store.page_table(c) == [0, 4]  # its first page deduped; 3 went back
    d = store.create_context()
    assert store.attach_prefix(d, [1, 2, 5, 6], [0, 1, 2, 3]) == 2
    assert store.page_table(d) == [0, 4]
    store.check_invariants()


def test_owner_pages_count_each_owners_distinct_pages() -> None:
    store = make_store(num_pages=16, page_size=4)
    a = store.create_context("alice")
    fill(store, a, list(range(10)))  # 2 full pages + 2 tokens in a working page
    store.commit_full_pages(a)
    assert store.owner_pages("alice") == 3 and store.owner_pages("bob") == 0
    a2 = store.fork(a)  # same owner: the committed pages count once, the tail copy twice
    assert store.owner_pages("alice") == 4
    b = store.create_context("bob")
    assert store.attach_prefix(b, list(range(8)), list(range(8))) == 2
    assert store.owner_pages("bob") == 2  # shared with alice, counted for bob too
    store.save_snapshot(a, "s")  # snapshots count against nobody
    assert store.owner_pages("alice") == 4
    store.release(a)
    store.release(a2)
    assert store.owner_pages("alice") == 0 and store.owner_pages("bob") == 2
    taken = store.take_snapshot("s", owner="alice")  # whoever takes it takes its pages on
    assert store.owner_pages("alice") == 3
    store.release(taken)
    store.release(b)
    assert store.owners() == []
    store.check_invariants()


def test_trie_listeners_hear_stores_and_evictions_in_order_with_the_bytes_there() -> None:
    from runtime.kv.trie import TrieListener

    heard: list[tuple[str, int, bool]] = []

    class Listener(TrieListener):
        def stored(self, node) -> None:
            heard.append(("stored", node.page_id, True))

        def evicting(self, node) -> None:  # the page's bytes are still the context's
            page = store.pool.kv[node.page_id]
            heard.append(("evicting", node.page_id, bool(page.abs().sum() > 0)))

        def removed(self, node) -> None:
            heard.append(("removed", node.page_id, node.page_id in store.pool.free_ids()))

    store = PageStore(4, 4, num_layers=2, num_kv_heads=1, head_dim=2, listeners=[Listener()])
    a = prefill(store, list(range(8)))  # 2 committed pages
    first = store.page_table(a)
    store.pool.kv[first] = 1.0  # as a forward pass would have written them
    assert heard == [("stored", first[0], True), ("stored", first[1], True)]
    store.release(a)  # cached, not evicted: nothing to hear
    assert len(heard) == 2
    heard.clear()
    b = prefill(store, [50 + i for i in range(12)])  # 3 pages: one cached page evicted
    assert heard[:2] == [("evicting", first[1], True), ("removed", first[1], True)]
    assert [h[0] for h in heard[2:]] == ["stored"] * 3
    store.release(b)
