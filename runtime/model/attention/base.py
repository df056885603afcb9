"""Paged attention: the metadata of one forward, the backend protocol, shared helpers.

Owner: the model runner builds one :class:`AttentionMetadata` per forward (one batch of
sequences, flattened token-major: sequence 0's new tokens, then sequence 1's, ...) and
hands it to the backend's ``prepare`` once; every layer then calls ``forward`` with the
same metadata, so per-sequence Python work happens once per forward, never per layer.

Conventions (see docs/forward.md):

* the pool tensor is ``[num_pages, page_size, num_layers, 2, num_kv_heads, width]``
  (0 = K, 1 = V), owned by runtime/kv; ``width`` is ``head_dim`` for unquantized pools and
  ``head_dim + 4`` for int8 ones: backends pass what they read through
  ``runtime.kv.layout.decode`` (the identity for unquantized pools) and write through
  :func:`write_kv`; they only write the new tokens' slots;
* sequence ``i`` holds ``kv_lens[i] = num_cached[i] + query_lens[i]`` KV entries, KV index
  ``k`` lives at page ``page_tables[i][k // page_size]``, slot ``k % page_size``;
  new token ``j`` of sequence ``i`` is KV index ``num_cached[i] + j``;
* ``masks[i]`` is None (causal in KV order: new token j attends KV indices
  ``<= num_cached[i] + j``) or a bool Tensor[query_len, kv_len], True = attend.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from runtime.kv.layout import encode
from runtime.model import kernels

__all__ = ["AttentionMetadata", "AttentionBackend", "consecutive_run", "write_kv"]


@dataclass(slots=True)
class AttentionMetadata:
    """Everything attention needs about one forward's batch, built once per forward.

    Tensors live on the model's device. ``backend_state`` is filled by the backend's
    ``prepare`` (gather indices, padded masks, cu_seqlens ...) and read by each layer.
    """

    page_size: int
    query_lens: list[int]  # [B] new tokens per sequence
    num_cached: list[int]  # [B] KV entries present before this step
    kv_lens: list[int]  # [B] num_cached + query_len
    page_tables: list[list[int]]  # [B][num_pages_i] page ids in KV order
    positions: torch.Tensor  # [T] int64 rotary positions (for backends that need them)
    write_pages: torch.Tensor  # [T] int64 page id receiving each new token's K/V
    write_slots: torch.Tensor  # [T] int64 slot within that page
    masks: list[torch.Tensor | None]  # [B] bool [query_len, kv_len] or None (causal)
    backend_state: Any = field(default=None)
    # the attention scores asked for, which pie-ctx's paged kernel writes as it attends
    # (runtime.model.scores.ScoreCapture), or None
    scores: Any = field(default=None)

    @property
    def num_tokens(self) -> int:
        return int(self.write_pages.shape[0])

    @property
    def has_custom_masks(self) -> bool:
        return any(m is not None for m in self.masks)


@runtime_checkable
class AttentionBackend(Protocol):
    """Computes attention for every layer of one forward over the paged pool.

    Besides its ``name`` (``EngineInfo.attention``) every backend declares what the runner
    and the fused decode step (``runtime.model.fused_step``) need to know of it: whether it
    attends with pie-ctx's paged C++ kernel (then the fused step, which calls that kernel,
    reads and writes the pages as it does), over which pages, and with which numerics.
    """

    name: str
    # attends decodes and drafts over a CPU pool with pie-ctx's paged kernel
    # (runtime.model.kernels' paged_attention) where it is built
    kernels: bool
    # the pool holds bf16 entries of an fp32 model and the backend reads them
    bf16_pool: bool
    # batch-invariant numerics (docs/performance.md): every causal row through the paged
    # kernel, whatever its query count, no cascade
    deterministic: bool
    # attends a shared prefix once for the decodes that share it (runtime.model.attention.
    # cascade); None: decided per device when a batch comes (flex)
    cascade: bool | None

    def prepare(self, meta: AttentionMetadata, pool_kv: torch.Tensor) -> None:
        """Precompute per-forward state into ``meta.backend_state`` (called once)."""
        ...

    def forward(
        self, layer: int, q: torch.Tensor, kv: torch.Tensor, pool_kv: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Write this layer's new K/V into the pool, then attend.

        Args:
            layer: layer index.
            q: Tensor[T, H, D] rotated queries of the new tokens.
            kv: Tensor[T, 2, KVH, D] rotated keys and values of the new tokens.
            pool_kv: the pool tensor (see module docstring).
            meta: this forward's metadata, already prepared.

        Returns:
            Tensor[T, H * D] attention output per new token.
        """
        ...


def write_kv(pool_kv: torch.Tensor, layer: int, kv: torch.Tensor, meta: AttentionMetadata) -> None:
    """Store the new tokens' K/V of one layer into their pool slots.

    Args:
        pool_kv: Tensor[P, S, L, 2, KVH, D].
        layer: layer index.
        kv: Tensor[T, 2, KVH, D].
        meta: gives ``write_pages`` / ``write_slots`` ([T] each).
    """
    if kv.dtype == torch.float32 and pool_kv.device.type == "cpu" \
            and pool_kv.dtype in (torch.float32, torch.bfloat16, torch.int8):
        ops = kernels.ops()
        if ops is not None:  # a copy (or encode) per entry instead of an advanced-index put;
            # encode()'s bits, and the fused decode step's writer (runtime/model/fused_step)
            ops.write_kv(pool_kv, layer, kv, meta.write_pages, meta.write_slots)
            return
    # Adjacent advanced indices (page, slot) then the layer: the view is [T, 2, KVH, width];
    # int8 pools get the entries quantized, each with its own scale (runtime/kv/layout).
    pool_kv[meta.write_pages, meta.write_slots, layer] = encode(kv, pool_kv)


def consecutive_run(pages: list[int]) -> int | None:
    """The first page id if ``pages`` are consecutive ascending ids (a run), else None.

    One layer's K (or V) of a run is a single strided view of the pool (see runtime/kv/pool),
    so attention can read it in place instead of gathering it.
    """
    if not pages:
        return None
    first = pages[0]
    for i, p in enumerate(pages):
        if p != first + i:
            return None
    return first
