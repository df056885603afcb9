"""Dense, unpaged reference forward: the oracle for the paged runner.

Owner: tests (and debugging). It runs the same layer math as :class:`Transformer` but
attention is the textbook formula over one sequence's K/V held in memory, with an explicit
bool mask: no pool, no page tables, no gather, no SDPA. Paged results (any chunking, any
page size, any batch mix) must equal what this returns for the whole sequence at once.
With ``kv_dtype="int8"`` every K/V entry goes through the same per-entry quantization
the pool applies (``runtime.kv.layout``) before it is attended: the oracle of int8 pages.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from runtime.kv.layout import decode, encode, storage_dtype
from runtime.model.model import Transformer

__all__ = ["dense_forward", "causal_mask"]


def causal_mask(n: int) -> np.ndarray:
    """Bool [n, n] lower-triangular mask (True = attend)."""
    return np.tril(np.ones((n, n), dtype=np.bool_))


def dense_forward(model: Transformer, tokens: list[int], positions: list[int] | None = None,
                  mask: np.ndarray | None = None, *, return_hidden: bool = False,
                  kv_dtype: str = "fp32", weights: list[torch.Tensor] | None = None,
                  ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Logits for every token of one whole sequence, computed densely.

    Args:
        model: the fused model (shared with the runner under test).
        tokens: the full sequence.
        positions: rotary positions (default ``0..n-1``).
        mask: bool [n, n], row i = token i, column = KV index; True = attend; default causal.
        kv_dtype: how the paged path under test stores K/V (``"fp32"``, ``"int8"``, ``"bf16"``).
        weights: if given, each layer's softmax weights are appended to it, float32
            Tensor[H, n, n] (row = query, column = key): the oracle of attention scores.

    Returns:
        Tensor[n, vocab] float32 (and with ``return_hidden`` the final-norm hidden states,
        Tensor[n, hidden]).
    """
    c = model.config
    n = len(tokens)
    pos = list(range(n)) if positions is None else positions
    m = torch.from_numpy(causal_mask(n) if mask is None else np.asarray(mask, dtype=np.bool_))
    m = m.to(model.device)  # [n, n]
    group = c.num_heads // c.num_kv_heads
    scale = 1.0 / math.sqrt(c.head_dim)

    storage = torch.empty(0, dtype=storage_dtype(kv_dtype, model.dtype))

    def attend(layer: int, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        kv = decode(encode(kv, storage), kv.dtype)  # [n, 2, KVH, D]; rounded as the pool stores it
        k = kv[:, 0].repeat_interleave(group, dim=1)  # [n, H, D]
        v = kv[:, 1].repeat_interleave(group, dim=1)  # [n, H, D]
        scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * scale  # [H, n, n]
        scores = scores.masked_fill(~m[None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)  # [H, n, n]
        if weights is not None:
            weights.append(probs.clone())
        out = torch.einsum("hqk,khd->qhd", probs, v.float())  # [n, H, D]
        return out.reshape(n, -1).to(q.dtype)  # [n, H * D]

    with torch.inference_mode():
        tok = torch.tensor(tokens, dtype=torch.int64, device=model.device)
        pos_t = torch.tensor(pos, dtype=torch.int64, device=model.device)
        return model.forward(tok, pos_t, attend, None, return_hidden=return_hidden)
