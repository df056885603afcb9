"""Decoder-layer weights (fused at load) and the stateless layer math.

Owner: the model runner. Weights arrive as ``dict[str, Tensor]`` in Hugging Face naming
(``model.layers.{i}.self_attn.q_proj.weight`` ...). At load they are fused so that a
layer runs one q/k/v matmul and one gate/up matmul; the originals are not kept.

A matrix may also arrive as a GGUF block weight (``runtime.model.gguf_weights``, from
``load_model(..., blocks=True)``): a fused projection whose parts are all block weights
that stack (:meth:`cat`) is built on them, never in float; parts that do not stack (mixed
formats) are dequantized and fused in float.

Invariants: every float tensor in a :class:`LayerWeights` lives on the runner's device in
the compute dtype; the fused q/k/v weight stacks rows as ``[q (H*D); k (KVH*D); v (KVH*D)]``,
and the fused gate/up weight as ``[gate (I); up (I)]``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from pie_ctx.proto.errors import ModelError
from runtime.model import kernels
from runtime.model.config import ModelConfig
from runtime.model.formats import cat_weights
from runtime.model.matmul import Projection

__all__ = ["LayerWeights", "fuse_layer", "is_block_weight", "rms_norm", "swiglu_mlp",
           "take_weight"]


@dataclass(slots=True)
class LayerWeights:
    """One decoder layer, fused for speed. Shapes use H heads, KVH kv heads, D head_dim."""

    input_norm: torch.Tensor  # [hidden]
    qkv: Projection  # weight [(H + 2*KVH) * D, hidden], bias [(H + 2*KVH) * D] or None
    o_proj: Projection  # weight [hidden, H * D], bias [hidden] or None
    q_norm: torch.Tensor | None  # [D] (Qwen3)
    k_norm: torch.Tensor | None  # [D] (Qwen3)
    post_norm: torch.Tensor  # [hidden]
    gate_up: Projection  # weight [2 * intermediate, hidden]
    down: Projection  # weight [hidden, intermediate]
    # int8 only: SmoothQuant's factors (runtime.model.quant), which LoRA deltas fold in
    smoothing: dict[str, torch.Tensor] | None = None

    def norms(self) -> list[torch.Tensor]:
        """The layer's norm weights (its projections count their own bytes)."""
        return [t for t in (self.input_norm, self.post_norm, self.q_norm, self.k_norm)
                if t is not None]


def is_block_weight(t: object) -> bool:
    """Whether a checkpoint entry is a GGUF block weight rather than a float tensor."""
    return t is not None and not isinstance(t, torch.Tensor)


