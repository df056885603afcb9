"""Suspend and resume in the page store: a context's pages leave the pool (held, then on
disk under pressure; or copied to host memory without a tier) and come back bit for bit,
from memory or disk, without computing anything; no room or a lost page changes nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pie_ctx.errors import ContextClosed, OutOfPages, SnapshotCorrupt
from runtime.kv import PageStore
from tests.kv.disk_helpers import check_kv, disk_store, kv_of, write
from tests.kv.helpers import assert_unchanged, make_store


def written(store: PageStore, tokens: list[int], spare: int = 0) -> int:
    """A context with ``tokens`` written with their K/V (full pages committed), plus
    ``spare`` reserved empty working pages."""
    cid = store.create_context(owner="agent")
    write(store, cid, tokens)
    if spare:
        assert store.reserve_working_pages(cid, spare)
    return cid


def same_context(store: PageStore, cid: int, tokens: list[int], working_pages: int) -> None:
    assert store.tokens(cid) == tokens
    assert store.positions(cid) == list(range(len(tokens)))
    assert store.state(cid).num_working_pages == working_pages
    check_kv(store, cid)
    store.check_invariants()


def flood(store: PageStore, base: int, n_pages: int) -> int:
    """Another context taking ``n_pages`` pages (evicting cached ones)."""
    cid = store.create_context(owner="other")
    write(store, cid, list(range(base, base + 4 * n_pages)))
    return cid


def test_a_suspended_context_frees_its_pages_and_resumes_from_memory(tmp_path: Path) -> None:
    store = disk_store(tmp_path, num_pages=8)
    tokens = list(range(100, 110))  # 2 committed pages + 2 working tokens
    cid = written(store, tokens, spare=1)
    free = store.pool.num_free
    s = store.suspend(cid)
    assert s.num_pages == 4 and s.hold is not None and s.host_pages is None
    assert store.pool.num_free == free + 2  # the working pages; the chain stays cached
    assert store.num_pages_available() == 8
    assert store.stats().num_pages_held == 2
    with pytest.raises(ContextClosed):
        store.state(cid)  # the id died with the suspend
    new, from_memory, from_disk = store.resume(s)
    assert (from_memory, from_disk) == (3, 0)  # 2 chain pages + 1 working page with tokens
    same_context(store, new, tokens, working_pages=2)
    assert store.stats().num_holds == 0  # the suspend's hold ended with the resume


def test_pages_evicted_while_suspended_come_back_from_disk(tmp_path: Path) -> None:
    store = disk_store(tmp_path, num_pages=8, cache_pages=0)  # no disk cache budget at all
    tokens = list(range(100, 114))  # 3 committed pages + 2 working tokens
    cid = written(store, tokens)
    s = store.suspend(cid)
    other = flood(store, 500, 8)  # takes the whole pool: every held page goes to disk
    assert store.trie.num_evictions == 3
    store.release(other)
    written_before = store.tier.counters.pages_loaded
    new, from_memory, from_disk = store.resume(s)
    assert (from_memory, from_disk) == (1, 3)  # the working page from host memory
    assert store.tier.counters.pages_loaded == written_before + 3
    same_context(store, new, tokens, working_pages=1)
    assert store.tier.held == {}  # the suspend's pages are no longer kept outside the budget


def test_half_evicted_chain_resumes_from_memory_then_disk(tmp_path: Path) -> None:
    store = disk_store(tmp_path, num_pages=8)
    tokens = list(range(100, 116))  # 4 committed pages
    cid = written(store, tokens)
    s = store.suspend(cid)
    other = flood(store, 500, 6)  # 4 free + 2 evicted: the chain's last two pages
    store.release(other)
    new, from_memory, from_disk = store.resume(s)
    assert (from_memory, from_disk) == (2, 2)
    same_context(store, new, tokens, working_pages=0)


def test_without_a_tier_the_chain_is_copied_to_host_memory() -> None:
    store = make_store(num_pages=6)
    cid = store.create_context(owner="agent")
    write(store, cid, list(range(100, 110)))
    s = store.suspend(cid)
    assert s.hold is None and s.host_pages is not None and len(s.host_pages) == 2
    assert s.num_host_bytes == 3 * store.pool.page_bytes
    other = flood(store, 500, 6)  # every cached page evicted, and lost from the pool
    store.release(other)
    new, from_memory, from_disk = store.resume(s)
    assert (from_memory, from_disk) == (3, 0)
    same_context(store, new, list(range(100, 110)), working_pages=1)


def test_resume_without_room_changes_nothing_and_can_be_retried(tmp_path: Path) -> None:
    store = disk_store(tmp_path, num_pages=8)
    tokens = list(range(100, 114))
    s = store.suspend(written(store, tokens))
    other = flood(store, 500, 8)
    assert_unchanged(store, lambda: store.resume(s), OutOfPages)
    assert s.hold is not None  # still suspended
    store.release(other)
    new, _, from_disk = store.resume(s)
    assert from_disk == 3
    same_context(store, new, tokens, working_pages=1)


def test_a_lost_page_file_raises_and_keeps_it_suspended(tmp_path: Path) -> None:
    store = disk_store(tmp_path, num_pages=8)
    tokens = list(range(100, 112))
    s = store.suspend(written(store, tokens))
    store.release(flood(store, 500, 8))
    for path in (tmp_path / store.tier.files.fingerprint.key).rglob("*"):
        if path.is_file() and path.suffix == ".page":
            path.write_bytes(b"damaged")
    with pytest.raises(SnapshotCorrupt):
        store.resume(s)
    store.check_invariants()
    store.drop_suspended(s)  # released by its owner: the hold ends
    assert store.stats().num_holds == 0
    store.check_invariants()


def test_the_room_maker_is_asked_before_an_allocation_fails() -> None:
    store = make_store(num_pages=4)
    idle = store.create_context(owner="agent")
    write(store, idle, list(range(100, 114)))  # 3 committed + 1 working page: the pool
    suspended = []

    def make_room(n: int) -> bool:
        if not suspended:
            suspended.append(store.suspend(idle))
        return store.num_pages_available() >= n

    store.set_room_maker(make_room)
    busy = store.create_context(owner="other")
    assert store.reserve_working_pages(busy, 4)
    assert len(suspended) == 1
    store.release(busy)
    new, _, _ = store.resume(suspended[0])
    same_context(store, new, list(range(100, 114)), working_pages=1)
    assert torch.equal(store.pool.kv[store.page_table(new)[0], 0], kv_of(100, 0))
