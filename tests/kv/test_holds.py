"""Holds: held pages outlive their context in the cache and are evicted last, by priority;
expiry (on a fake clock), release, the per-owner bound, bad input, and the disk tier."""

from __future__ import annotations

from pathlib import Path

import pytest

from pie_ctx.errors import HoldLimit, HoldNotFound, InvalidArgument
from runtime.kv import PageStore
from tests.kv.disk_helpers import disk_store, kv_of, write
from tests.kv.helpers import assert_unchanged, prefill


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def held_store(num_pages: int = 8, max_held: int = 0) -> tuple[PageStore, Clock]:
    clock = Clock()
    store = PageStore(num_pages, 4, num_layers=2, num_kv_heads=1, head_dim=2,
                      max_held_pages_per_owner=max_held, clock=clock)
    return store, clock


def pages_of(store: PageStore, base: int, n: int) -> list[int]:
    """A released context's ``n`` pages of tokens ``base..``, committed then cached."""
    cid = prefill(store, list(range(base, base + 4 * n)))
    ids = store.page_table(cid)
    return ids, cid  # type: ignore[return-value]


def test_held_pages_are_evicted_after_unheld_ones() -> None:
    store, _ = held_store()
    (a, ca), (b, cb) = pages_of(store, 100, 2), pages_of(store, 200, 2)
    store.retain(ca, ttl=30, owner="agent")
    store.release(ca)  # released first: without the hold it would go first
    store.release(cb)
    # next victims: b's chain tip first (unheld), then a's (held)
    assert store.cached_page_ids() == [b[1], a[1]]
    assert store.stats().num_pages_held == 2
    big = store.create_context()
    assert store.reserve_working_pages(big, 6)  # 4 free + 2 evicted: exactly b's pages
    assert store.trie.num_evictions == 2
    assert store.match_prefix(store.create_context(), list(range(100, 108)),
                              list(range(8))) == 2
    assert store.match_prefix(store.create_context(), list(range(200, 208)),
                              list(range(8))) == 0
    store.check_invariants()


def test_lower_priority_goes_first_and_a_range_shrinks_tip_first() -> None:
    store, _ = held_store(num_pages=12, max_held=12)
    (low, cl), (high, ch), (plain, cp) = (pages_of(store, 100, 2), pages_of(store, 200, 2),
                                          pages_of(store, 300, 2))
    store.retain(ch, ttl=30, priority=5)
    store.retain(cl, ttl=30, priority=1)
    for cid in (cl, ch, cp):
        store.release(cid)
    assert store.stats().pages_held_by_priority == {5: 2, 1: 2}
    evicted = store.trie.evict(5)
    # unheld first, tip first; then the low hold's range, tip first; then the high one's tip
    assert evicted == [plain[1], plain[0], low[1], low[0], high[1]]
    assert store.stats().pages_held_by_priority == {5: 1}
    store.check_invariants()


def test_a_hold_on_a_prefix_covers_only_its_whole_pages() -> None:
    store, _ = held_store()
    ids, cid = pages_of(store, 100, 3)
    hold = store.retain(cid, ttl=10, num_tokens=9)  # 2 whole pages of 4
    assert hold.num_pages == 2 and hold.tip is not None and hold.tip.page_id == ids[1]
    store.release(cid)
    assert store.cached_page_ids() == [ids[2]]  # unheld, and the only childless page
    assert store.trie.evict(1) == [ids[2]]
    assert store.cached_page_ids() == [ids[1]]  # now held: last in line
    store.check_invariants()


def test_an_expired_hold_falls_back_to_the_lru() -> None:
    store, clock = held_store()
    (a, ca), (b, cb) = pages_of(store, 100, 2), pages_of(store, 200, 2)
    store.retain(ca, ttl=30, priority=9)
    store.release(ca)
    store.release(cb)
    clock.now += 29.9
    assert store.cached_page_ids() == [b[1], a[1]]
    clock.now += 0.2  # past the deadline: the next eviction sees the hold gone
    big = store.create_context()
    assert store.reserve_working_pages(big, 6)
    assert store.trie.num_evictions == 2
    assert len(store.holds) == 0 and store.stats().num_pages_held == 0
    # a's pages went to the LRU's front: they were the victims, b's survived
    assert store.match_prefix(store.create_context(), list(range(200, 208)),
                              list(range(8))) == 2
    store.check_invariants()


