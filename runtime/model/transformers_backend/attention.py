"""Attention for transformers' own model classes over pie-ctx's pages.

transformers 5 routes every attention layer of its causal LMs through
``AttentionInterface``: the layer computes q/k/v (its own projections, norms, RoPE or
none), then calls the function registered under ``config._attn_implementation`` with
``query [1, H, T, D]``, ``key``/``value [1, KVH, T, D]`` and the layer's ``scaling``,
``sliding_window`` and ``softcap``. pie-ctx registers one function, :data:`ATTN_NAME`,
that writes the new keys and values into the page pool and attends over each sequence's
pages. The model runs over a flat batch (every context's new tokens in one row of
``[1, T]``), so a step of many contexts is one model call, ragged, with no padding.

Per forward the runner hands a :class:`PagedStep` in through the model's ``**kwargs``
(``pie_ctx=step``); transformers passes them down to the attention call.

Two paths per layer:

* plain attention (no logit soft-capping, and no sliding window that cuts into any
  sequence of the batch): the engine's attention backend (``runtime.model.attention``:
  the same kernels and cascade as the native runner); a scale other than ``D ** -0.5`` is
  folded into the queries;
* otherwise (Gemma 2's soft-capping, a window shorter than some sequence): an eager
  attention per sequence over its gathered pages, in the order transformers' eager
  function uses (scale, soft-cap, mask, float32 softmax).

Masks follow transformers: causal in KV order (KV index ``num_cached + j`` for new token
``j``), the window keeps KV indices ``> q - sliding_window``; a custom mask replaces both,
as a 4D mask passed to transformers does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from pie_ctx.proto.errors import ModelError
from runtime.kv.layout import decode
from runtime.model.attention import AttentionBackend, AttentionMetadata, write_kv

__all__ = ["ATTN_NAME", "LayerCall", "PagedStep", "ShapeProbe", "register"]

ATTN_NAME = "pie_ctx"  # the name in transformers' AttentionInterface


@dataclass(frozen=True, slots=True)
class LayerCall:
    """What one attention layer told the function on the probe forward."""

    layer: int
    num_heads: int
    num_kv_heads: int
    head_dim: int


class ShapeProbe:
    """Stands in for a step on the first forward at load: records each layer's shapes and
    refuses what pie-ctx cannot page (see :func:`register`'s function)."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.calls: list[LayerCall] = []

    def attend(self, module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               scaling: float | None, kwargs: dict[str, Any]) -> torch.Tensor:
        name = type(module).__name__
        if getattr(module, "is_causal", True) is False:
            raise ModelError(f"model {self.model_name}: {name} is not causal attention; the "
                             "transformers backend runs causal LMs only")
        if kwargs.get("s_aux") is not None or kwargs.get("sinks") is not None:
            raise ModelError(f"model {self.model_name}: {name} uses attention sinks, which "
                             "the paged attention does not implement")
        layer = getattr(module, "layer_idx", None)
        if not isinstance(layer, int):
            raise ModelError(f"model {self.model_name}: {name} has no layer_idx, so its KV "
                             "cannot be given a layer of the page pool")
        if value.shape != key.shape:
            raise ModelError(f"model {self.model_name}: {name}'s keys {tuple(key.shape)} and "
                             f"values {tuple(value.shape)} differ in shape; the page pool "
                             "stores both in one layout")
        _, h, t, d = query.shape
        self.calls.append(LayerCall(layer, h, int(key.shape[1]), int(key.shape[3])))
        return query.new_zeros(1, t, h, d)  # values don't matter: only shapes are probed


@dataclass(slots=True)
class PagedStep:
    """One forward's pool, metadata and attention backend, read by every layer."""

    pool_kv: torch.Tensor
    meta: AttentionMetadata
    backend: AttentionBackend
    _tables: list[torch.Tensor] | None = field(default=None, repr=False)
    _window_cuts: dict[int, bool] = field(default_factory=dict, repr=False)

    def attend(self, module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               scaling: float | None, kwargs: dict[str, Any]) -> torch.Tensor:
        """Write this layer's new K/V into the pool and attend: ``[1, T, H, D]``."""
        layer: int = module.layer_idx
        _, h, t, d = query.shape
        q = query[0].transpose(0, 1)  # [T, H, D]
        kv = torch.stack((key[0].transpose(0, 1), value[0].transpose(0, 1)), dim=1)  # [T, 2, KVH, D]
        scale = d ** -0.5 if scaling is None else float(scaling)
        window = kwargs.get("sliding_window")
        softcap = kwargs.get("softcap")
        if softcap is None and not self._window_cuts_in(window):
            if not math.isclose(scale * math.sqrt(d), 1.0, rel_tol=1e-12):
                q = q * (scale * math.sqrt(d))  # the backend scales by D ** -0.5
            out = self.backend.forward(layer, q.contiguous(), kv, self.pool_kv, self.meta)
        else:
            write_kv(self.pool_kv, layer, kv, self.meta)
            out = self._eager(layer, q, scale, window, softcap)
        return out.view(1, t, h, d)

    def _window_cuts_in(self, window: int | None) -> bool:
        """Whether a sliding window hides some KV entry from some query of this batch."""
        if window is None:
            return False
        cut = self._window_cuts.get(window)
        if cut is None:
            m = self.meta
            cut = self._window_cuts[window] = any(
                mask is None and kv_len > window for mask, kv_len in zip(m.masks, m.kv_lens, strict=True))
        return cut

    def _eager(self, layer: int, q: torch.Tensor, scale: float, window: int | None,
               softcap: float | None) -> torch.Tensor:
        """Attention of each sequence over its gathered pages: [T, H, D] -> [T, H * D]."""
        m, pool = self.meta, self.pool_kv
        t, h, d = q.shape
        kvh, width = pool.shape[4], pool.shape[5]
        if self._tables is None:
            self._tables = [torch.tensor(pt, dtype=torch.int64, device=pool.device)
                            for pt in m.page_tables]
        layer_view = pool[:, :, layer]  # [P, S, 2, KVH, width]
        out = q.new_empty(t, h * d)
        start = 0
        for i, n in enumerate(m.query_lens):
            kv_len, nc = m.kv_lens[i], m.num_cached[i]
            stored = layer_view.index_select(0, self._tables[i]).reshape(-1, 2, kvh, width)
            entries = decode(stored[:kv_len], q.dtype)  # [L, 2, KVH, D]
            k = entries[:, 0].transpose(0, 1)  # [KVH, L, D]
            v = entries[:, 1].transpose(0, 1)
            if h != kvh:
                k = k.repeat_interleave(h // kvh, dim=0)  # [H, L, D]
                v = v.repeat_interleave(h // kvh, dim=0)
            qi = q[start:start + n].transpose(0, 1)  # [H, n, D]
            scores = torch.matmul(qi, k.transpose(1, 2)) * scale  # [H, n, L]
            if softcap is not None:
                scores = torch.tanh(scores / softcap) * softcap
            allowed = m.masks[i]
            if allowed is None:
                kv_idx = torch.arange(kv_len, device=q.device)
                q_idx = torch.arange(nc, kv_len, device=q.device)[:, None]  # [n, 1]
                allowed = kv_idx <= q_idx
                if window is not None:
                    allowed &= kv_idx > q_idx - window
            scores = scores.masked_fill(~allowed, float("-inf"))
            probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
            out[start:start + n] = torch.matmul(probs, v).transpose(0, 1).reshape(n, h * d)
            start += n
        return out


def _pie_ctx_attention(module: Any, query: torch.Tensor, key: torch.Tensor,
                       value: torch.Tensor, attention_mask: Any, scaling: float | None = None,
                       dropout: float = 0.0, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """The function transformers calls for every attention layer (see the module doc)."""
    step = kwargs.get("pie_ctx")
    if step is None:
        raise ModelError(
            f"{type(module).__name__} ran pie-ctx's attention without a pie-ctx step: this "
            "model's code does not pass its forward's keyword arguments down to attention, "
            "so it cannot run over the page pool")
    return step.attend(module, query, key, value, scaling, kwargs), None


def register() -> None:
    """Register :data:`ATTN_NAME` in transformers' ``AttentionInterface`` (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, _pie_ctx_attention)
