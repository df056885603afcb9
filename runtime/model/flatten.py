"""Validate a batch of :class:`SeqInput` and flatten it into one forward's tensors.

Owner: every model runner (the native one and the transformers backend) checks its pool
with :func:`check_pool` when built and calls :func:`flatten` first in every forward, so
both refuse the same malformed pools and batches with the same messages, before any KV
slot is written.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from pie_ctx.proto.errors import InvalidArgument
from runtime.kv.layout import entry_width, is_quantized
from runtime.model.attention import AttentionMetadata
from runtime.model.batch import SeqInput

__all__ = ["FlatBatch", "check_pool", "flatten"]


def check_pool(pool_kv: torch.Tensor, page_size: int, num_layers: int, num_kv_heads: int,
               head_dim: int, dtype: torch.dtype | None) -> str:
    """Check that ``pool_kv`` fits a model of this shape (``dtype``: the model's compute
    dtype, None = not fixed yet) and return its format, ``"fp32"``, ``"int8"`` or
    ``"bf16"`` (a bfloat16 pool under a model of another dtype; with ``dtype`` None a
    bfloat16 pool is taken as unquantized, for a bfloat16 model).

    Raises:
        InvalidArgument: the pool's shape, or an unquantized pool's dtype, does not fit.
    """
    if is_quantized(pool_kv):
        kv_dtype = "int8"
    elif pool_kv.dtype == torch.bfloat16 and dtype is not None and dtype != torch.bfloat16:
        kv_dtype = "bf16"
    else:
        kv_dtype = "fp32"
    want = (page_size, num_layers, 2, num_kv_heads, entry_width(kv_dtype, head_dim))
    if pool_kv.dim() != 6 or tuple(pool_kv.shape[1:]) != want:
        raise InvalidArgument(
            f"pool tensor shape {tuple(pool_kv.shape)} does not fit the model: expected "
            f"[num_pages, {', '.join(map(str, want))}]")
    if kv_dtype == "fp32" and dtype is not None and dtype != pool_kv.dtype:
        raise InvalidArgument(f"an unquantized {pool_kv.dtype} pool needs the model in "
                              f"that dtype, got {dtype}")
    return kv_dtype


@dataclass(slots=True)
class FlatBatch:
    """One forward's inputs, flat over the batch's sequences."""

    meta: AttentionMetadata
    tokens: torch.Tensor  # [T] int64
    rows: torch.Tensor  # [N] int64 rows of ``tokens`` that need logits, batch order


def flatten(batch: list[SeqInput], *, page_size: int, vocab_size: int, num_pages: int,
            device: torch.device, has_adapter: Callable[[int], bool]) -> FlatBatch:
    """Validate ``batch`` and flatten it (see ``runtime.model.runner`` for the contract).

    Raises:
        InvalidArgument: a malformed entry (lengths, page table too short, page id or
            token out of range, bad mask, an adapter not loaded).
    """
    if not batch:
        raise InvalidArgument("forward needs at least one sequence")
    s = page_size
    tokens: list[int] = []
    positions: list[int] = []
    write_pages: list[int] = []
    write_slots: list[int] = []
    rows: list[int] = []
    q_lens, cached, kv_lens, tables = [], [], [], []
    masks: list[torch.Tensor | None] = []
    for i, seq in enumerate(batch):
        n, nc = len(seq.tokens), seq.num_cached
        if n == 0:
            raise InvalidArgument(f"batch[{i}]: no new tokens")
        if len(seq.positions) != n:
            raise InvalidArgument(f"batch[{i}]: {len(seq.positions)} positions for {n} tokens")
        if nc < 0:
            raise InvalidArgument(f"batch[{i}]: num_cached must be >= 0, got {nc}")
        kv_len = nc + n
        if len(seq.page_table) * s < kv_len:
            raise InvalidArgument(
                f"batch[{i}]: page table of {len(seq.page_table)} pages holds "
                f"{len(seq.page_table) * s} tokens, needs {kv_len}; reserve pages first")
        pt = seq.page_table
        if pt and (min(pt) < 0 or max(pt) >= num_pages):
            raise InvalidArgument(f"batch[{i}]: page id out of range [0, {num_pages})")
        if min(seq.tokens) < 0 or max(seq.tokens) >= vocab_size:
            raise InvalidArgument(f"batch[{i}]: token id out of range [0, {vocab_size})")
        if seq.logit_indices and (min(seq.logit_indices) < 0 or max(seq.logit_indices) >= n):
            raise InvalidArgument(f"batch[{i}]: logit index out of range [0, {n})")
        if not has_adapter(seq.adapter):
            raise InvalidArgument(f"batch[{i}]: adapter {seq.adapter:#x} is not loaded")
        masks.append(_check_mask(i, seq.mask, n, kv_len, device))
        base = len(tokens)
        rows.extend(base + j for j in seq.logit_indices)
        tokens.extend(seq.tokens)
        positions.extend(seq.positions)
        for idx in range(nc, kv_len):
            write_pages.append(pt[idx // s])
            write_slots.append(idx % s)
        q_lens.append(n)
        cached.append(nc)
        kv_lens.append(kv_len)
        tables.append(list(pt[: (kv_len + s - 1) // s]))
    if len(set(zip(write_pages, write_slots, strict=True))) != len(write_pages):
        raise InvalidArgument("two new tokens in this batch write the same KV slot")
    meta = AttentionMetadata(
        page_size=s, query_lens=q_lens, num_cached=cached, kv_lens=kv_lens,
        page_tables=tables,
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
        write_pages=torch.tensor(write_pages, dtype=torch.int64, device=device),
        write_slots=torch.tensor(write_slots, dtype=torch.int64, device=device),
        masks=masks,
    )
    return FlatBatch(meta, torch.tensor(tokens, dtype=torch.int64, device=device),
                     torch.tensor(rows, dtype=torch.int64, device=device))


def _check_mask(i: int, mask: np.ndarray | None, n: int, kv_len: int,
                device: torch.device) -> torch.Tensor | None:
    """Validate one custom mask and convert it to a bool tensor on ``device``."""
    if mask is None:
        return None
    m = np.asarray(mask)
    if m.dtype != np.bool_:
        raise InvalidArgument(f"batch[{i}]: mask must be bool (True = attend), got {m.dtype}")
    if m.shape != (n, kv_len):
        raise InvalidArgument(
            f"batch[{i}]: mask shape {m.shape}, expected (len(tokens), num_cached + "
            f"len(tokens)) = ({n}, {kv_len})")
    if not m.any(axis=1).all():
        raise InvalidArgument(f"batch[{i}]: every mask row must attend to at least one entry")
    return torch.from_numpy(np.ascontiguousarray(m)).to(device)
