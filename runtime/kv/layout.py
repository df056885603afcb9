"""How K/V entries are stored in the pool tensor, per KV format (``kv_dtype``).

Owner: runtime/kv (the pool allocates the tensor); the attention backends call
:func:`encode` when they write new tokens and :func:`decode` on what they read.

* ``"fp32"``: unquantized, in the compute dtype (fp32, bf16 or fp16). The pool is
  ``[pages, page_size, layers, 2, kv_heads, head_dim]`` of that dtype; encode and decode
  are the identity.
* ``"int8"``: one entry (one token's K, or V, of one KV head) is ``head_dim`` int8 values
  then its fp32 scale stored in :data:`SCALE_BYTES` bytes: the pool is int8 with a last
  dim of ``head_dim + 4``. Values are symmetric, ``x ~= q * scale`` with
  ``scale = max|x| / 127`` over the entry's ``head_dim`` values: per token and per head,
  so an entry never depends on any other token (batching and prefix sharing stay exact)
  and an outlier token or head costs only its own precision. An entry takes
  ``(head_dim + 4) / (4 * head_dim)`` of fp32's bytes (0.27 at head dim 64).
* ``"bf16"``: entries rounded to bfloat16 whatever the compute dtype (half of fp32's
  bytes, no scale); readers widen them back and accumulate in fp32. With a bf16 compute
  dtype this is the same storage as ``"fp32"``.

Keeping the scale inside the entry keeps a page one contiguous block whatever the format:
copying, forking, hashing and evicting pages never need to know the format.
"""

from __future__ import annotations

import torch

__all__ = ["KV_DTYPES", "SCALE_BYTES", "decode", "encode", "entry_bytes", "entry_width",
           "is_quantized", "storage_dtype"]

KV_DTYPES = ("fp32", "int8", "bf16")  # fp32: unquantized, in the compute dtype
SCALE_BYTES = 4  # an int8 entry's fp32 scale, stored as 4 int8 bytes after its values
_INT8_MAX = 127.0


def entry_width(kv_dtype: str, head_dim: int) -> int:
    """Size of the pool tensor's last dim for ``kv_dtype``."""
    return head_dim + SCALE_BYTES if kv_dtype == "int8" else head_dim


def entry_bytes(kv_dtype: str, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of one entry (one token's K or V of one KV head); ``dtype``: the compute one."""
    if kv_dtype == "int8":
        return head_dim + SCALE_BYTES
    return head_dim * torch.empty((), dtype=storage_dtype(kv_dtype, dtype)).element_size()


def storage_dtype(kv_dtype: str, dtype: torch.dtype) -> torch.dtype:
    """The pool tensor's dtype for ``kv_dtype`` with compute dtype ``dtype``."""
    return {"int8": torch.int8, "bf16": torch.bfloat16}.get(kv_dtype, dtype)


def is_quantized(pool_kv: torch.Tensor) -> bool:
    """Whether ``pool_kv`` holds int8 entries (see the module docstring)."""
    return pool_kv.dtype == torch.int8


def encode(kv: torch.Tensor, pool_kv: torch.Tensor) -> torch.Tensor:
    """New entries ``kv`` [..., head_dim] (compute dtype) in ``pool_kv``'s storage form."""
    if not is_quantized(pool_kv):
        return kv if kv.dtype == pool_kv.dtype else kv.to(pool_kv.dtype)
    x = kv.float()
    scale = x.abs().amax(dim=-1, keepdim=True).clamp_min_(1e-12).div_(_INT8_MAX)  # [..., 1]
    q = torch.div(x, scale).round_().to(torch.int8)  # [..., D]; |x / scale| <= 127
    return torch.cat([q, scale.view(torch.int8)], dim=-1)  # [..., D + 4]


def decode(stored: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Entries read from the pool [..., width] as ``dtype`` values [..., head_dim].

    For unquantized pools in ``dtype`` ``stored`` comes back as is (a view stays a view); a
    bf16 pool's entries are widened to ``dtype`` (exactly, for fp32). For int8 this is
    one fused multiply of the int8 values by their scales (type promotion makes the fp32
    product directly): the only full-size temporary is the result.
    """
    if stored.dtype != torch.int8:
        return stored if stored.dtype == dtype else stored.to(dtype)
    d = stored.shape[-1] - SCALE_BYTES
    values, scale_bytes = stored[..., :d], stored[..., d:]
    try:  # every entry starts at a multiple of 4 bytes: the scales view as fp32 in place
        scale = scale_bytes.view(torch.float32)  # [..., 1]
    except RuntimeError:  # (an odd view of the pool that breaks that alignment)
        scale = scale_bytes.contiguous().view(torch.float32)
    out = values * scale  # int8 * fp32 -> fp32
    return out if dtype == torch.float32 else out.to(dtype)
