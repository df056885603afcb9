"""flash-attn backend (CUDA, fp16/bf16, sm80+), imported lazily.

Owner: the model runner; chosen by ``select_backend`` when ``flash_attn`` imports on a
CUDA device. Two paths, decided by the engine's page size (flash-attn 2 checks "Paged KV
cache block size must be divisible by 256" for its block-table API):

* ``flash-paged``: page_size % 256 == 0 and ``flash_attn_varlen_func`` accepts
  ``block_table``: K/V are read straight from this layer's view of the pool
  (``pool[:, :, layer, 0]`` is ``[num_pages, page_size, KVH, D]``, last dim contiguous,
  which is all the kernel requires of its strides);
* ``flash-varlen``: otherwise: the batch's keys/values are gathered once per layer into
  packed ``[total_kv, KVH, D]`` tensors and ``flash_attn_varlen_func`` runs over them.

Both use ``causal=True``, which flash-attn aligns to the bottom-right corner: new token j
sees KV indices ``<= num_cached + j``, exactly our "causal in KV order". Batches with
custom masks (flash-attn has no arbitrary masks) go to the torch backend for that
forward, logged once.
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass
from typing import Any

import torch

from runtime.model.attention.base import AttentionMetadata, write_kv
from runtime.model.attention.torch_backend import TorchAttention

__all__ = ["FlashAttention", "flash_available"]

log = logging.getLogger(__name__)
_FLASH_DTYPES = (torch.float16, torch.bfloat16)


def _import_varlen() -> Any | None:
    try:
        from flash_attn import flash_attn_varlen_func  # type: ignore[import-not-found]
    except Exception:  # ImportError, or a broken CUDA extension
        return None
    return flash_attn_varlen_func


def flash_available(device: torch.device, dtype: torch.dtype) -> bool:
    """True when flash-attn can run here: importable, CUDA sm80+, fp16/bf16."""
    if device.type != "cuda" or dtype not in _FLASH_DTYPES or not torch.cuda.is_available():
        return False
    if torch.cuda.get_device_capability(device) < (8, 0):
        return False
    return _import_varlen() is not None


@dataclass(slots=True)
class _State:
    delegate: bool  # True: this forward runs on the torch backend
    cu_q: torch.Tensor | None = None  # [B + 1] int32
    cu_k: torch.Tensor | None = None  # [B + 1] int32
    max_q: int = 0
    max_kv: int = 0
    block_table: torch.Tensor | None = None  # [B, max_pages] int32 (paged path)
    gather_pages: torch.Tensor | None = None  # [total_kv] int64 (varlen path)
    gather_slots: torch.Tensor | None = None  # [total_kv] int64


class FlashAttention:
    """``AttentionBackend`` over flash-attn's varlen kernel (paged when the page size allows).

    Args:
        page_size: the engine's page size.

    Raises:
        RuntimeError: flash-attn is not importable (check :func:`flash_available` first).
    """

    def __init__(self, page_size: int) -> None:
        fn = _import_varlen()
        if fn is None:
            raise RuntimeError("flash-attn is not importable; use the torch backend")
        self._varlen = fn
        has_block_table = "block_table" in inspect.signature(fn).parameters
        self.paged = page_size % 256 == 0 and has_block_table
        self.name = "flash-paged" if self.paged else "flash-varlen"
        if not self.paged:
            log.info("flash-attn: page_size %d is not a multiple of 256 (or no block_table "
                     "support): using varlen over gathered pages", page_size)
        self._torch = TorchAttention()
        self._warned_masks = False

    def prepare(self, meta: AttentionMetadata, pool_kv: torch.Tensor) -> None:
        """Build cu_seqlens and either the block table or the packed gather indices."""
        if meta.has_custom_masks or pool_kv.dtype not in _FLASH_DTYPES:
            if not self._warned_masks:
                log.info("flash-attn: custom masks or %s pool: this forward uses torch attention",
                         pool_kv.dtype)
                self._warned_masks = True
            self._torch.prepare(meta, pool_kv)
            meta.backend_state = (_State(delegate=True), meta.backend_state)
            return
        dev = meta.write_pages.device
        zero = [0]
        cu_q = torch.tensor(zero + meta.query_lens, dtype=torch.int32, device=dev).cumsum(0)
        cu_k = torch.tensor(zero + meta.kv_lens, dtype=torch.int32, device=dev).cumsum(0)
        st = _State(delegate=False, cu_q=cu_q.to(torch.int32), cu_k=cu_k.to(torch.int32),
                    max_q=max(meta.query_lens), max_kv=max(meta.kv_lens))
        if self.paged:
            width = max(len(pt) for pt in meta.page_tables)
            st.block_table = torch.tensor(
                [pt + [0] * (width - len(pt)) for pt in meta.page_tables],
                dtype=torch.int32, device=dev)  # [B, max_pages]
        else:
            s = meta.page_size
            pages = [pt[i // s] for pt, n in zip(meta.page_tables, meta.kv_lens, strict=True)
                     for i in range(n)]
            slots = [i % s for n in meta.kv_lens for i in range(n)]
            st.gather_pages = torch.tensor(pages, dtype=torch.int64, device=dev)
            st.gather_slots = torch.tensor(slots, dtype=torch.int64, device=dev)
        meta.backend_state = (st, None)

    def forward(self, layer: int, q: torch.Tensor, kv: torch.Tensor, pool_kv: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """Write K/V, then one flash-attn varlen call. See the Protocol."""
        st, torch_state = meta.backend_state
        if st.delegate:
            meta.backend_state = torch_state
            try:
                return self._torch.forward(layer, q, kv, pool_kv, meta)
            finally:
                meta.backend_state = (st, torch_state)
        write_kv(pool_kv, layer, kv, meta)
        t, h, d = q.shape
        q = q.contiguous()  # the runner may pass a strided view of its fused qkv output
        if self.paged:
            k = pool_kv[:, :, layer, 0]  # [P, S, KVH, D]
            v = pool_kv[:, :, layer, 1]  # [P, S, KVH, D]
            out = self._varlen(q, k, v, st.cu_q, st.cu_k, st.max_q, st.max_kv, causal=True,
                               block_table=st.block_table)  # [T, H, D]
        else:
            g = pool_kv[st.gather_pages, st.gather_slots, layer]  # [total_kv, 2, KVH, D]
            k, v = g[:, 0].contiguous(), g[:, 1].contiguous()  # [total_kv, KVH, D] each
            out = self._varlen(q, k, v, st.cu_q, st.cu_k, st.max_q, st.max_kv, causal=True)
        return out.reshape(t, h * d)
