"""FlexAttention backend: torch-only paged attention, one code path on CPU and CUDA.

Owner: the model runner; chosen by ``select_backend`` (``PIE_CTX_ATTENTION=flex``, or by
measurement, see docs/forward.md). Every call is ``torch.nn.attention.flex_attention``,
compiled once per process (inductor's C++ template on CPU, its Triton kernels on CUDA),
over the page pool read in place: no gather, no copy of a context.

The pattern is torch's own paged-attention example: one layer's keys are the whole pool
seen as one long sequence, ``pool[:, :, layer, 0]`` as ``[1, KVH, pages * page_size, D]``
(a strided view: a page's entries are ``L * 2 * KVH * D`` apart), shared by every batch
row. A block mask with one KV block per page lists, for each row and each block of
``Q_BLOCK`` queries, the physical pages it reads in KV order: pages every query of the
block sees entirely are *full* blocks (no mask evaluated), the others *partial* ones,
where the ``mask_mod`` maps the physical index back to the row's KV index through an
inverse page table (``[B, pages]``, -1 where the page is not the row's) and applies
causality (new token j sees KV indices ``<= num_cached + j``) or the custom mask of
``forward()``. Per forward the plan costs ``O(B * pages)`` int32 (the inverse table and
the block indices: flex's C++ template wants the index width to cover the whole pool):
64 rows over 100,000 pages is ~50 MB, built once and read by every layer.

Grouping is the torch backend's: all plain decodes in one call; each prefill chunk or
custom-masked pass in its own call (so no query padding at all). Forks decoding together
form a cascade where flex returns the log-sum-exp (CUDA): the shared pages attended once
by all the cluster's queries, each tail alone, merged in fp32 (``cascade.merge_lse``).
Inductor's CPU template returns no log-sum-exp (torch 2.13), so on CPU forks decode in
the decode group, each reading the shared pages in place through its own block row. An
int8 pool is attended by the torch backend (flex reads only unquantized pages).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from runtime.kv.layout import is_quantized
from runtime.model.attention.base import AttentionMetadata, write_kv
from runtime.model.attention.cascade import merge_lse, shared_prefix_clusters
from runtime.model.attention.torch_backend import TorchAttention

__all__ = ["FlexAttention", "StaticDecodes", "flex_kernel", "Q_BLOCK"]

log = logging.getLogger(__name__)
Q_BLOCK = 128  # queries per block-mask row (flex's default sparse block)
_RECOMPILES = 128  # compiled variants kept: mask kind x dtype x head shape x (Q == 1)
_compiled: dict[bool, Callable[..., Any]] = {}


def flex_kernel(compiled: bool = True) -> Callable[..., Any]:
    """``flex_attention``, compiled once per process with dynamic shapes (batch, queries
    and pool length are symbols, so a new batch or pool size reuses the kernel).

    ``compiled=False`` is flex's eager reference, which materialises every score over the
    whole pool: only for tests on tiny pools (it returns the log-sum-exp on CPU too)."""
    from torch.nn.attention.flex_attention import flex_attention

    if not compiled:
        return flex_attention
    fn = _compiled.get(True)
    if fn is None:
        fn = _compiled[True] = torch.compile(flex_attention, dynamic=True,
                                             recompile_limit=_RECOMPILES)
    return fn


def _causal_mod(rows: torch.Tensor, page_size: int) -> Callable[..., torch.Tensor]:
    """Row b's query q sees its own KV indices ``< kv_len[b]`` and ``<= hi[b] + step[b] * q``
    (step 1: causal from ``hi = num_cached``; step 0: every entry). ``rows`` is
    ``[B, 3 + pages]``: kv_len, hi and step, then the inverse page table (one tensor: with
    several ``[B]`` tensors, inductor's C++ template mixes up their symbolic sizes)."""

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor,
                 kv: torch.Tensor) -> torch.Tensor:
        lp = rows[b, kv // page_size + 3]
        pos = lp * page_size + kv % page_size
        return (lp >= 0) & (pos < rows[b, 0]) & (pos - q * rows[b, 2] <= rows[b, 1])

    return mask_mod


def _custom_mod(rows: torch.Tensor, allowed: torch.Tensor,
                page_size: int) -> Callable[..., torch.Tensor]:
    """The one row's query q sees KV index p where ``allowed[q, p]`` (forward()'s mask);
    ``rows`` as for :func:`_causal_mod`."""

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor,
                 kv: torch.Tensor) -> torch.Tensor:
        lp = rows[b, kv // page_size + 3]
        pos = lp * page_size + kv % page_size
        ok = (lp >= 0) & (pos < rows[b, 0])
        return ok & allowed[q, torch.where(ok, pos, 0)]

    return mask_mod


def _bucketed(mask: torch.Tensor) -> torch.Tensor:
    """``mask`` [Q, L] padded with False to power-of-two sizes (at least 64) and marked
    static: inductor's C++ template cannot index a captured tensor of symbolic size (its
    bounds checks name undeclared symbols, torch 2.13), and buckets keep recompiles few."""
    q, n = mask.shape
    out = mask.new_zeros(max(64, 1 << (q - 1).bit_length()), max(64, 1 << (n - 1).bit_length()))
    out[:q, :n] = mask
    torch._dynamo.mark_static(out)
    return out


def _bucketed_rows(info: torch.Tensor) -> torch.Tensor:
    """``info`` [1, 3 + pages] padded with -1 (no page) to a power of two and marked
    static, for the same reason as :func:`_bucketed`: one compile per bucket of pool sizes."""
    n = info.shape[1]
    out = info.new_full((1, 1 << (n - 1).bit_length()), -1)
    out[:, :n] = info
    torch._dynamo.mark_static(out)
    return out


@dataclass(slots=True)
class _Call:
    """One flex call: ``batch`` rows of ``q_len`` queries, and its block mask."""

    rows: slice | torch.Tensor  # their token rows in the flat [T] batch
    batch: int
    q_len: int
    block_mask: Any


@dataclass(slots=True)
class _Cascade:
    """Decodes sharing leading pages: the shared pages once for all, then each tail."""

    rows: torch.Tensor  # [n] token rows
    shared: _Call  # one row whose n queries are the cluster's
    tails: _Call  # n rows of one query


@dataclass(slots=True)
class _Plan:
    calls: list[_Call | _Cascade]
    torch_state: Any = None  # the torch backend's groups when it attends the whole forward


def _blocks(tables: list[list[int]], kv_lens: list[int], cached: list[int | None],
            q_len: int, custom: bool, s: int, num_pages: int,
            device: torch.device | str = "cpu") -> tuple[torch.Tensor, ...]:
    """The block-mask tensors of one call, all int32, built on ``device``.

    Row b reads ``tables[b]`` up to ``kv_lens[b]`` entries; its query j sees entries
    ``<= cached[b] + j`` (None: all of them), or, with ``custom``, what a mask_mod says
    (every page is then partial). Returns ``(partial counts [B, 1, R], partial pages
    [B, 1, R, P], full counts, full pages, info [B, 3 + P])`` with R query blocks of
    :data:`Q_BLOCK` and P = ``num_pages`` (the index width flex's C++ template wants);
    ``info`` is kv_len, hi, step and the inverse page table (see :func:`_causal_mod`).
    Only the per-row lists cross to the device; the ``[B, P]`` tensors are made there.
    """
    b = len(tables)
    n_blocks = -(-q_len // Q_BLOCK)
    width = max(1, max(len(t) for t in tables))
    i64 = {"dtype": torch.int64, "device": device}
    per_row = torch.tensor([[n, c if c is not None else 0, int(c is not None), len(t)]
                            for n, c, t in zip(kv_lens, cached, tables, strict=True)], **i64)
    lens, base, step = per_row[:, 0:1], per_row[:, 1:2], per_row[:, 2:3]  # [B, 1]
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], **i64)  # [B, W]
    # Per (row, query block): pages [0, full) are seen whole by every query of the block,
    # pages [full, seen) by some; the rest by none.
    q_lo = torch.arange(n_blocks, **i64) * Q_BLOCK  # [R]
    q_hi = torch.clamp(q_lo + Q_BLOCK, max=q_len) - 1
    if custom:
        full = torch.zeros(b, n_blocks, **i64)
        seen = (lens + s - 1) // s + full
    else:
        causal = step == 1
        last_lo = torch.where(causal, base + q_lo, lens - 1)  # last entry q_lo sees
        last_hi = torch.where(causal, base + q_hi, lens - 1)
        full = torch.minimum(last_lo + 1, lens) // s  # [B, R]
        seen = (torch.minimum(last_hi, lens - 1) + s) // s
    cols = torch.arange(num_pages, **i64)
    partial_src = (full[..., None] + cols).clamp_(max=width - 1)  # [B, R, P]
    partial_idx = table.gather(1, partial_src.view(b, -1)).view(b, n_blocks, num_pages)
    full_idx = table.gather(1, cols.clamp(max=width - 1).expand(b, -1))[:, None]
    full_idx = full_idx.expand(b, n_blocks, num_pages)

    info = torch.full((b, num_pages + 3), -1, dtype=torch.int32, device=device)
    logical = torch.arange(width, **i64).expand(b, -1)  # [B, W]
    real = logical < per_row[:, 3:4]  # the padding of short tables is not the row's
    info[torch.arange(b, **i64)[:, None].expand(b, width)[real], table[real] + 3] = \
        logical[real].to(torch.int32)
    info[:, :3] = torch.cat([lens, base + (1 - step) * (lens - 1), step], 1).to(torch.int32)

    def i32(x: torch.Tensor) -> torch.Tensor:
        return x.to(torch.int32).contiguous()

    return (i32((seen - full)[:, None]), i32(partial_idx[:, None]), i32(full[:, None]),
            i32(full_idx[:, None]), info)