def test_release_hold_ends_it_now_and_only_for_its_owner() -> None:
    store, _ = held_store()
    (a, ca) = pages_of(store, 100, 2)
    hold = store.retain(ca, ttl=30, owner="x")
    store.release(ca)
    assert_unchanged(store, lambda: store.release_hold(hold.hold_id, owner="y"), HoldNotFound)
    store.release_hold(hold.hold_id, owner="x")
    assert store.stats().num_holds == 0 and store.cached_page_ids() == [a[1]]
    with pytest.raises(HoldNotFound):
        store.release_hold(hold.hold_id, owner="x")
    store.check_invariants()


def test_an_owner_cannot_hold_more_than_its_bound() -> None:
    store, clock = held_store(num_pages=16, max_held=3)
    (_, c1), (_, c2) = pages_of(store, 100, 2), pages_of(store, 200, 2)
    store.retain(c1, ttl=5, owner="x")
    assert_unchanged(store, lambda: store.retain(c2, ttl=5, owner="x"), HoldLimit)
    store.retain(c2, ttl=5, owner="y")  # another owner has its own bound
    store.retain(c2, ttl=5, owner="x", num_tokens=4)  # 1 more page fits exactly
    clock.now += 6  # expired holds no longer count
    store.retain(c2, ttl=5, owner="x")
    assert store.holds.pages_of == {"x": 2}
    store.check_invariants()


@pytest.mark.parametrize("kw", [
    {"ttl": -1}, {"ttl": 0}, {"ttl": float("inf")}, {"ttl": float("nan")}, {"ttl": "30"},
    {"ttl": True}, {"ttl": 1e9}, {"ttl": 5, "priority": -1}, {"ttl": 5, "priority": 101},
    {"ttl": 5, "priority": 1.5}, {"ttl": 5, "num_tokens": -4},
])
def test_bad_input_is_a_typed_error_that_changes_nothing(kw: dict) -> None:
    store, _ = held_store()
    _, cid = pages_of(store, 100, 2)
    assert_unchanged(store, lambda: store.retain(cid, **kw), InvalidArgument)


def test_holding_nothing_committed_is_an_empty_hold() -> None:
    store, _ = held_store()
    cid = store.create_context()
    hold = store.retain(cid, ttl=5)
    assert hold.num_pages == 0 and hold.tip is None
    store.check_invariants()


def test_held_pages_evicted_under_pressure_go_to_disk_first(tmp_path: Path) -> None:
    store = disk_store(tmp_path, num_pages=8, cache_pages=0)  # no disk cache for unheld
    held, plain = store.create_context(), store.create_context()
    write(store, held, list(range(100, 108)))
    write(store, plain, list(range(200, 208)))
    hold = store.retain(held, ttl=60)
    store.release(held)
    store.release(plain)
    big = store.create_context()
    assert store.reserve_working_pages(big, 8)  # every page goes, held ones last
    assert store.stats().num_pages_held == 0
    assert len(hold.on_disk) == 2 and store.tier.held.keys() == set(hold.on_disk)
    assert store.stats().num_disk_pages == 2  # the unheld pages were not written
    store.release(big)
    fresh = store.create_context()
    assert store.attach_prefix(fresh, list(range(100, 108)), list(range(8))) == 2
    ids = store.page_table(fresh)
    assert all(store.pool.kv[ids[i // 4], i % 4].equal(kv_of(100 + i, i)) for i in range(8))
    store.release(fresh)
    store.release_hold(hold.hold_id)  # the hold ends: over a 0-page budget, trimmed
    assert store.tier.held == {} and store.stats().num_disk_pages == 0
    store.check_invariants()
