"""Our own decoder-only transformer forward (Llama / Qwen2 / Qwen3), attention pluggable.

Owner: the model runner. :class:`Transformer` holds the fused weights and runs the layer
stack over a flat batch of new tokens; attention is a callable supplied per forward, so
the same layers serve the paged runner (attention over the pool) and the dense reference
(attention over in-memory K/V), which keeps the reference an independent check of paging.

Numerics follow HF transformers (fp32 RMSNorm statistics, rotate-half RoPE, SwiGLU), so
fp32 logits match HF to ~1e-4 (bit-for-bit with unpacked projections; multi-row
projections may use oneDNN kernels, see ``runtime.model.matmul``). The lm_head runs only on the rows asked for: at prefill
that is usually one row, not the whole prompt.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from pie_ctx.proto.errors import ModelError
from runtime.model import kernels
from runtime.model.adapters.delta import LoraBatch
from runtime.model.blocks import BlockEmbedding, BlockWeight
from runtime.model.config import ModelConfig
from runtime.model.kquants import KQuantWeight
from runtime.model.layers import (
    LayerWeights,
    fuse_layer,
    is_block_weight,
    rms_norm,
    swiglu_mlp,
    take_weight,
)
from runtime.model.matmul import Int8Weight, Projection, should_pack
from runtime.model.rope import RotaryEmbedding, apply_rotary

__all__ = ["Transformer", "AttendFn"]

# attend(layer, q [T, H, D], kv [T, 2, KVH, D]) -> [T, H * D]
AttendFn = Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]


class Transformer:
    """Fused weights plus the forward math.

    Args:
        config: the model config.
        weights: HF-named tensors (``model.embed_tokens.weight``, ``model.layers.{i}...``,
            ``model.norm.weight``, ``lm_head.weight`` unless embeddings are tied); a matrix
            may be a GGUF block weight instead (see ``runtime.model.layers``).
        device: where to run.
        dtype: compute dtype (weights are cast to it).
        pack: allow oneDNN-packed weight copies (default: decided on the model's size).

    The model is built in float (``weight_format == "fp32"``, or on a GGUF's blocks where
    the weights hold them); ``runtime.model.numerics.finish_weights`` then makes the
    projections final (int8, GGUF blocks) and chooses their kernels, once. Until then
    every projection runs its first candidate kernel (``runtime.model.matmul``).

    Raises:
        ModelError: a tensor is missing or mis-shaped.
    """

    def __init__(self, config: ModelConfig, weights: dict[str, Any],
                 device: torch.device, dtype: torch.dtype, pack: bool | None = None) -> None:
        c = config
        self.config = c
        self.device = device
        self.dtype = dtype
        if pack is None:  # decided on the checkpoint's size (see runtime.model.matmul)
            size = sum(t.numel() * torch.empty((), dtype=dtype).element_size()
                       if isinstance(t, torch.Tensor) else t.nbytes for t in weights.values())
            pack = should_pack(device, dtype, size)
        self.packed = pack
        table = weights.get("model.embed_tokens.weight")
        if is_block_weight(table):  # on the GGUF's blocks: rows dequantized when looked up
            if (table.out_features, table.in_features) != (c.vocab_size, c.hidden_size):
                raise ModelError(f"checkpoint tensor 'model.embed_tokens.weight' has shape "
                                 f"{(table.out_features, table.in_features)}, expected "
                                 f"{(c.vocab_size, c.hidden_size)}")
            self.embed: Any = BlockEmbedding(table, dtype)
        else:
            self.embed = take_weight(weights, "model.embed_tokens.weight",
                                     (c.vocab_size, c.hidden_size), device, dtype)
        self.layers: list[LayerWeights] = [
            fuse_layer(c, weights, i, device, dtype, pack) for i in range(c.num_layers)
        ]
        self.final_norm = take_weight(weights, "model.norm.weight", (c.hidden_size,), device, dtype)
        if c.tie_word_embeddings or "lm_head.weight" not in weights:
            head = self.embed.table if isinstance(self.embed, BlockEmbedding) else self.embed
        elif is_block_weight(weights["lm_head.weight"]):
            head = weights["lm_head.weight"]
        else:
            head = take_weight(weights, "lm_head.weight", (c.vocab_size, c.hidden_size), device,
                               dtype)
        self.lm_head: Any = Projection(head, pack=pack, buckets=2)
        self.rotary = RotaryEmbedding(c, device)
        self._q_dim = c.num_heads * c.head_dim
        self._kv_dim = c.num_kv_heads * c.head_dim
        # "int8" once runtime.model.quant has quantized it, "gguf" on GGUF blocks
        # (runtime.model.gguf_weights)
        self.weight_format = "fp32"
        # Tensor parallelism (runtime.distributed): sums a row-parallel projection's partial
        # output over the ranks, in place, after o_proj and down. None: one rank.
        self.reduce: Callable[[torch.Tensor], None] | None = None
        # the kernel choice's log lines (EngineInfo.kernels), once finish_weights ran
        self.kernel_report: list[str] = []

    def projections(self) -> list[Projection]:
        """Every projection of the model, the lm_head last."""
        head = getattr(self.lm_head, "proj", self.lm_head)  # int8: behind its smoothing
        return [p for lw in self.layers for p in (lw.qkv, lw.o_proj, lw.gate_up, lw.down)] + [head]

    def weight_bytes(self) -> int:
        """Bytes of the model's weights, one layout each (a table shared by the embedding
        and the lm_head counted once): what a decode step reads, give or take the rows of
        the embedding it does not look up."""
        norms = [self.final_norm] + [t for lw in self.layers for t in lw.norms()]
        total = sum(t.numel() * t.element_size() for t in norms)
        projections = self.projections()
        total += sum(p.nbytes for p in projections)
        table = getattr(self.embed, "table", self.embed)  # int8: the QuantEmbedding's
        if table is not projections[-1].weight:
            total += (table.nbytes if isinstance(table, (Int8Weight, BlockWeight, KQuantWeight))
                      else table.numel() * table.element_size())
        return total

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """Tensor[T] ids -> Tensor[T, hidden] in the compute dtype."""
        if isinstance(self.embed, torch.Tensor):
            return F.embedding(tokens, self.embed)
        return self.embed(tokens)  # int8: runtime.model.quant.QuantEmbedding

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, attend: AttendFn,
                logit_rows: torch.Tensor | None, *, return_hidden: bool = False,
                lora: LoraBatch | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Run the layer stack and the lm_head on the selected rows.

        Args:
            tokens: Tensor[T] int64 token ids (flat over the batch).
            positions: Tensor[T] int64 rotary positions.
            attend: attention for one layer (see :data:`AttendFn`).
            logit_rows: Tensor[N] int64 rows of ``tokens`` that need logits; None = all.
            return_hidden: also return those rows' final-norm hidden states.
            lora: the LoRA adapters of the batch's rows (``runtime.model.adapters``); their
                deltas are added right after each fused projection. None: base model only.

        Returns:
            Tensor[N, vocab] float32 logits, and with ``return_hidden`` also
            Tensor[N, hidden] (the input of the lm_head).
        """
        c = self.config
        t = tokens.shape[0]
        h, kvh, d = c.num_heads, c.num_kv_heads, c.head_dim
        cos, sin = self.rotary.cos_sin(positions, self.dtype)  # [T, 1, D] each
        x = self.embed_tokens(tokens)  # [T, hidden]
        # pie-ctx's CPU kernels do the rotation in place, in one pass (runtime.model.kernels)
        ops = kernels.ops() if x.device.type == "cpu" and x.dtype == torch.float32 else None
        for i, lw in enumerate(self.layers):
            hs = rms_norm(x, lw.input_norm, c.rms_norm_eps)  # [T, hidden]
            qkv = lw.qkv(hs)  # [T, (H + 2KVH) * D]
            if lora is not None:
                lora.apply(i, "qkv", hs, qkv)  # before RoPE, in the fused layout
            kv = qkv[:, self._q_dim:].view(t, 2, kvh, d)  # [T, 2, KVH, D] (k then v)
            if ops is not None and lw.q_norm is None and qkv.is_contiguous():
                ops.rope_(qkv, cos[:, 0], sin[:, 0], h + kvh, d)  # q and k heads, adjacent
                q = qkv[:, : self._q_dim].view(t, h, d)  # [T, H, D]
            elif lw.q_norm is not None and lw.k_norm is not None:
                q = apply_rotary(rms_norm(qkv[:, : self._q_dim].view(t, h, d), lw.q_norm,
                                          c.rms_norm_eps), cos, sin)  # [T, H, D]
                kv[:, 0] = apply_rotary(rms_norm(kv[:, 0], lw.k_norm, c.rms_norm_eps), cos, sin)
            else:
                # q and k heads are adjacent in qkv: rotate them in one go
                qk = apply_rotary(qkv[:, : self._q_dim + self._kv_dim].view(t, h + kvh, d),
                                  cos, sin)  # [T, H + KVH, D]
                q = qk[:, :h]  # [T, H, D]
                kv[:, 0] = qk[:, h:]  # rotated keys back into the qkv buffer
            attn = attend(i, q, kv)  # [T, H * D]
            o = lw.o_proj(attn)  # [T, hidden]
            if lora is not None:
                lora.apply(i, "o", attn, o)
            if self.reduce is not None:
                self.reduce(o)
            x.add_(o)
            mlp = swiglu_mlp(rms_norm(x, lw.post_norm, c.rms_norm_eps), lw,
                             None if lora is None else partial(lora.apply, i))
            if self.reduce is not None:
                self.reduce(mlp)
            x.add_(mlp)
        return self.finish(x, logit_rows, return_hidden)

    def finish(self, x: torch.Tensor, logit_rows: torch.Tensor | None, return_hidden: bool
               ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The final norm and the lm_head on the rows that need logits, from the last
        layer's output ``x`` [T, hidden] (see :meth:`forward`; the fused decode step of
        ``runtime.model.fused_step`` ends here too)."""
        c = self.config
        if logit_rows is not None:
            x = x.index_select(0, logit_rows)  # [N, hidden]
        x = rms_norm(x, self.final_norm, c.rms_norm_eps)  # [N, hidden]
        if x.shape[0] == 0:  # a step of prompt chunks only: no row needs logits
            logits = x.new_zeros((0, c.vocab_size), dtype=torch.float32)
            return (logits, x) if return_hidden else logits
        logits = self.lm_head(x).float()  # [N, vocab]
        return (logits, x) if return_hidden else logits