def take_weight(
    weights: Mapping[str, Any],
    name: str,
    shape: tuple[int, ...],
    device: torch.device,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Fetch one checkpoint tensor, checking its shape, on ``device`` in ``dtype``.

    Raises:
        ModelError: the tensor is missing or has the wrong shape.
    """
    t = weights.get(name)
    if t is None:
        raise ModelError(f"checkpoint is missing tensor {name!r}")
    if is_block_weight(t):  # a block weight wanted in float: the file's values exactly
        t = t.dequantize()
    if tuple(t.shape) != shape:
        raise ModelError(f"checkpoint tensor {name!r} has shape {tuple(t.shape)}, expected {shape}")
    return t.detach().to(device=device, dtype=dtype)


def _optional(
    weights: Mapping[str, Any], name: str, shape: tuple[int, ...],
    device: torch.device, dtype: torch.dtype,
) -> torch.Tensor | None:
    return take_weight(weights, name, shape, device, dtype) if name in weights else None


def _stacked(weights: Mapping[str, Any], parts: list[tuple[str, tuple[int, int]]]) -> Any:
    """The block weights ``parts`` (name, shape) stacked along their rows, or None unless
    every part is a block weight of its shape and they stack."""
    got = [weights.get(name) for name, _ in parts]
    if not all(is_block_weight(w) for w in got):
        return None
    for w, (name, shape) in zip(got, parts, strict=True):
        if (w.out_features, w.in_features) != shape:
            raise ModelError(f"checkpoint tensor {name!r} has shape "
                             f"{(w.out_features, w.in_features)}, expected {shape}")
    return got[0] if len(got) == 1 else cat_weights(got)


def fuse_layer(
    config: ModelConfig,
    weights: Mapping[str, Any],
    index: int,
    device: torch.device,
    dtype: torch.dtype,
    pack: bool = False,
) -> LayerWeights:
    """Build the fused weights of layer ``index`` from HF-named tensors.

    ``pack`` keeps oneDNN-packed copies of the projections (``runtime.model.matmul``).

    Raises:
        ModelError: a required tensor is missing or mis-shaped.
    """
    c = config
    p = f"model.layers.{index}."
    hd, qd, kvd = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim

    def w(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        return take_weight(weights, p + name, shape, device, dtype)

    def matrix(parts: list[tuple[str, tuple[int, int]]]) -> Any:
        """The fused weight of ``parts``: on their blocks when they stack, else float."""
        blocks = _stacked(weights, [(p + name, shape) for name, shape in parts])
        if blocks is not None:
            return blocks
        return torch.cat([w(name, shape) for name, shape in parts]).contiguous()

    qkv = matrix([("self_attn.q_proj.weight", (qd, hd)), ("self_attn.k_proj.weight", (kvd, hd)),
                  ("self_attn.v_proj.weight", (kvd, hd))])
    qkv_bias = None
    if c.attention_bias:
        qkv_bias = torch.cat([
            w("self_attn.q_proj.bias", (qd,)),
            w("self_attn.k_proj.bias", (kvd,)),
            w("self_attn.v_proj.bias", (kvd,)),
        ]).contiguous()
    q_norm = k_norm = None
    if c.qk_norm:
        q_norm = w("self_attn.q_norm.weight", (c.head_dim,))
        k_norm = w("self_attn.k_norm.weight", (c.head_dim,))
    gate_up = matrix([("mlp.gate_proj.weight", (c.intermediate_size, hd)),
                      ("mlp.up_proj.weight", (c.intermediate_size, hd))])
    return LayerWeights(
        input_norm=w("input_layernorm.weight", (hd,)),
        qkv=Projection(qkv, qkv_bias, pack=pack),
        o_proj=Projection(matrix([("self_attn.o_proj.weight", (hd, qd))]),
                          _optional(weights, p + "self_attn.o_proj.bias", (hd,), device, dtype),
                          pack=pack),
        q_norm=q_norm,
        k_norm=k_norm,
        post_norm=w("post_attention_layernorm.weight", (hd,)),
        gate_up=Projection(gate_up, pack=pack),
        down=Projection(matrix([("mlp.down_proj.weight", (hd, c.intermediate_size))]),
                        pack=pack),
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, statistics in fp32 (as HF Llama/Qwen do).

    Args:
        x: Tensor[..., d].
        weight: Tensor[d].
        eps: variance epsilon.

    Returns:
        Tensor[..., d] in ``x.dtype``.
    """
    ops = kernels.ops()
    if ops is not None and x.dim() == 2 and x.dtype == weight.dtype == torch.float32 \
            and x.stride(1) == 1 and x.device.type == "cpu":
        return ops.rms_norm(x, weight, eps)  # one pass (runtime.model.kernels)
    normed = F.rms_norm(x.float(), (x.shape[-1],), eps=eps)  # [..., d] fp32
    return weight * normed.to(x.dtype)


def swiglu_mlp(x: torch.Tensor, layer: LayerWeights,
               delta: Callable[[str, torch.Tensor, torch.Tensor], None] | None = None
               ) -> torch.Tensor:
    """``down(silu(gate(x)) * up(x))`` with one fused gate/up matmul.

    Args:
        x: Tensor[T, hidden].
        layer: the layer's fused weights.
        delta: adds LoRA deltas in place, ``delta(name, input, output)`` after the
            ``gate_up`` and ``down`` projections (``runtime.model.adapters.LoraBatch``).

    Returns:
        Tensor[T, hidden].
    """
    gu = layer.gate_up(x)  # [T, 2I]
    if delta is not None:
        delta("gate_up", x, gu)
    ops = kernels.ops()
    if ops is not None and gu.dtype == torch.float32 and gu.stride(1) == 1 \
            and gu.device.type == "cpu":
        inner = ops.silu_mul(gu)  # one pass (runtime.model.kernels)
    else:
        inter = gu.shape[-1] // 2
        inner = F.silu(gu[:, :inter]).mul_(gu[:, inter:])  # [T, I]
    out = layer.down(inner)  # [T, hidden]
    if delta is not None:
        delta("down", inner, out)
    return out
