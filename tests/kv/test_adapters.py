"""Pages and LoRA adapters: the adapter's key is part of every page's identity."""

from __future__ import annotations

import pytest

from runtime.kv.hashing import adapter_extras
from tests.kv.helpers import fill, make_store

A, B = 0xA11CE, 0xB0B
TOKENS = list(range(1, 13))  # three full pages of 4


def _prefill(store, adapter: int):
    cid = store.create_context(adapter=adapter)
    fill(store, cid, TOKENS)
    store.commit_full_pages(cid)
    return cid


def test_same_adapter_shares_pages_others_never() -> None:
    store = make_store(num_pages=32)
    a1, a2 = _prefill(store, A), _prefill(store, A)
    b, base = _prefill(store, B), _prefill(store, 0)
    assert store.page_table(a1) == store.page_table(a2)
    tables = [set(store.page_table(c)) for c in (a1, b, base)]
    assert not tables[0] & tables[1] and not tables[0] & tables[2] and not tables[1] & tables[2]
    store.check_invariants()


def test_prefix_attach_respects_the_adapter() -> None:
    store = make_store(num_pages=32)
    _prefill(store, A)
    for adapter, hits in ((A, 3), (B, 0), (0, 0)):
        cid = store.create_context(adapter=adapter)
        assert store.match_prefix(cid, TOKENS, list(range(12))) == hits
        assert store.attach_prefix(cid, TOKENS, list(range(12))) == hits
        store.check_invariants()


def test_forks_and_snapshots_keep_the_adapter() -> None:
    store = make_store(num_pages=32)
    cid = _prefill(store, A)
    child = store.fork(cid)
    assert store.adapter_of(child) == A
    store.save_snapshot(cid, "s")
    assert store.snapshot("s").adapter == A
    opened = store.open_snapshot("s")
    assert store.adapter_of(opened) == A
    fill(store, opened, [99] * 4)
    store.commit_full_pages(opened)
    store.check_invariants()


def test_invariant_checker_catches_a_page_shared_across_adapters() -> None:
    store = make_store(num_pages=32)
    a = _prefill(store, A)
    b = store.fork(a)
    store._states.get(b).adapter = B  # a bug that would let adapter B read A's pages
    with pytest.raises(RuntimeError, match="shared by adapters"):
        store.check_invariants()


def test_adapter_extras_pinned() -> None:
    assert adapter_extras([0, 5], 0) == [0, 5]
    folded = adapter_extras([0, 0, 5], A)
    assert folded[0] == folded[1] != folded[2] and 0 not in folded
    assert adapter_extras([0], B) != adapter_extras([0], A)
