"""Paged attention behind one interface: ``select_backend`` picks the backend for a device.

``base`` holds what every backend shares (``AttentionMetadata``, the ``AttentionBackend``
protocol, ``write_kv``); ``torch_backend`` runs everywhere; ``flash_backend`` runs on CUDA
when flash-attn is installed. Backends import ``base``, never this package.
"""

from __future__ import annotations

import logging

import torch

from runtime.model.attention.base import (
    AttentionBackend,
    AttentionMetadata,
    consecutive_run,
    write_kv,
)
from runtime.model.attention.torch_backend import TorchAttention

__all__ = ["AttentionMetadata", "AttentionBackend", "consecutive_run", "write_kv",
           "select_backend"]

log = logging.getLogger(__name__)


def select_backend(device: torch.device, dtype: torch.dtype, page_size: int,
                   head_dim: int, kv_dtype: str = "fp32") -> AttentionBackend:
    """The default backend for a device: flash-attn on CUDA when it suits, else torch.

    Args:
        device: the model's device.
        dtype: the compute dtype.
        page_size: the engine's page size (decides flash-attn's paged vs gather path).
        head_dim: the model's head dim (flash-attn takes <= 256, a multiple of 8).
        kv_dtype: the pool's format; flash-attn reads only unquantized half pages, so an
            int8 pool is attended by the torch backend (which dequantizes on the gather).

    Returns:
        An :class:`AttentionBackend`.
    """
    if device.type == "cuda" and kv_dtype != "fp32":
        log.info("attention backend: torch (flash-attn does not read %s KV pages)", kv_dtype)
    elif device.type == "cuda":
        from runtime.model.attention.flash_backend import FlashAttention, flash_available

        if flash_available(device, dtype, head_dim):
            backend: AttentionBackend = FlashAttention(page_size)
            log.info("attention backend: flash-attn (%s path)", backend.name)
            return backend
        log.info("attention backend: torch (flash-attn not importable, or not for %s, "
                 "head dim %d)", dtype, head_dim)
    return TorchAttention()
