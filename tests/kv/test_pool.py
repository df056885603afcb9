"""PagePool: tensor layout, deterministic allocation order, back-pressure, double free."""

from __future__ import annotations

import pytest
import torch

from runtime.kv import PagePool


def test_layout_and_dtype() -> None:
    pool = PagePool(5, 4, num_layers=3, num_kv_heads=2, head_dim=8, dtype=torch.float16)
    assert pool.kv.shape == (5, 4, 3, 2, 2, 8)  # [pages, page_size, layers, K/V, heads, dim]
    assert pool.kv.dtype == torch.float16
    assert pool.num_free == 5


def test_allocation_order_is_deterministic() -> None:
    pool = PagePool(6, 2, 1, 1, 1)
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(1) == [2]
    pool.free([1, 0])
    assert pool.free_ids() == [1, 0, 3, 4, 5]
    assert pool.allocate(3) == [1, 0, 3]
    assert pool.allocate(0) == []


def test_back_pressure_returns_none_and_changes_nothing() -> None:
    pool = PagePool(3, 2, 1, 1, 1)
    assert pool.allocate(2) == [0, 1]
    assert not pool.can_allocate(2)
    assert pool.allocate(2) is None
    assert pool.free_ids() == [2]


def test_double_free_is_an_invariant_error() -> None:
    pool = PagePool(2, 2, 1, 1, 1)
    ids = pool.allocate(1)
    assert ids is not None
    pool.free(ids)
    with pytest.raises(RuntimeError):
        pool.free([0, 1])


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_bad_sizes(bad: object) -> None:
    with pytest.raises(ValueError):
        PagePool(bad, 2, 1, 1, 1)  # type: ignore[arg-type]
