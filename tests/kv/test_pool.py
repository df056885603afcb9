"""PagePool: tensor layout, deterministic allocation order, back-pressure, double free."""

from __future__ import annotations

import pytest
import torch

from runtime.kv import PagePool, PoolShape


def test_layout_and_dtype() -> None:
    pool = PagePool(PoolShape(5, 4, num_layers=3, num_kv_heads=2, head_dim=8, dtype=torch.float16))
    assert pool.kv.shape == (5, 4, 3, 2, 2, 8)  # [pages, page_size, layers, K/V, heads, dim]
    assert pool.kv.dtype == torch.float16
    assert pool.num_free == 5


def test_allocation_order_is_deterministic() -> None:
    pool = PagePool(PoolShape(6, 2, 1, 1, 1))
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(1) == [2]
    pool.free([1, 0])
    assert pool.free_ids() == [1, 0, 3, 4, 5]
    assert pool.allocate(3) == [1, 0, 3]
    assert pool.allocate(0) == []


def test_back_pressure_returns_none_and_changes_nothing() -> None:
    pool = PagePool(PoolShape(3, 2, 1, 1, 1))
    assert pool.allocate(2) == [0, 1]
    assert not pool.can_allocate(2)
    assert pool.allocate(2) is None
    assert pool.free_ids() == [2]


def test_double_free_is_an_invariant_error() -> None:
    pool = PagePool(PoolShape(2, 2, 1, 1, 1))
    ids = pool.allocate(1)
    assert ids is not None
    pool.free(ids)
    with pytest.raises(RuntimeError):
        pool.free([0, 1])


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_bad_sizes(bad: object) -> None:
    with pytest.raises(ValueError):
        PagePool(PoolShape(bad, 2, 1, 1, 1))  # type: ignore[arg-type]


def test_int8_layout_keeps_each_entry_with_its_scale() -> None:
    from runtime.kv.layout import decode, encode

    pool = PagePool(PoolShape(4, 2, num_layers=2, num_kv_heads=3, head_dim=8, kv_dtype="int8"))
    assert pool.kv.shape == (4, 2, 2, 2, 3, 12) and pool.kv.dtype == torch.int8
    assert pool.dtype == torch.float32 and pool.kv_dtype == "int8"
    g = torch.Generator().manual_seed(0)
    kv = torch.randn(2, 2, 3, 8, generator=g) * torch.tensor([1e-3, 1.0, 50.0])[:, None]
    pool.kv[1, :, 0] = encode(kv, pool.kv)  # one page, layer 0
    back = decode(pool.kv[1, :, 0], torch.float32)  # [2, 2, 3, 8]
    step = kv.abs().amax(-1, keepdim=True) / 127  # per token and head: tiny heads stay exact
    assert ((back - kv).abs() <= step / 2 + 1e-9).all()
    pool.copy_pages([3], [1])  # a page is one block: the scales travel with it
    assert torch.equal(decode(pool.kv[3, :, 0], torch.float32), back)
    assert decode(pool.kv[1, :, 0], torch.bfloat16).dtype == torch.bfloat16


def test_unknown_kv_dtype_is_refused() -> None:
    with pytest.raises(ValueError, match="kv_dtype must be one of fp32, int8"):
        PagePool(PoolShape(2, 2, 1, 1, 1, kv_dtype="fp8"))
