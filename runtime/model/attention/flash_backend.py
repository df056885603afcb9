"""flash-attn backend (CUDA, fp16/bf16, sm80+), imported lazily.

Owner: the model runner; chosen by ``select_backend`` when ``flash_attn`` imports on a
CUDA device and the model's head dim suits it. Every call is
``flash_attn_with_kvcache`` (flash-attn >= 2.6), with the keys and values presented one of
two ways, decided by the engine's page size:

* ``flash-paged`` (page_size % 256 == 0, flash-attn 2's rule for its block tables): the
  kernel reads this layer's view of the pool in place (``pool[:, :, layer, 0]`` is
  ``[num_pages, page_size, KVH, D]`` with a contiguous last dim, all it asks of strides)
  through a block table;
* ``flash-gather`` (any other page size, the default 16): each group's pages are gathered a
  whole page at a time (one ``index_select`` per layer, K and V) into a padded
  ``[B, pages * page_size, KVH, D]`` cache and ``cache_seqlens`` cuts each row; one
  sequence on consecutive pages is read in place. A sequence attended alone (a prefill
  chunk, one of at most two lone decodes) whose table starts with a run of consecutive
  pages (the engine's committed pages, usually) reads that run in place and gathers only
  the rest: two calls, merged through their log-sum-exps, as the torch backend does. The
  gathers write into one scratch buffer per backend, grown to the largest step seen and
  reused by every layer and step (``scratch_bytes``), so the memory a gather takes is
  known and fixed, not a fresh allocation per layer.

``prepare`` splits the batch once per forward, as the torch backend does: decodes (one
query each) attend together in one call; each prefill chunk attends alone (the kernel wants
one query length per call); decodes sharing leading pages (forks) attend as a cascade, the
shared pages once for the whole cluster and each tail on its own, merged in fp32 through
the log-sum-exps flash-attn returns (``[B, H, Q]``, natural log, fp32). Causal masking is
flash-attn's, aligned to the bottom-right corner: query j of a sequence with ``kv_len``
entries and ``q_len`` queries sees entries ``<= kv_len - q_len + j``, i.e.
``num_cached + j``, exactly our causal-in-KV-order. Sequences with custom masks (which
flash-attn cannot express) attend through the torch backend in the same forward; an fp32
pool sends the whole forward there.

Why the default page size stays 16 on CUDA, see docs/forward.md ("Page size on a GPU").
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from runtime.model.attention.base import AttentionMetadata, consecutive_run, write_kv
from runtime.model.attention.cascade import merge_lse, run_prefix_len, shared_prefix_clusters
from runtime.model.attention.torch_backend import _LONE_DECODES, _MIN_RUN_PAGES, TorchAttention

__all__ = ["FlashAttention", "flash_available", "PAGED_BLOCK"]

log = logging.getLogger(__name__)
_FLASH_DTYPES = (torch.float16, torch.bfloat16)
PAGED_BLOCK = 256  # flash-attn 2 reads a paged cache only in blocks of a multiple of this
_MAX_HEAD_DIM = 256  # flash-attn 2's limit


def _import_kvcache() -> Any | None:
    try:
        from flash_attn import flash_attn_with_kvcache  # type: ignore[import-not-found]
    except Exception:  # ImportError, or a broken CUDA extension
        return None
    return flash_attn_with_kvcache


def flash_available(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """True when flash-attn can run this model here: importable, CUDA sm80+, fp16/bf16, and
    a head dim of at most 256 that is a multiple of 8 (otherwise flash-attn pads q and the
    whole cache of each layer, a copy per call)."""
    if device.type != "cuda" or dtype not in _FLASH_DTYPES or not torch.cuda.is_available():
        return False
    if head_dim > _MAX_HEAD_DIM or head_dim % 8:
        return False
    if torch.cuda.get_device_capability(device) < (8, 0):
        return False
    return _import_kvcache() is not None


@dataclass(slots=True)
class _Keys:
    """Where one flash call finds its keys and values, for ``batch`` sequences."""

    batch: int
    seqlens: torch.Tensor  # [B] int32 entries each sequence attends
    block_table: torch.Tensor | None = None  # paged: [B, max_pages] int32
    page_index: torch.Tensor | None = None  # gather: [B * max_pages] int64
    max_pages: int = 0
    run_start: int | None = None  # gather, B == 1, consecutive pages: read in place


@dataclass(slots=True)
class _Group:
    """Sequences with equal query lengths attended by one call per layer."""

    rows: slice | torch.Tensor  # their token rows in the flat [T] batch
    q_len: int
    keys: _Keys


@dataclass(slots=True)
class _Cascade:
    """Decodes sharing leading pages: the shared pages once, then each tail."""

    rows: torch.Tensor  # [n] token rows
    shared: _Keys  # one "sequence" whose n queries are the cluster's
    tails: _Keys  # n sequences of one query


@dataclass(slots=True)
class _RunSplit:
    """One sequence whose pages start with a run: the run read in place (every query sees
    all of it), the rest gathered and attended causally, merged through the LSEs."""

    rows: slice  # its token rows
    head: _Keys  # the run: run_start set, no gather
    tail: _Keys  # the pages after it


@dataclass(slots=True)
class _Plan:
    flash: list[_Group | _Cascade | _RunSplit]
    torch_state: Any = None  # the torch backend's groups for custom-mask sequences
    delegate_all: bool = False


class FlashAttention:
    """``AttentionBackend`` over ``flash_attn_with_kvcache``.

    Args:
        page_size: the engine's page size (paged reads need a multiple of 256).
        cascade: attend a shared prefix once for the decodes that share it.
        kernel: a stand-in for ``flash_attn_with_kvcache`` (tests); default: flash-attn's.

    Raises:
        RuntimeError: flash-attn is not importable (check :func:`flash_available` first).
    """

    def __init__(self, page_size: int, *, cascade: bool = True, kernel: Any = None) -> None:
        fn = kernel or _import_kvcache()
        if fn is None:
            raise RuntimeError("flash-attn is not importable; use the torch backend")
        self._kvcache = fn
        self.page_size = page_size
        self.paged = page_size % PAGED_BLOCK == 0
        self.cascade = cascade
        self.name = "flash-paged" if self.paged else "flash-gather"
        self.kernels = False  # flash-attn's CUDA kernels
        self.bf16_pool = False  # unquantized pages in the model's dtype only
        self.deterministic = False
        self._torch = TorchAttention(cascade=cascade)
        self._warned = False
        self._scratch: torch.Tensor | None = None  # the gathers' buffer (K then V)

    @property
    def scratch_bytes(self) -> int:
        """Bytes of the gather buffer now held (0 until a gather ran; never for paged)."""
        return 0 if self._scratch is None else self._scratch.numel() * self._scratch.element_size()

    # ------------------------------------------------------------------ per forward

    def prepare(self, meta: AttentionMetadata, pool_kv: torch.Tensor) -> None:
        """Split the batch into flash groups (and torch groups for custom masks)."""
        if pool_kv.dtype not in _FLASH_DTYPES:
            self._note(f"a {pool_kv.dtype} pool: these forwards use torch attention")
            self._torch.prepare(meta, pool_kv)
            meta.backend_state = _Plan([], meta.backend_state, delegate_all=True)
            return
        starts = [0]
        for n in meta.query_lens:
            starts.append(starts[-1] + n)
        device = meta.write_pages.device

        def rows_of(seqs: list[int]) -> torch.Tensor:
            return torch.tensor([starts[i] for i in seqs], dtype=torch.int64, device=device)

        masked = [i for i, m in enumerate(meta.masks) if m is not None]
        decodes = [i for i, n in enumerate(meta.query_lens) if n == 1 and meta.masks[i] is None]
        others = [i for i, n in enumerate(meta.query_lens) if n > 1 and meta.masks[i] is None]
        clusters, decodes = (shared_prefix_clusters(meta, decodes) if self.cascade
                             else ([], decodes))
        plan = _Plan([])
        for seqs, shared in clusters:
            plan.flash.append(self._cascade(meta, seqs, shared, rows_of(seqs)))
        alone = others + (decodes if len(decodes) <= _LONE_DECODES else [])
        splits = {i: g for i in alone if (g := self._run_split(meta, i, starts)) is not None}
        decodes = [i for i in decodes if i not in splits]
        if decodes:
            plan.flash.append(_Group(rows_of(decodes), 1, self._keys(meta, decodes)))
        for i in others:
            plan.flash.append(splits.get(i) or _Group(slice(starts[i], starts[i + 1]),
                                                      meta.query_lens[i], self._keys(meta, [i])))
        plan.flash.extend(g for i, g in splits.items() if i not in others)
        if masked:
            self._note("custom masks: those sequences use torch attention")
            plan.torch_state = [self._torch.group(meta, [i], slice(starts[i], starts[i + 1]))
                                for i in masked]
        meta.backend_state = plan

    def _note(self, what: str) -> None:
        if not self._warned:
            log.info("flash-attn: %s", what)
            self._warned = True

    def _keys(self, meta: AttentionMetadata, seqs: list[int], *, skip: int = 0,
              lens: list[int] | None = None) -> _Keys:
        """Keys of ``seqs``: their pages from ``skip`` on, ``lens`` entries each (default
        their whole KV)."""
        device = meta.write_pages.device
        s = meta.page_size
        lens = lens if lens is not None else [meta.kv_lens[i] for i in seqs]
        tables = [meta.page_tables[i][skip: skip + -(-n // s)] for i, n in zip(seqs, lens,
                                                                                 strict=True)]
        width = max(len(t) for t in tables)
        padded = [t + [0] * (width - len(t)) for t in tables]  # page 0: cut by seqlens
        keys = _Keys(len(seqs), torch.tensor(lens, dtype=torch.int32, device=device))
        if self.paged:
            keys.block_table = torch.tensor(padded, dtype=torch.int32, device=device)
            return keys
        keys.max_pages = width
        if len(seqs) == 1:
            keys.run_start = consecutive_run(tables[0])
        if keys.run_start is None:
            keys.page_index = torch.tensor(padded, dtype=torch.int64, device=device).view(-1)
        return keys

    def _run_split(self, meta: AttentionMetadata, i: int, starts: list[int]) -> _RunSplit | None:
        """Sequence ``i`` as its leading run of pages (in place) and the rest, if it is not
        one run overall and the run is long enough; None otherwise (or when paged)."""
        if self.paged:
            return None
        s = meta.page_size
        needed = meta.page_tables[i][: -(-meta.kv_lens[i] // s)]
        # Only full pages every query sees whole: before the first new token.
        run = run_prefix_len(needed, limit=meta.num_cached[i] // s)
        if consecutive_run(needed) is not None or run < _MIN_RUN_PAGES:
            return None
        head = self._keys(meta, [i], lens=[run * s])
        tail = self._keys(meta, [i], skip=run, lens=[meta.kv_lens[i] - run * s])
        return _RunSplit(slice(starts[i], starts[i + 1]), head, tail)

    def _cascade(self, meta: AttentionMetadata, seqs: list[int], shared: int,
                 rows: torch.Tensor) -> _Cascade:
        s = meta.page_size
        head = self._keys(meta, seqs[:1], lens=[shared * s])
        tails = self._keys(meta, seqs, skip=shared, lens=[meta.kv_lens[i] - shared * s
                                                           for i in seqs])
        return _Cascade(rows, head, tails)

    # -------------------------------------------------------------------- per layer

    def forward(self, layer: int, q: torch.Tensor, kv: torch.Tensor, pool_kv: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """Write K/V, then one flash call per group. See the Protocol."""
        plan: _Plan = meta.backend_state
        if plan.delegate_all:
            return self._torch.forward_as(plan.torch_state, layer, q, kv, pool_kv, meta)
        write_kv(pool_kv, layer, kv, meta)
        t, h, d = q.shape
        out = q.new_empty(t, h * d)  # [T, H*D]
        k_pool, v_pool = pool_kv[:, :, layer, 0], pool_kv[:, :, layer, 1]  # [P, S, KVH, D]
        self._reserve(plan, k_pool)
        for g in plan.flash:
            if isinstance(g, _RunSplit):
                out[g.rows] = self._attend_split(g, q[g.rows], k_pool, v_pool)
            elif isinstance(g, _Cascade):
                out.index_copy_(0, g.rows, self._attend_cascade(g, q.index_select(0, g.rows),
                                                                k_pool, v_pool))
            elif isinstance(g.rows, slice):
                qg = q[g.rows].unsqueeze(0)  # [1, Tg, H, D]
                out[g.rows] = self._call(qg, g.keys, k_pool, v_pool, causal=True)[0].view(-1, h * d)
            else:
                qg = q.index_select(0, g.rows).unsqueeze(1)  # [B, 1, H, D]
                out.index_copy_(0, g.rows, self._call(qg, g.keys, k_pool, v_pool,
                                                      causal=True).view(-1, h * d))
        for tg in plan.torch_state or ():
            out[tg.rows] = TorchAttention.attend(tg, layer, q[tg.rows], pool_kv, meta.page_size)
        return out

    def _call(self, q: torch.Tensor, keys: _Keys, k_pool: torch.Tensor, v_pool: torch.Tensor,
              *, causal: bool, lse: bool = False) -> Any:
        """One ``flash_attn_with_kvcache``: q [B, Q, H, D] -> [B, Q, H, D] (and the
        log-sum-exp [B, H, Q] with ``lse``)."""
        if keys.block_table is not None:
            k, v = k_pool, v_pool  # [P, S, KVH, D], read through the block table
        else:
            s, kvh, d = k_pool.shape[1:]
            width = keys.max_pages * s
            if keys.run_start is not None:  # a view of consecutive pages, no copy
                a, n = keys.run_start, keys.max_pages
                k = k_pool[a: a + n].view(1, width, kvh, d)
                v = v_pool[a: a + n].view(1, width, kvh, d)
            else:  # whole pages: memcpy-speed gathers straight into the scratch buffer
                n = keys.page_index.numel()
                k_buf, v_buf = self._buffers(n, k_pool)
                torch.index_select(k_pool, 0, keys.page_index, out=k_buf)
                torch.index_select(v_pool, 0, keys.page_index, out=v_buf)
                k = k_buf.view(keys.batch, width, kvh, d)
                v = v_buf.view(keys.batch, width, kvh, d)
        return self._kvcache(q, k, v, cache_seqlens=keys.seqlens, block_table=keys.block_table,
                             causal=causal, return_softmax_lse=lse)

    @staticmethod
    def _gathered_pages(plan: _Plan) -> int:
        """The most pages one call of ``plan`` gathers."""
        most = 0
        for g in plan.flash:
            for keys in ((g.keys,) if isinstance(g, _Group) else
                         (g.shared, g.tails) if isinstance(g, _Cascade) else (g.head, g.tail)):
                if keys.page_index is not None:
                    most = max(most, keys.page_index.numel())
        return most

    def _reserve(self, plan: _Plan, k_pool: torch.Tensor) -> None:
        """Grow the scratch buffer to this forward's largest gather (K and V of one call),
        once per forward: no allocation per layer, and its size is ``scratch_bytes``."""
        pages = self._gathered_pages(plan)
        need = 2 * pages * k_pool[0].numel()
        if pages and (self._scratch is None or self._scratch.numel() < need
                      or self._scratch.dtype != k_pool.dtype
                      or self._scratch.device != k_pool.device):
            self._scratch = torch.empty(need, dtype=k_pool.dtype, device=k_pool.device)

    def _buffers(self, pages: int, k_pool: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V gather targets of ``pages`` pages, views of the scratch buffer."""
        shape = (pages, *k_pool.shape[1:])
        n = pages * k_pool[0].numel()
        if self._scratch is None or self._scratch.numel() < 2 * n:  # _reserve saw less
            self._scratch = torch.empty(2 * n, dtype=k_pool.dtype, device=k_pool.device)
        return self._scratch[:n].view(shape), self._scratch[n:2 * n].view(shape)

    def _attend_split(self, g: _RunSplit, q: torch.Tensor, k_pool: torch.Tensor,
                      v_pool: torch.Tensor) -> torch.Tensor:
        """One sequence's queries [Q, H, D] over its run (in place) and its other pages."""
        t, h, d = q.shape
        qb = q.unsqueeze(0)  # [1, Q, H, D]
        # The run: full pages before the first new token, so every query sees all of it.
        o1, lse1 = self._call(qb, g.head, k_pool, v_pool, causal=False, lse=True)
        # The rest, causal: bottom-right alignment is still num_cached + j (see module doc).
        o2, lse2 = self._call(qb, g.tail, k_pool, v_pool, causal=True, lse=True)
        # o [1, Q, H, D], lse [1, H, Q]
        out = merge_lse(o1[0], lse1[0].transpose(0, 1), o2[0], lse2[0].transpose(0, 1))
        return out.to(q.dtype).view(t, h * d)

    def _attend_cascade(self, g: _Cascade, q: torch.Tensor, k_pool: torch.Tensor,
                        v_pool: torch.Tensor) -> torch.Tensor:
        """The cluster's queries [n, H, D] -> [n, H*D]."""
        n, h, d = q.shape
        # Shared pages: the n queries as one sequence that sees all of them (no mask).
        o1, lse1 = self._call(q.unsqueeze(0), g.shared, k_pool, v_pool, causal=False, lse=True)
        # Tails: each query against its own pages (one query: causal changes nothing).
        o2, lse2 = self._call(q.unsqueeze(1), g.tails, k_pool, v_pool, causal=False, lse=True)
        # o1 [1, n, H, D], lse1 [1, H, n]; o2 [n, 1, H, D], lse2 [n, H, 1]
        out = merge_lse(o1[0], lse1[0].transpose(0, 1), o2[:, 0], lse2[:, :, 0])  # [n, H, D]
        return out.to(q.dtype).view(n, h * d)
