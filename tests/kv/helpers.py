"""Shared helpers of the kv tests: small stores, filling contexts, unchanged-state checks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from runtime.kv import ContextId, PageStore
from runtime.kv.invariants import describe_state


def make_store(num_pages: int = 16, page_size: int = 4) -> PageStore:
    """A tiny CPU store (2 layers, 1 KV head, head_dim 2)."""
    return PageStore(num_pages, page_size, num_layers=2, num_kv_heads=1, head_dim=2)


def reserve_for(store: PageStore, cid: ContextId, n: int) -> bool:
    """Reserve working pages so ``n`` more tokens fit; False (nothing changed) when the
    pool cannot give them."""
    counters = store.state(cid)
    need = n - (counters.num_working_pages * store.page_size - counters.num_working_tokens)
    return need <= 0 or store.reserve_working_pages(cid, -(-need // store.page_size))


def fill(store: PageStore, cid: ContextId, tokens: list[int], extra: int = 0) -> None:
    """Reserve room for ``tokens``, write them at the next positions, keep them working."""
    assert reserve_for(store, cid, len(tokens))
    start = store.next_position(cid)
    store.write_tokens(cid, tokens, list(range(start, start + len(tokens))), extra)


def prefill(store: PageStore, tokens: list[int], extra: int = 0) -> ContextId:
    """A new context holding ``tokens`` with every full page committed."""
    cid = store.create_context()
    fill(store, cid, tokens, extra)
    store.commit_full_pages(cid)
    return cid


def assert_unchanged(store: PageStore, call: Callable[[], Any], error: type[BaseException]) -> None:
    """``call`` raises ``error`` and leaves every page, count and KV byte as it was."""
    before = describe_state(store)
    kv = store.pool.kv.clone()
    with pytest.raises(error):
        call()
    assert describe_state(store) == before
    assert torch.equal(store.pool.kv, kv)
    store.check_invariants()