class StaticDecodes:
    """One decode call of a fixed number of rows over fixed tensors (CUDA graphs).

    ``fill`` writes a step's page tables into the same tensors in place, so a graph that
    captured :meth:`plan`'s call replays over the new step's pages."""

    def __init__(self, page_size: int, batch: int, num_pages: int,
                 device: torch.device) -> None:
        from torch.nn.attention.flex_attention import BlockMask

        self.page_size, self.batch, self.num_pages = page_size, batch, num_pages
        self.device = device
        self.tensors = list(_blocks([[0]] * batch, [1] * batch, [0] * batch, 1, False,
                                    page_size, num_pages, device))
        num, idx, full_num, full_idx, info = self.tensors
        self.block_mask = BlockMask.from_kv_blocks(
            num, idx, full_num, full_idx, BLOCK_SIZE=(Q_BLOCK, page_size),
            mask_mod=_causal_mod(info, page_size), seq_lengths=(1, num_pages * page_size),
            compute_q_blocks=False)

    def fill(self, tables: list[list[int]], kv_lens: list[int], cached: list[int]) -> None:
        """This step's rows (exactly ``batch`` of them: pad before)."""
        fresh = _blocks(tables, kv_lens, list(cached), 1, False, self.page_size,
                        self.num_pages, self.device)
        for dst, src in zip(self.tensors, fresh, strict=True):
            dst.copy_(src, non_blocking=True)

    def plan(self) -> _Plan:
        return _Plan([_Call(slice(0, self.batch), self.batch, 1, self.block_mask)])


