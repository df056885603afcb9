"""Torch attention backend (CPU and CUDA): ragged batches over the paged pool.

Owner: the model runner (stateless across forwards). Strategy: ``prepare`` splits the
batch into groups (all plain decodes together; each prefill chunk or custom-masked pass on
its own, so a long chunk never pads many one-token decodes to its length), and lays each
group out once as a padded ``[B, Qmax]`` queries x ``[B, Lmax]`` keys problem: the padded
page table of every sequence (keys are gathered a whole page at a time, then cut to
``Lmax``), the flat index of every real query in the padded layout, and one bool mask
``[B, 1, Qmax, Lmax]`` covering causality, custom masks and padding. Each layer then runs
a fixed handful of ops per group and no Python per sequence: write new K/V, one page
gather each of K and V, one ``scaled_dot_product_attention``.

Common cases skip the mask entirely: a single decoding sequence (all keys visible), a
batch of decodes with equal context lengths, and a single fresh causal prefill
(``is_causal``). Padded query rows attend to real, finite pool data and are dropped, so
no NaN can appear in rows that are kept.

Deterministic mode (``deterministic=True``, on CPU with pie-ctx's kernels built): every
causal sequence, prefill chunks of any length included, goes to the paged kernel, which
sums a key's contribution in an order fixed by its position (16-key blocks inside
256-key splits at fixed positions), so a row's bits depend neither on its batch nor on
how its prompt was chunked nor on which pages came from the cache. Pools that are not
fp32 and that it cannot read in place (bf16 pages under a bf16 model) are gathered
and converted to fp32 per layer for it, and forks share a
prefix through the kernel's shared splits instead of the cascade (which merges at a
boundary that depends on the batch). Custom-masked passes still go to SDPA.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from runtime.kv.layout import SCALE_BYTES, decode
from runtime.model import kernels
from runtime.model.attention.base import AttentionMetadata, consecutive_run, write_kv
from runtime.model.attention.cascade import CascadeGroup, run_prefix_len, shared_prefix_clusters

if TYPE_CHECKING:
    from runtime.model.scores import ScoreCapture

__all__ = ["TorchAttention", "fused_gqa"]

_LONE_DECODES = 2  # at most this many unclustered decodes get their own run-prefix group
_MIN_RUN_PAGES = 4  # shortest run prefix worth reading in place that way
_HAS_ENABLE_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)


def fused_gqa(q: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """Whether SDPA keeps a fused kernel when asked to broadcast KV heads (``enable_gqa``).

    On CPU its flash kernel takes GQA with masks and fp32. On CUDA only the flash kernel
    takes GQA, and it takes neither a mask nor fp32 (nor a head dim over 256): with those,
    ``enable_gqa`` would drop to the math kernel, which materialises every score, so the
    caller repeats the KV heads instead and the memory-efficient kernel runs.
    """
    if not _HAS_ENABLE_GQA:
        return False
    if q.device.type != "cuda":
        return True
    return mask is None and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256


KERNEL_MAX_QUERIES = 16  # new tokens of a sequence the kernel attends (more: SDPA)


def head_dim(pool_kv: torch.Tensor) -> int:
    """The head dim of a pool's entries (int8 ones carry their scale's bytes too)."""
    return pool_kv.shape[-1] - (SCALE_BYTES if pool_kv.dtype == torch.int8 else 0)


@dataclass(slots=True)
class KernelGroup:
    """Sequences attended by ``runtime.model.kernels``' ``paged_attention``: each new token
    over its own sequence's pages, read in place (no gather), causal."""

    ops: Any
    seqs: list[int]
    rows: torch.Tensor | None  # their token rows in the flat batch; None = all, in order
    page_tables: torch.Tensor  # [N, max_pages] int32
    seq_start: torch.Tensor  # [N + 1] int32: sequence n's rows in the group's queries
    num_cached: torch.Tensor  # [N] int32
    # pools other than fp32: the group's pages, gathered and converted to fp32 per layer
    # (page_tables then index this list)
    pages: torch.Tensor | None = None

    @classmethod
    def build(cls, ops: Any, meta: AttentionMetadata, seqs: list[int],
              gather: bool = False) -> KernelGroup:
        tables = [meta.page_tables[i] for i in seqs]
        pages = None
        if gather:  # local page ids, in first-seen order (shared pages once)
            local: dict[int, int] = {}
            tables = [[local.setdefault(p, len(local)) for p in t[: -(-meta.kv_lens[i]
                                                                 // meta.page_size)]]
                      for t, i in zip(tables, seqs, strict=True)]
            pages = torch.tensor(list(local), dtype=torch.int64,
                                 device=meta.write_pages.device)
        width = max(1, max(len(t) for t in tables))
        padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
        lens = [meta.query_lens[i] for i in seqs]
        starts = [0]
        for n in lens:
            starts.append(starts[-1] + n)
        rows = None
        if len(seqs) != len(meta.query_lens):
            first = [0]
            for n in meta.query_lens:
                first.append(first[-1] + n)
            rows = torch.tensor([first[i] + j for i in seqs for j in range(meta.query_lens[i])],
                                dtype=torch.int64)
        cached = [meta.num_cached[i] for i in seqs]
        return cls(ops, seqs, rows, padded, torch.tensor(starts, dtype=torch.int32),
                   torch.tensor(cached, dtype=torch.int32), pages)

    def attend(self, layer: int, q: torch.Tensor, pool_kv: torch.Tensor,
               scores: ScoreCapture | None = None) -> torch.Tensor:
        """[Tg, H, D] queries -> [Tg, H*D] (the kernel takes fp32 queries: an int8 pool of
        a bf16 model has its queries widened and the result rounded back); the asking
        rows' scores into ``scores``' buffers where it has this layer's."""
        if q.dtype != torch.float32:
            return self.attend(layer, q.float(), pool_kv, scores).to(q.dtype)
        args: tuple = (pool_kv, layer)
        if self.pages is not None:
            # [n, S, 2, KVH, D] fp32, seen by the kernel as a one-layer pool
            pool = decode(pool_kv[:, :, layer].index_select(0, self.pages), torch.float32)
            args = (pool.float().unsqueeze(2), 0)
        tables = (self.page_tables, self.seq_start, self.num_cached, q.shape[-1] ** -0.5)
        bufs = scores.buffers(layer, q.shape[1]) if scores is not None else None
        if bufs is None:
            return self.ops.paged_attention(q, *args, *tables)
        slot, logits = bufs
        if self.rows is not None:
            slot = slot.index_select(0, self.rows)
        return self.ops.paged_attention_scored(q, *args, *tables, slot, logits)


@dataclass(slots=True)
class _Group:
    """Sequences attended together in one SDPA call per layer."""

    rows: slice | torch.Tensor | None  # their token rows in the flat [T] batch; None = all
    batch: int
    max_q: int
    max_kv: int
    max_pages: int
    page_index: torch.Tensor  # [B * max_pages] int64 page ids, padded with page 0
    q_index: torch.Tensor | None  # [Tg] flat row in the padded [B * Qmax] layout; None = dense
    mask: torch.Tensor | None  # [B, 1, Qmax, Lmax] bool, True = attend
    is_causal: bool
    run_start: int | None = None  # B == 1 and its pages are a run: read them in place


class TorchAttention:
    """``AttentionBackend`` built on ``F.scaled_dot_product_attention``.

    A batch is split into groups so padding never multiplies work: decodes that share
    leading pages (forks) form cascade groups that read the shared pages once; the other
    plain decodes (one query each) form one group; every other sequence (a prefill chunk,
    a custom mask) is its own group. A batch that is a single group runs exactly one SDPA
    per layer.
    """

    name = "torch"

    def __init__(self, *, cascade: bool = True, kernels: bool = True,
                 bf16_pool: bool = False, deterministic: bool = False) -> None:
        """Args:
            cascade: attend a shared prefix once for all decodes that share it
                (``runtime.model.attention.cascade``).
            kernels: attend decodes and drafts over an fp32 (or int8) CPU pool with
                pie-ctx's own kernel when it is built (``runtime.model.kernels``).
            bf16_pool: the pool holds bf16 entries of an fp32 model (``kv_dtype="bf16"``):
                the kernel reads them too, widened to fp32.
            deterministic: every causal row through that kernel, whatever its query count
                and pool dtype, and no cascade (see the module doc); it needs the kernels.
        """
        self.deterministic = deterministic and kernels
        self.cascade = cascade and not self.deterministic
        self.kernels = kernels
        self.bf16_pool = bf16_pool

    def prepare(self, meta: AttentionMetadata, pool_kv: torch.Tensor) -> None:
        """Precompute gather indices, query layouts and masks for this forward.

        Decodes that share leading pages go to cascade groups (their prefix attended
        once, as a GEMM). What is left with a few causal new tokens goes to pie-ctx's own
        kernel when it is built (read in place, no gather); the rest to SDPA groups."""
        q_lens = meta.query_lens
        plain = [m is None for m in meta.masks]
        decodes = [i for i, n in enumerate(q_lens) if n == 1 and plain[i]]
        clusters, decodes = shared_prefix_clusters(meta, decodes) if self.cascade else ([], decodes)
        clustered = {i for seqs, _ in clusters for i in seqs}
        limit = KERNEL_MAX_QUERIES if not self.deterministic else max(q_lens, default=0)
        kernel = self._kernel_group(meta, pool_kv, [
            i for i, n in enumerate(q_lens)
            if plain[i] and n <= limit and i not in clustered])
        if kernel is not None and kernel.rows is None:  # the whole batch, one call a layer
            meta.backend_state = [kernel]
            return
        short = set(kernel.seqs) if kernel is not None else set()
        decodes = [i for i in decodes if i not in short]
        others = [i for i in range(len(q_lens))
                  if not (q_lens[i] == 1 and plain[i]) and i not in short]
        if self.cascade and kernel is None and len(decodes) <= _LONE_DECODES:
            clusters, decodes = self._run_prefixes(meta, clusters, decodes)
        if kernel is None and not clusters and (not others or (not decodes
                                                             and len(others) == 1)):
            meta.backend_state = [self.group(meta, list(range(len(q_lens))), None)]
            return
        starts = [0]
        for n in q_lens:
            starts.append(starts[-1] + n)
        device = meta.write_pages.device

        def rows_of(seqs: list[int]) -> torch.Tensor:
            return torch.tensor([starts[i] for i in seqs], dtype=torch.int64, device=device)

        groups: list[_Group | CascadeGroup | KernelGroup] = [
            CascadeGroup.build(meta, seqs, shared, rows_of(seqs)) for seqs, shared in clusters]
        if kernel is not None:
            groups.append(kernel)
        if decodes:
            groups.append(self.group(meta, decodes, rows_of(decodes)))
        for i in others:
            groups.append(self.group(meta, [i], slice(starts[i], starts[i + 1])))
        meta.backend_state = groups

    def _kernel_group(self, meta: AttentionMetadata, pool_kv: torch.Tensor,
                      seqs: list[int]) -> KernelGroup | None:
        """A group for pie-ctx's own kernel (``runtime.model.kernels``) of ``seqs`` over an
        fp32, int8 (each entry times its scale as read) or bf16 (widened to fp32 as read)
        CPU pool; in deterministic mode other pools too (bf16 pages of a bf16 model),
        gathered and converted per layer; None if the kernel cannot serve them."""
        readable = pool_kv.dtype in (torch.float32, torch.int8) or (
            self.bf16_pool and pool_kv.dtype == torch.bfloat16)
        gather = not readable
        if not seqs or not self.kernels or (gather and not self.deterministic) \
                or pool_kv.device.type != "cpu" or head_dim(pool_kv) % 16:
            return None
        ops = kernels.ops()
        if ops is None:
            return None
        if meta.scores is not None:  # the kernel scores the asking rows it attends
            meta.scores.take(seqs)
        return KernelGroup.build(ops, meta, seqs, gather)

    @staticmethod
    def _run_prefixes(meta: AttentionMetadata, clusters: list[tuple[list[int], int]],
                      decodes: list[int]) -> tuple[list[tuple[list[int], int]], list[int]]:
        """Lone decodes whose pages start with a long run, but are not one run overall (the
        engine's tail page usually sits elsewhere): read the run in place and gather only
        the rest, through the cascade path with a single sequence."""
        rest = []
        ps = meta.page_size
        for i in decodes:
            table = meta.page_tables[i]
            needed = table[: -(-meta.kv_lens[i] // ps)]
            run = run_prefix_len(needed, limit=meta.num_cached[i] // ps)
            if consecutive_run(needed) is None and run >= _MIN_RUN_PAGES:
                clusters = [*clusters, ([i], run)]
            else:
                rest.append(i)
        return clusters, rest

    def group(self, meta: AttentionMetadata, seqs: list[int],
              rows: slice | torch.Tensor | None) -> _Group:
        """The padded layout, page index and mask of ``seqs`` attended together (their
        token ``rows`` in the flat batch; None = all of it)."""
        device = meta.write_pages.device
        q_lens = [meta.query_lens[i] for i in seqs]
        kv_lens = [meta.kv_lens[i] for i in seqs]
        cached = [meta.num_cached[i] for i in seqs]
        masks = [meta.masks[i] for i in seqs]
        tables = [meta.page_tables[i] for i in seqs]
        b, max_q, max_kv = len(seqs), max(q_lens), max(kv_lens)

        max_pages = max(len(pt) for pt in tables)
        # Pad with page 0: padded keys are always masked out (or belong to dropped rows).
        table = torch.tensor([pt + [0] * (max_pages - len(pt)) for pt in tables],
                             dtype=torch.int64, device=device)  # [B, max_pages]
        q_index = None
        if any(n != max_q for n in q_lens):
            flat = [i * max_q + j for i, n in enumerate(q_lens) for j in range(n)]
            q_index = torch.tensor(flat, dtype=torch.int64, device=device)  # [Tg]

        custom = any(m is not None for m in masks)
        mask, is_causal = None, False
        if not custom and max_q == 1:
            if any(n != max_kv for n in kv_lens):
                lens = torch.tensor(kv_lens, device=device)
                kv_idx = torch.arange(max_kv, device=device)  # [Lmax]
                mask = (kv_idx[None, :] < lens[:, None]).view(b, 1, 1, max_kv)
        elif not custom and b == 1 and cached[0] == 0:
            is_causal = True
        else:
            mask = self._general_mask(cached, masks, max_q, max_kv, device)
        run = None
        if b == 1:
            run = consecutive_run(tables[0][: -(-max_kv // meta.page_size)])
        return _Group(rows, b, max_q, max_kv, max_pages, table.view(-1), q_index, mask,
                      is_causal, run)

    @staticmethod
    def _general_mask(cached_lens: list[int], masks: list[torch.Tensor | None], max_q: int,
                      max_kv: int, device: torch.device) -> torch.Tensor:
        """Causal-in-KV-order mask for every sequence, overridden by custom masks."""
        b = len(cached_lens)
        cached = torch.tensor(cached_lens, device=device)  # [B]
        limit = cached[:, None] + torch.arange(max_q, device=device)[None, :]  # [B, Qmax]
        cols = torch.arange(max_kv, device=device)  # [Lmax]
        mask = cols[None, None, :] <= limit[:, :, None]  # [B, Qmax, Lmax]
        for i, custom in enumerate(masks):
            if custom is not None:
                q_len, kv_len = custom.shape
                mask[i, :q_len, :kv_len] = custom.to(device)
                mask[i, :q_len, kv_len:] = False
        return mask.view(b, 1, max_q, max_kv)

    def forward_as(self, state: Any, layer: int, q: torch.Tensor, kv: torch.Tensor,
                   pool_kv: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """:meth:`forward` with ``state`` (this backend's plan) in place of the caller's
        ``meta.backend_state`` for the call: how another backend hands a step to this one."""
        own, meta.backend_state = meta.backend_state, state
        try:
            return self.forward(layer, q, kv, pool_kv, meta)
        finally:
            meta.backend_state = own

    def forward(self, layer: int, q: torch.Tensor, kv: torch.Tensor, pool_kv: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """Write K/V, gather each group's keys and values, attend. See the Protocol."""
        groups: list[_Group | CascadeGroup | KernelGroup] = meta.backend_state
        write_kv(pool_kv, layer, kv, meta)
        ps = meta.page_size
        if len(groups) == 1 and groups[0].rows is None:
            g = groups[0]
            if isinstance(g, KernelGroup):
                return g.attend(layer, q, pool_kv, meta.scores)
            return self.attend(g, layer, q, pool_kv, ps)
        t, h, d = q.shape
        out = q.new_empty(t, h * d)  # [T, H*D]
        for g in groups:
            if isinstance(g, KernelGroup):
                out.index_copy_(0, g.rows, g.attend(layer, q.index_select(0, g.rows), pool_kv,
                                                    meta.scores))
                continue
            if isinstance(g.rows, slice):
                out[g.rows] = self.attend(g, layer, q[g.rows], pool_kv, ps)
                continue
            qg = q.index_select(0, g.rows)  # [Tg, H, D]
            if isinstance(g, CascadeGroup):
                out.index_copy_(0, g.rows, g.attend(layer, qg, pool_kv, ps))
            else:
                out.index_copy_(0, g.rows, self.attend(g, layer, qg, pool_kv, ps))
        return out

    @staticmethod
    def attend(g: _Group, layer: int, q: torch.Tensor, pool_kv: torch.Tensor,
                s: int) -> torch.Tensor:
        """One group's attention: [Tg, H, D] queries -> [Tg, H*D]."""
        t, h, d = q.shape
        kvh = pool_kv.shape[4]
        b, max_q, max_kv, mp = g.batch, g.max_q, g.max_kv, g.max_pages

        # Whole pages: one page's K (or V) of one layer is a contiguous [S, KVH, D] block, so a
        # page-granular index_select copies at memcpy speed straight into the [B, L, KVH, D]
        # layout SDPA wants (a per-token advanced index was ~20x slower on CPU).
        # int8 pools: ``decode`` dequantizes what was read (one layer of this group's pages),
        # never more; for other pools it is the identity.
        if g.run_start is not None:
            # One sequence on consecutive pages: a strided view of the pool, no copy.
            n = -(-max_kv // s)
            run = pool_kv[g.run_start : g.run_start + n, :, layer]  # [n, S, 2, KVH, W]
            k = decode(run[:, :, 0], q.dtype).reshape(1, n * s, kvh, d)[:, :max_kv].transpose(1, 2)
            v = decode(run[:, :, 1], q.dtype).reshape(1, n * s, kvh, d)[:, :max_kv].transpose(1, 2)
        else:
            k = pool_kv[:, :, layer, 0].index_select(0, g.page_index)  # [B*mp, S, KVH, W]
            v = pool_kv[:, :, layer, 1].index_select(0, g.page_index)  # [B*mp, S, KVH, W]
            k = decode(k, q.dtype).view(b, mp * s, kvh, d)[:, :max_kv].transpose(1, 2)
            v = decode(v, q.dtype).view(b, mp * s, kvh, d)[:, :max_kv].transpose(1, 2)
            # k, v: [B, KVH, Lmax, D]

        if g.q_index is None:
            qb = q.reshape(b, max_q, h, d).transpose(1, 2)  # [B, H, Qmax, D]
        else:
            padded = q.new_zeros(b * max_q, h, d)
            padded.index_copy_(0, g.q_index, q)
            qb = padded.view(b, max_q, h, d).transpose(1, 2)  # [B, H, Qmax, D]

        gqa = h != kvh and fused_gqa(qb, g.mask)
        if h != kvh and not gqa:
            k = k.repeat_interleave(h // kvh, dim=1)  # [B, H, Lmax, D]
            v = v.repeat_interleave(h // kvh, dim=1)
        extra = {"enable_gqa": True} if gqa else {}
        out = F.scaled_dot_product_attention(
            qb, k, v, attn_mask=g.mask, is_causal=g.is_causal, **extra
        )  # [B, H, Qmax, D]
        out = out.transpose(1, 2).reshape(b * max_q, h * d)  # [B*Qmax, H*D]
        if g.q_index is not None:
            out = out.index_select(0, g.q_index)  # [Tg, H*D]
        return out
