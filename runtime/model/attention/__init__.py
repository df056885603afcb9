"""Paged attention behind one interface: ``select_backend`` picks the backend for a device.

``base`` holds what every backend shares (``AttentionMetadata``, the ``AttentionBackend``
protocol, ``write_kv``); ``torch_backend`` runs everywhere; ``flex_backend`` runs
everywhere too (FlexAttention, compiled); ``flash_backend`` runs on CUDA when flash-attn
is installed; ``measure`` times candidates. Backends import ``base``, never this package.

``PIE_CTX_ATTENTION`` (read when a runner is built) forces a backend: ``torch``, ``flex``,
``flash`` (an error where flash-attn cannot run), or ``measure`` (time flex against torch
on any device and take the faster). Unset (or ``auto``): an int8 pool -> torch; CUDA ->
flash-attn when it suits, else flex or torch by measurement; CPU -> torch (flex measured
slower there, docs/forward.md, and timing it would cost every load a compile).
"""

from __future__ import annotations

import logging
import os

import torch

from pie_ctx.proto.errors import InvalidArgument
from runtime.model.attention.base import (
    AttentionBackend,
    AttentionMetadata,
    consecutive_run,
    write_kv,
)
from runtime.model.attention.torch_backend import TorchAttention

__all__ = ["AttentionMetadata", "AttentionBackend", "consecutive_run", "write_kv",
           "select_backend", "attention_choice", "ENV", "CHOICES"]

log = logging.getLogger(__name__)
ENV = "PIE_CTX_ATTENTION"
CHOICES = ("auto", "torch", "flex", "flash", "measure")


def attention_choice(choice: str | None = None) -> str:
    """The backend asked for: ``choice``, else ``$PIE_CTX_ATTENTION``, else ``auto``.

    Raises:
        InvalidArgument: not one of :data:`CHOICES`.
    """
    choice = (choice or os.environ.get(ENV) or "auto").strip().lower()
    if choice not in CHOICES:
        raise InvalidArgument(f"{ENV}={choice!r}: pick one of {', '.join(CHOICES)}")
    return choice


def select_backend(device: torch.device, dtype: torch.dtype, page_size: int,
                   head_dim: int, kv_dtype: str = "fp32", *,
                   heads: tuple[int, int] | None = None,
                   choice: str | None = None, deterministic: bool = False) -> AttentionBackend:
    """The attention backend for a model on a device (see the module docstring).

    Args:
        device: the model's device.
        dtype: the compute dtype.
        page_size: the engine's page size (decides flash-attn's paged vs gather path).
        head_dim: the model's head dim (flash-attn takes <= 256, a multiple of 8).
        kv_dtype: the pool's format; flash-attn and flex read only unquantized pages, so
            an int8 pool is attended by the torch backend (which dequantizes on the gather).
        heads: ``(num_heads, num_kv_heads)``, the shape a measurement times (default: one
            KV head per query head, 8 of them).
        choice: one of :data:`CHOICES`; default: ``$PIE_CTX_ATTENTION``, else ``auto``.
        deterministic: on CPU, the torch backend in its batch-invariant mode whatever the
            choice (``TorchAttention(deterministic=True)``).

    Returns:
        An :class:`AttentionBackend`.

    Raises:
        InvalidArgument: an unknown choice, or ``flash`` where flash-attn cannot run.
    """
    from runtime.model.attention.flash_backend import FlashAttention, flash_available
    from runtime.model.attention.flex_backend import FlexAttention

    choice = attention_choice(choice)
    h, kvh = heads or (8, 8)
    if deterministic and device.type == "cpu":
        return TorchAttention(deterministic=True, bf16_pool=kv_dtype == "bf16")

    def measured() -> AttentionBackend:
        from runtime.model.attention.measure import choose_fastest

        return choose_fastest({"flex": lambda: FlexAttention(page_size),
                               "torch": TorchAttention}, device, dtype, page_size, h, kvh,
                              head_dim)

    flash_ok = kv_dtype == "fp32" and flash_available(device, dtype, head_dim)
    if choice == "torch":
        return TorchAttention(bf16_pool=kv_dtype == "bf16")
    if choice == "flex":
        if kv_dtype == "bf16":  # flex takes one dtype for q, k and v: not bf16 pages under fp32
            log.info("attention backend: torch (%s=flex, but flex does not read bf16 KV "
                     "pages of an fp32 model)", ENV)
            return TorchAttention(bf16_pool=True)
        log.info("attention backend: flex (%s=flex)", ENV)
        return FlexAttention(page_size)
    if choice == "flash":
        if not flash_ok:
            raise InvalidArgument(
                f"{ENV}=flash: flash-attn cannot run here (it needs CUDA sm80+, fp16/bf16, "
                f"unquantized KV pages, a head dim <= 256 that is a multiple of 8, and the "
                f"'cuda' extra installed; got {device.type}, {dtype}, kv {kv_dtype}, head dim "
                f"{head_dim}); unset {ENV} to choose automatically")
        return FlashAttention(page_size)
    if choice == "measure" and kv_dtype == "fp32":
        return measured()
    if kv_dtype != "fp32":
        log.info("attention backend: torch (flash-attn and flex do not read %s KV pages)",
                 kv_dtype)
        return TorchAttention(bf16_pool=kv_dtype == "bf16")
    if device.type == "cuda":
        if flash_ok:
            backend: AttentionBackend = FlashAttention(page_size)
            log.info("attention backend: flash-attn (%s path)", backend.name)
            return backend
        log.info("attention backend: flash-attn not importable, or not for %s, head dim %d: "
                 "timing flex against torch", dtype, head_dim)
        return measured()
    return TorchAttention()