class FlexAttention:
    """``AttentionBackend`` over ``flex_attention`` (see the module docstring).

    Args:
        page_size: the engine's page size (one KV block of the block mask per page).
        cascade: attend a shared prefix once for the decodes that share it; default: where
            flex returns the log-sum-exp (CUDA, or the eager kernel).
        compiled: False runs flex's eager reference (tests on tiny pools only).
    """

    name = "flex"
    kernels = False  # flex_attention's own (compiled) kernels
    bf16_pool = False  # one dtype for q, k and v: no bf16 pages under an fp32 model
    deterministic = False

    def __init__(self, page_size: int, *, cascade: bool | None = None,
                 compiled: bool = True) -> None:
        self.page_size = page_size
        self.cascade = cascade
        self.compiled = compiled
        self._torch = TorchAttention(cascade=True)

    def _cascades(self, device: torch.device) -> bool:
        if self.cascade is not None:
            return self.cascade
        return device.type == "cuda" or not self.compiled

    # ------------------------------------------------------------------ per forward

    def prepare(self, meta: AttentionMetadata, pool_kv: torch.Tensor) -> None:
        """Split the batch into flex calls and build each call's block mask."""
        if is_quantized(pool_kv):
            self._torch.prepare(meta, pool_kv)
            meta.backend_state = _Plan([], meta.backend_state)
            return
        device = pool_kv.device
        starts = [0]
        for n in meta.query_lens:
            starts.append(starts[-1] + n)

        def rows_of(seqs: list[int]) -> torch.Tensor:
            return torch.tensor([starts[i] for i in seqs], dtype=torch.int64, device=device)

        q_lens = meta.query_lens
        decodes = [i for i, n in enumerate(q_lens) if n == 1 and meta.masks[i] is None]
        others = [i for i, n in enumerate(q_lens) if not (n == 1 and meta.masks[i] is None)]
        clusters: list[tuple[list[int], int]] = []
        if self._cascades(device):
            clusters, decodes = shared_prefix_clusters(meta, decodes)
        s, num_pages = meta.page_size, int(pool_kv.shape[0])
        calls: list[_Call | _Cascade] = []
        for seqs, shared in clusters:
            head = meta.page_tables[seqs[0]][:shared]
            tails = [meta.page_tables[i][shared:] for i in seqs]
            tail_lens = [meta.kv_lens[i] - shared * s for i in seqs]
            calls.append(_Cascade(
                rows_of(seqs),
                self._call(rows_of(seqs), [head], [shared * s], [None], [len(seqs)], None,
                           s, num_pages, device),
                self._call(rows_of(seqs), tails, tail_lens, [None] * len(seqs),
                           [1] * len(seqs), None, s, num_pages, device)))
        if decodes:
            calls.append(self._call(
                rows_of(decodes), [meta.page_tables[i] for i in decodes],
                [meta.kv_lens[i] for i in decodes], [meta.num_cached[i] for i in decodes],
                [1] * len(decodes), None, s, num_pages, device))
        for i in others:
            calls.append(self._call(
                slice(starts[i], starts[i + 1]), [meta.page_tables[i]], [meta.kv_lens[i]],
                [meta.num_cached[i]], [q_lens[i]], meta.masks[i], s, num_pages, device))
        meta.backend_state = _Plan(calls)

    @staticmethod
    def _call(rows: slice | torch.Tensor, tables: list[list[int]], kv_lens: list[int],
              cached: list[int | None], q_lens: list[int], mask: torch.Tensor | None,
              s: int, num_pages: int, device: torch.device) -> _Call:
        """The block mask of one call (see :func:`_blocks`); ``mask``: one row only."""
        from torch.nn.attention.flex_attention import BlockMask

        q_len = max(q_lens)
        num, idx, full_num, full_idx, info = _blocks(tables, kv_lens, cached, q_len,
                                                     mask is not None, s, num_pages, device)
        if mask is not None:
            allowed = _bucketed(mask.to(device=device, dtype=torch.bool))  # [Qb, Lb]
            mask_mod = _custom_mod(_bucketed_rows(info), allowed, s)
        else:
            mask_mod = _causal_mod(info, s)
        block_mask = BlockMask.from_kv_blocks(
            num, idx, full_num, full_idx, BLOCK_SIZE=(Q_BLOCK, s), mask_mod=mask_mod,
            seq_lengths=(q_len, num_pages * s), compute_q_blocks=False)
        return _Call(rows, len(tables), q_len, block_mask)

    def static_decodes(self, batch: int, num_pages: int, device: torch.device) -> StaticDecodes:
        """A decode call of ``batch`` rows whose block mask lives in fixed tensors, refilled
        in place each step (for CUDA graphs: ``runtime.model.cuda_graphs``)."""
        return StaticDecodes(self.page_size, batch, num_pages, device)

    # -------------------------------------------------------------------- per layer

    def forward(self, layer: int, q: torch.Tensor, kv: torch.Tensor, pool_kv: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """Write K/V, then one flex call per group (two per cascade). See the Protocol."""
        plan: _Plan = meta.backend_state
        if plan.torch_state is not None:
            return self._torch.forward_as(plan.torch_state, layer, q, kv, pool_kv, meta)
        write_kv(pool_kv, layer, kv, meta)
        t, h, d = q.shape
        p, s, _, _, kvh, _ = pool_kv.shape
        # The layer's keys and values: the pool as one sequence, a strided view.
        k = pool_kv[:, :, layer, 0].reshape(p * s, kvh, d).transpose(0, 1)[None]
        v = pool_kv[:, :, layer, 1].reshape(p * s, kvh, d).transpose(0, 1)[None]
        if len(plan.calls) == 1 and isinstance(plan.calls[0], _Call) \
                and isinstance(plan.calls[0].rows, slice) and plan.calls[0].rows == slice(0, t):
            return self._attend(plan.calls[0], q, k, v)
        out = q.new_empty(t, h * d)  # [T, H*D]
        for c in plan.calls:
            if isinstance(c, _Cascade):
                qg = q.index_select(0, c.rows)  # [n, H, D]
                o1, lse1 = self._attend(c.shared, qg, k, v, lse=True)  # [n, H*D], [1, H, n]
                o2, lse2 = self._attend(c.tails, qg, k, v, lse=True)  # [n, H*D], [n, H, 1]
                merged = merge_lse(o1.view(-1, h, d), lse1[0].transpose(0, 1),
                                   o2.view(-1, h, d), lse2[:, :, 0])
                out.index_copy_(0, c.rows, merged.to(q.dtype).view(-1, h * d))
            elif isinstance(c.rows, slice):
                out[c.rows] = self._attend(c, q[c.rows], k, v)
            else:
                out.index_copy_(0, c.rows, self._attend(c, q.index_select(0, c.rows), k, v))
        return out

    def _attend(self, c: _Call, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                lse: bool = False) -> Any:
        """[Tg, H, D] queries (row-major over the call's rows) -> [Tg, H*D] (and the
        log-sum-exp [B, H, Q] with ``lse``)."""
        from torch.nn.attention.flex_attention import AuxRequest

        tg, h, d = q.shape
        qb = q.view(c.batch, c.q_len, h, d).transpose(1, 2)  # [B, H, Q, D]
        extra: dict[str, Any] = {}
        if lse:
            extra["return_aux"] = AuxRequest(lse=True)
        if q.device.type == "cuda" and self.page_size < 64:
            extra["kernel_options"] = {"BLOCK_N": self.page_size}  # a block within a page
        res = flex_kernel(self.compiled)(qb, k, v, block_mask=c.block_mask,
                                         enable_gqa=h != k.shape[1], **extra)
        out, aux = (res[0], res[1]) if lse else (res, None)
        out = out.transpose(1, 2).reshape(tg, h * d)
        return (out, aux.lse) if lse else out
