"""One layer of paged attention against fp32 dense attention, for every backend.

``scenario`` builds a batch that covers every path a backend has (a fresh prefill, a
chunk over a cached prefix that crosses pages, decodes of unequal lengths, forks sharing
leading pages, a custom-masked pass), over a pool of random half-precision K/V on
shuffled pages. ``dense`` is textbook attention in fp32 over the very same half inputs
read back from the pool (after the backend wrote the new tokens), so the only difference
allowed is the backend's own rounding. Inputs are scaled so that softmax is peaked: one
key more or less moves a row's output by far more than the tolerance (``dense(...,
drop_newest=True)`` is that wrong answer, and the tests assert it is told apart).

``paged_tables`` and ``sdpa_over_pages`` are the CPU paged kernel's batch and its SDPA
answer, shared by tests/model/test_kernels.py and tests/model/test_paged_kernel.py.
"""

from __future__ import annotations

import random

import torch
import torch.nn.functional as F

from runtime.model.attention.base import AttentionMetadata

SCORE_SCALE = 2.0  # q and k ~ N(0, 2^2): scores of std ~4, a peaked softmax


def scenario(page_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
             dtype: torch.dtype, device: str = "cpu", seed: int = 0,
             ) -> tuple[torch.Tensor, AttentionMetadata, torch.Tensor, torch.Tensor]:
    """``(pool, meta, q, kv)`` of one layer (layer 1 of a 2-layer pool)."""
    g = torch.Generator().manual_seed(seed)
    s = page_size
    shared = 300  # the forks' common prefix: 18 full pages of 16, 1 of 256
    # (num_cached, new tokens, mask?) per sequence; forks last.
    seqs = [(0, 40, False), (300, 20, False), (16, 1, False), (599, 1, False), (256, 1, False),
            (41, 6, True)]
    forks = [(shared + k, 1, False) for k in (3, 40, 1)]
    spans = [-(-(c + n) // s) for c, n, _ in seqs + forks]
    full_shared = shared // s
    num_pages = sum(spans) + 8
    order = torch.randperm(num_pages, generator=g).tolist()
    tables, at = [], 0
    for k in spans[:len(seqs)]:
        tables.append(order[at:at + k])
        at += k
    head = order[at:at + full_shared]
    at += full_shared
    for k in spans[len(seqs):]:
        tables.append(head + order[at:at + k - full_shared])
        at += k - full_shared
    all_seqs = seqs + forks
    pool = (torch.randn(num_pages, s, 2, 2, num_kv_heads, head_dim, generator=g)
            * SCORE_SCALE).to(dtype)
    pool[:, :, :, 1] /= SCORE_SCALE  # values ~ N(0, 1)
    masks: list[torch.Tensor | None] = []
    wp, ws = [], []
    for (c, n, masked), table in zip(all_seqs, tables, strict=True):
        for j in range(c, c + n):
            wp.append(table[j // s])
            ws.append(j % s)
        if masked:  # each new token sees every other cached entry and itself
            m = torch.zeros(n, c + n, dtype=torch.bool)
            m[:, :c:2] = True
            m[:, c:] = torch.eye(n, dtype=torch.bool)
            masks.append(m.to(device))
        else:
            masks.append(None)
    t = len(wp)
    meta = AttentionMetadata(
        s, [n for _, n, _ in all_seqs], [c for c, _, _ in all_seqs],
        [c + n for c, n, _ in all_seqs], tables,
        torch.zeros(t, dtype=torch.int64, device=device),
        torch.tensor(wp, device=device), torch.tensor(ws, device=device), masks)
    q = (torch.randn(t, num_heads, head_dim, generator=g) * SCORE_SCALE).to(dtype)
    kv = torch.randn(t, 2, num_kv_heads, head_dim, generator=g).to(dtype)
    kv[:, 0] *= SCORE_SCALE
    return pool.to(device), meta, q.to(device), kv.to(device)


def dense(pool: torch.Tensor, layer: int, q: torch.Tensor, meta: AttentionMetadata, *,
          drop_newest: bool = False) -> torch.Tensor:
    """Textbook attention in fp32 over the pool's entries: ``[T, H * D]``.

    ``drop_newest``: each query misses the newest entry it should see (a wrong answer of
    the size a page-table or causality bug makes)."""
    out, row = [], 0
    h, d = q.shape[1:]
    kvh = pool.shape[4]
    for i, table in enumerate(meta.page_tables):
        c, n, length = meta.num_cached[i], meta.query_lens[i], meta.kv_lens[i]
        pages = torch.tensor(table, device=pool.device)
        k = pool[pages, :, layer, 0].reshape(-1, kvh, d)[:length].float()
        v = pool[pages, :, layer, 1].reshape(-1, kvh, d)[:length].float()
        k, v = k.repeat_interleave(h // kvh, 1), v.repeat_interleave(h // kvh, 1)
        scores = torch.einsum("qhd,khd->hqk", q[row:row + n].float(), k) / d ** 0.5
        cols = torch.arange(length, device=pool.device)
        limit = c + torch.arange(n, device=pool.device)
        see = meta.masks[i] if meta.masks[i] is not None else cols[None] <= limit[:, None]
        if drop_newest:
            newest = torch.where(see, cols[None], -1).amax(-1)  # [n]
            alone = see.sum(-1, keepdim=True) == 1  # a row with one key keeps it
            see = see & ((cols[None] != newest[:, None]) | alone)
        scores = scores.masked_fill(~see, float("-inf"))
        out.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, h * d))
        row += n
    return torch.cat(out)


def paged_tables(case: list[tuple[int, int]], page_size: int, pages: int, *,
                 shared_pages: int = 0, seed: int = 0,
                 ) -> tuple[list[list[int]], torch.Tensor, list[int]]:
    """Page tables for a batch of ``(num_cached, new tokens)`` sequences on ``pages``
    shuffled pages, the first ``shared_pages`` of every table the same (forks of one
    prompt): ``(tables, padded int32 [N, width], starts)``, starts as the paged kernel's
    ``seq_start``."""
    rng = random.Random(seed)
    perm = list(range(pages))
    rng.shuffle(perm)
    common, used, tables = perm[:shared_pages], shared_pages, []
    for nc, n in case:
        need = -(-(nc + n) // page_size) - shared_pages
        tables.append(common + perm[used:used + need])
        used += need
    width = max(map(len, tables))
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    starts = [0]
    for _, n in case:
        starts.append(starts[-1] + n)
    return tables, padded, starts


def sdpa_over_pages(pool: torch.Tensor, q: torch.Tensor, layer: int,
                    tables: list[list[int]], starts: list[int],
                    cached: list[int]) -> torch.Tensor:
    """SDPA over each sequence's gathered pages of an unquantized pool ``[P, S, L, 2, KVH,
    D]``, causal, GQA by repeating KV heads: the paged kernel's answer ``[T, H * D]``."""
    s, kvh, d, h = pool.shape[1], pool.shape[4], q.shape[-1], q.shape[1]
    outs = []
    for i, nc in enumerate(cached):
        rows = starts[i + 1] - starts[i]
        kv = nc + rows
        pages = tables[i][: -(-kv // s)]
        k = pool[pages, :, layer, 0].reshape(-1, kvh, d)[:kv].repeat_interleave(h // kvh, 1)
        v = pool[pages, :, layer, 1].reshape(-1, kvh, d)[:kv].repeat_interleave(h // kvh, 1)
        mask = torch.arange(kv)[None, :] <= (nc + torch.arange(rows))[:, None]
        o = F.scaled_dot_product_attention(q[starts[i]:starts[i + 1]].transpose(0, 1),
                                           k.transpose(0, 1), v.transpose(0, 1),
                                           attn_mask=mask)
        outs.append(o.transpose(0, 1).reshape(rows, h * d))
    return torch.cat(outs)
