"""Put a model's projections, lm_head and embedding on GGUF blocks (``weights="gguf"``).

Owner: the model runner, once at load, on a model built in float. With the blocks of the
GGUF the model was converted from (``runtime.model.loader.load_blocks``) every matrix the
file stores in a format computed as stored (``runtime.model.formats``: Q4_0, Q4_1, Q5_0,
Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) runs on those blocks as they are (a fused qkv or gate_up
stacks its parts' blocks; parts no one weight holds together, other formats and matrices
the file stores as floats stay float). A model loaded with ``load_model(..., blocks=True)``
already holds those weights (its projections were built on them, never in float); they are
kept. Without a GGUF (a Hugging Face folder) the float weights are quantized here as
llama.cpp's Q4_1 files are: the projections to Q4_1, the embedding table (and lm_head) to
Q8_0.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from pie_ctx.proto.errors import InvalidArgument
from runtime.kv import hugepages
from runtime.model.blocks import (
    GROUP,
    BlockEmbedding,
    BlockWeight,
    StripBlocks,
    int8_activations,
    outlier_channels,
)
from runtime.model.formats import GGUFWeight, cat_weights
from runtime.model.matmul import Projection
from runtime.model.quant import calibrate

__all__ = ["use_blocks", "quantize_q8_0"]

# projections whose blocks_q8 activations are rounded in two levels (StripBlocks.levels)
TWO_LEVEL_KINDS = {"down": 2}

_PARTS = {
    "qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "o_proj": ("self_attn.o_proj",),
    "gate_up": ("mlp.gate_proj", "mlp.up_proj"),
    "down": ("mlp.down_proj",),
}


def quantize_q8_0(weight: torch.Tensor) -> BlockWeight:
    """Q8_0 blocks of a float ``weight`` [out, in] (llama.cpp's reference quantizer:
    ``d = max|w| / 127`` per group of 32, ``q = round(w / d)``)."""
    out_f, in_f = weight.shape
    g = weight.detach().float().reshape(out_f, in_f // GROUP, GROUP)
    d = g.abs().amax(dim=2) / 127
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    q = torch.round(g * inv[..., None]).clamp_(-127, 127).to(torch.int8).reshape(out_f, in_f)
    return BlockWeight(8, q.contiguous(), d.to(torch.float16), torch.empty(0, dtype=torch.float16),
                       out_f, in_f, "Q8_0")


def _fused(blocks: dict[str, GGUFWeight], layer: int, kind: str) -> GGUFWeight | None:
    parts = [blocks.get(f"model.layers.{layer}.{p}.weight") for p in _PARTS[kind]]
    if any(p is None for p in parts):
        return None
    return parts[0] if len(parts) == 1 else cat_weights(parts)  # type: ignore[arg-type]


def use_blocks(model: Any, blocks: dict[str, GGUFWeight] | None,
               calibration: list[int] | None = None) -> None:
    """Replace ``model``'s float projections, lm_head and embedding with block weights, in
    place (see the module docstring); their kernels are chosen after, and the chosen
    ``blocks_q8`` strips moved onto huge pages (``runtime.model.numerics.finish_weights``).

    Args:
        model: a :class:`runtime.model.model.Transformer` built in float, on CPU.
        blocks: HF-named block weights of its GGUF (``{}`` when the model was built on
            them already); None: quantize the float weights now.
        calibration: token ids (``runtime.model.quant.calibration_tokens``) whose dense pass
            picks the input channels ``blocks_q8`` keeps out of its rounding (every
            projection and the lm_head); None, or ``blocks_q8`` off: no pass, no split.

    Raises:
        InvalidArgument: the model is not on CPU or not float.
    """
    if model.device.type != "cpu":
        raise InvalidArgument("weights='gguf' runs on CPU; on a GPU use dtype bfloat16")
    if model.weight_format != "fp32":
        raise InvalidArgument(f"the model is already {model.weight_format}")
    chosen: list[dict[str, GGUFWeight | None]] = []
    for i, lw in enumerate(model.layers):
        layer: dict[str, GGUFWeight | None] = {}
        for kind in _PARTS:
            proj: Projection = getattr(lw, kind)
            if proj.is_blocks:  # built on the file's blocks (load_model(blocks=True))
                layer[kind] = proj.weight  # type: ignore[assignment]
            else:
                layer[kind] = (_fused(blocks, i, kind) if blocks is not None
                               else BlockWeight.quantize_q4_1(proj.weight))  # type: ignore[arg-type]
        chosen.append(layer)
    built = model.embed.table if isinstance(model.embed, BlockEmbedding) else None
    tied = model.lm_head.weight is model.embed or (
        built is not None and model.lm_head.weight is built)
    if blocks is not None:
        table = built if built is not None else blocks.get("model.embed_tokens.weight")
        head = (table if tied else model.lm_head.weight if model.lm_head.is_blocks
                else blocks.get("lm_head.weight"))
    else:
        table = quantize_q8_0(model.embed)
        head = table if tied else quantize_q8_0(model.lm_head.weight)
    layer_amax, head_amax = [], None
    # the outlier channels serve blocks_q8 (legacy blocks) only: kquant_q8 has no split, so
    # a file all in K-quants skips the pass (~15 s of a 1B model's first load)
    legacy = any(isinstance(w, BlockWeight) for layer in chosen for w in layer.values()) \
        or isinstance(head, BlockWeight)
    if calibration and legacy and int8_activations():
        # on the float weights; kept per machine (runtime.model.quant.calibrate)
        layer_amax, head_amax = calibrate(model, calibration)
    for i, (lw, layer) in enumerate(zip(model.layers, chosen, strict=True)):
        for kind, w in layer.items():
            if w is not None:
                proj = getattr(lw, kind)
                # blocks_q8 keeps every projection's (and the lm_head's) largest input
                # channels out of its rounding: qkv and gate_up alone reached greedy
                # agreement 0.982 in simulation, all 0.989 (docs/performance.md)
                outliers = outlier_channels(layer_amax[i][kind]) if layer_amax else None
                # down_proj's inputs (SiLU(gate) * up, heavy-tailed within a group) take
                # blocks_q8's rounding in two levels: one level left greedy agreement
                # 0.969-0.975 vs fp32, two reach ~0.985 (docs/performance.md)
                setattr(lw, kind, Projection(w, proj.bias, outliers=outliers,
                                             act_levels=TWO_LEVEL_KINDS.get(kind, 1)))
    if head is not None:
        model.lm_head = Projection(head, buckets=2, outliers=(
            outlier_channels(head_amax) if head_amax is not None else None))
    if table is not None:
        model.embed = BlockEmbedding(table, model.dtype)  # type: ignore[arg-type]
    model.weight_format = "gguf"


_ALIGN = 64  # each tensor of the arena starts on a cache line (and any element size)


def _room(t: torch.Tensor) -> int:
    """Bytes ``t`` takes in the arena: its own, rounded up to ``_ALIGN``."""
    return -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN


def strips_on_huge_pages(projections: list[Projection]) -> int:
    """Move the ``blocks_q8`` strips of ``projections`` (quants, scales, minimums: what a
    decode step streams, ~100 MB a step for SmolLM2's Q4_1 with its Q8_0 lm_head) into one
    arena on transparent huge pages (``runtime.kv.hugepages``), and route the kernels to the
    moved copies.

    One arena, because a layer's strips (~0.6 MB) are smaller than one 2 MiB page: apart,
    each would stay on 4 KiB pages and cost a TLB miss every 4 KiB of the stream. Same
    values, same kernels: only the addresses change. Call once the kernels are chosen;
    returns the arena's bytes (0: no strips)."""
    owners = [(p, s) for p in projections
              if isinstance(s := p.layout("blocks_q8"), StripBlocks)]
    parts = [t for _, s in owners for t in (s.qs, s.d, s.m) if t.numel()]
    if not parts:
        return 0
    arena = hugepages.zeros((sum(map(_room, parts)),), torch.uint8, parts[0].device)
    at = 0

    def place(t: torch.Tensor) -> torch.Tensor:
        nonlocal at
        if not t.numel():
            return t
        moved = arena[at:at + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
        moved.copy_(t)
        at += _room(t)
        return moved

    for p, s in owners:
        p.move_layout("blocks_q8", dataclasses.replace(s, qs=place(s.qs), d=place(s.d),
                                                       m=place(s.m)))
    return arena.numel()
