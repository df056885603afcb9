"""The paged attention kernel's shapes and paths (cpu_ops.cpp ``paged_attention``): query
heads per KV head of 1, 3, 4 and 8 (each K/V load serves up to 4 of them), head dims 16 to
128, key counts that end mid-block, prefill rows, fp32 / bf16 / int8 pools, units of one or
every KV head; against SDPA, and a row's bits against the same row in other company. The
next layer's prefetch (``prefetch_paged_kv``) is a hint that changes nothing."""

from __future__ import annotations

import pytest
import torch
from attention_oracle import paged_tables, sdpa_over_pages

from runtime.kv.layout import decode, encode

S, L = 16, 2


def _pool(pages: int, kvh: int, d: int, kv: str) -> torch.Tensor:
    torch.manual_seed(pages + kvh + d)
    x = torch.randn(pages, S, L, 2, kvh, d)
    if kv == "bf16":
        return x.to(torch.bfloat16)
    if kv == "int8":
        return encode(x, torch.empty(0, dtype=torch.int8))
    return x


def _tables(case, shared_pages=0, pages=200, seed=0):
    return paged_tables(case, S, pages, shared_pages=shared_pages, seed=seed)


def _run(ops, pool, q, case, padded, starts):
    d = q.shape[-1]
    return ops.paged_attention(q, pool, 1, padded, torch.tensor(starts, dtype=torch.int32),
                               torch.tensor([nc for nc, _ in case], dtype=torch.int32), d ** -0.5)


def _reference(pool, q, tables, starts, case):
    """SDPA over each sequence's gathered (decoded) pages, causal, GQA by repetition."""
    if pool.dtype == torch.int8:
        pool = decode(pool, torch.float32)
    return sdpa_over_pages(pool.float(), q, 1, tables, starts, [nc for nc, _ in case])


# (num_cached, new rows) per sequence: single decodes that end mid-block, a split boundary
# crossed, a prefill chunk, drafts
CASE = [(0, 1), (20, 1), (256, 1), (300, 7), (0, 19), (511, 2), (37, 5)]


@pytest.mark.parametrize("kv", ["fp32", "bf16", "int8"])
@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("d", [16, 64, 128])
def test_every_group_and_head_dim_matches_sdpa(ops, kv, group, d):
    kvh = 2
    pool = _pool(200, kvh, d, kv)
    tables, padded, starts = _tables(CASE)
    torch.manual_seed(d * group)
    q = torch.randn(starts[-1], group * kvh + 2 * kvh, d)[:, : group * kvh]  # strided view
    out = _run(ops, pool, q, CASE, padded, starts)
    ref = _reference(pool, q, tables, starts, CASE)
    assert (out - ref).abs().max().item() < 5e-6
    if kv == "bf16":  # widened as read, every sum in fp32: the fp32 kernel's bits
        assert torch.equal(out, _run(ops, pool.float(), q, CASE, padded, starts))


@pytest.mark.parametrize("kv", ["fp32", "bf16", "int8"])
@pytest.mark.parametrize("group", [3, 8])
def test_a_row_keeps_its_bits_alone_in_a_batch_among_forks_and_on_any_threads(ops, kv, group):
    """Forks sharing 40 pages (their full splits read once for all), each alone, on 1 to 3
    threads, and a decode row against the same row inside a prefill chunk."""
    kvh, d = 3, 64
    pool = _pool(300, kvh, d, kv)
    case = [(700, 1), (650, 1), (641, 1), (660, 3), (800, 1), (690, 1), (700, 1), (655, 1),
            (699, 1)]
    tables, padded, starts = _tables(case, shared_pages=40, pages=300)
    torch.manual_seed(group)
    q = torch.randn(starts[-1], group * kvh, d)
    threads = torch.get_num_threads()
    try:
        runs = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            runs.append(_run(ops, pool, q, case, padded, starts))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(runs[0], r) for r in runs[1:])
    together = runs[0]
    for i, one in enumerate(case):
        rows = slice(starts[i], starts[i + 1])
        alone = _run(ops, pool, q[rows], [one], torch.tensor([tables[i]], dtype=torch.int32),
                     [0, one[1]])
        assert torch.equal(together[rows], alone)
    # sequence 3's last row as a decode: the same bits as inside its 3-row chunk
    nc, n = case[3]
    last = slice(starts[3] + n - 1, starts[3] + n)
    decode_row = _run(ops, pool, q[last], [(nc + n - 1, 1)],
                      torch.tensor([tables[3]], dtype=torch.int32), [0, 1])
    assert torch.equal(together[last], decode_row)
    ref = _reference(pool, q, tables, starts, case)
    assert (together - ref).abs().max().item() < 5e-6


@pytest.mark.parametrize("kv", ["fp32", "bf16", "int8"])
def test_prefetching_a_layer_changes_nothing(ops, kv):
    """``prefetch_paged_kv`` only asks for cache lines: the pool and the attention after it
    are the same, on a token-major pool and a layer-major (strided) one."""
    kvh, d = 3, 64
    pool = _pool(200, kvh, d, kv)
    strided = pool.permute(0, 2, 3, 1, 4, 5).contiguous().permute(0, 3, 1, 2, 4, 5)
    tables, padded, starts = _tables(CASE)
    q = torch.randn(starts[-1], 3 * kvh, d)
    for p in (pool, strided):
        before = p.clone()
        out = _run(ops, p, q, CASE, padded, starts)
        ops.prefetch_paged_kv(p, 1, padded, torch.tensor(starts, dtype=torch.int32),
                              torch.tensor([nc for nc, _ in CASE], dtype=torch.int32))
        assert torch.equal(p, before)
        assert torch.equal(_run(ops, p, q, CASE, padded, starts), out)


@pytest.mark.parametrize("kv", ["fp32", "bf16", "int8"])
def test_prefill_rows_keep_their_bits_through_the_transposed_scoring_and_row_waves(ops, kv):
    """Prefill chunks of many query heads are scored from K transposed per block and, once
    their splits' partials pass 4M floats, run in waves of rows: every row has the bits it
    gets decoded alone. Two long chunks over 40 splits (one cut between waves, mid-block
    ends), a short chunk and decodes around them."""
    kvh, group, d = 2, 4, 64  # 8 heads x 64: 512 floats a row and split, 20K a row
    pages = 1800
    pool = _pool(pages, kvh, d, kv)
    case = [(9990, 230), (3, 1), (10000, 200), (500, 20), (7000, 1)]
    tables, padded, starts = _tables(case, pages=pages, seed=3)
    torch.manual_seed(7)
    q = torch.randn(starts[-1], group * kvh, d)
    together = _run(ops, pool, q, case, padded, starts)
    for i, (nc, n) in enumerate(case):
        for j in sorted({0, 1, n // 2, n - 2, n - 1} & set(range(n))):
            row = starts[i] + j
            alone = _run(ops, pool, q[row: row + 1], [(nc + j, 1)],
                         torch.tensor([tables[i]], dtype=torch.int32), [0, 1])
            assert torch.equal(together[row: row + 1], alone), (i, j)
    ref = _reference(pool, q, tables, starts, case)
    assert (together - ref).abs().max().item() < 5e-6
