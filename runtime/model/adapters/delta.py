"""LoRA deltas on the model's fused projections, for a batch whose rows use many adapters.

Owner: the model runner. :func:`fuse` turns a :class:`LoraAdapter` into one (A, B) pair
per fused projection of each layer, matching ``runtime.model.layers``:

* q/k/v is one projection ``[q; k; v]``: the adapters' A matrices are stacked
  (``A = [A_q; A_k; A_v]``, [r_q + r_k + r_v, hidden]) and B is block-diagonal
  ([(H + 2KVH) * D, r_q + r_k + r_v]), so one pair of matmuls gives all three deltas in the
  fused layout. gate/up likewise; o and down are single.
* the scale (``lora_alpha / r``) is folded into B;
* on an int8 model, SmoothQuant's factors (``runtime.model.quant``) are folded in too: the
  projections see ``x / s`` so A gets ``* s``, and the v and up rows of the fused output
  are stored ``/ s`` so those rows of B get ``/ s``. The LoRA itself stays fp32.

:class:`LoraBatch` applies them in one model call: the rows of each adapter (a segment,
contiguous when the batch is grouped, else an index) get ``out[rows] += (x[rows] @ A.T) @
B.T``, right after the fused projection, before RoPE. Base-model rows are untouched.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from runtime.model.adapters.peft import LoraAdapter

__all__ = ["FusedAdapter", "LoraBatch", "fuse"]

Pair = tuple[torch.Tensor, torch.Tensor]  # A [R, in], B [out, R], fp32
_GROUPS = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",),
           "gate_up": ("gate_proj", "up_proj"), "down": ("down_proj",)}


@dataclass(slots=True)
class FusedAdapter:
    """One adapter fused for one model: ``layers[i][name]`` for name in qkv/o/gate_up/down
    (absent when the adapter leaves that projection alone)."""

    key: int
    layers: list[dict[str, Pair]]


def _stack(adapter: LoraAdapter, layer: int, targets: tuple[str, ...],
           outs: list[int]) -> Pair | None:
    """Stack the A of ``targets`` and build their block-diagonal B (scale folded in)."""
    present = [(t, adapter.modules.get((layer, t))) for t in targets]
    if all(m is None for _, m in present):
        return None
    a_parts, cols = [], 0
    for _, m in present:
        if m is not None:
            a_parts.append(m[0])
            cols += m[0].shape[0]
    b = torch.zeros(sum(outs), cols, dtype=torch.float32)
    row = col = 0
    for (_, m), out in zip(present, outs, strict=True):
        if m is not None:
            r = m[0].shape[0]
            b[row:row + out, col:col + r] = m[1] * m[2]
            col += r
        row += out
    return torch.cat(a_parts).contiguous(), b


def fuse(adapter: LoraAdapter, model: object) -> FusedAdapter:
    """Fuse ``adapter`` for ``model`` (a :class:`runtime.model.model.Transformer`), on its
    device, folding an int8 model's smoothing factors (see the module docstring)."""
    c = model.config  # type: ignore[attr-defined]
    qd, kvd, inter, hd = (c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim,
                          c.intermediate_size, c.hidden_size)
    outs = {"qkv": [qd, kvd, kvd], "o": [hd], "gate_up": [inter, inter], "down": [hd]}
    device = model.device  # type: ignore[attr-defined]
    layers: list[dict[str, Pair]] = []
    for i, lw in enumerate(model.layers):  # type: ignore[attr-defined]
        fused: dict[str, Pair] = {}
        smooth = getattr(lw, "smoothing", None)  # int8: runtime.model.quant
        for name, targets in _GROUPS.items():
            pair = _stack(adapter, i, targets, outs[name])
            if pair is None:
                continue
            a, b = pair
            if smooth is not None:
                a = a * smooth[name + "_in"][None, :].float()
                if name == "qkv":
                    b[qd + kvd:] /= smooth["v_out"][:, None].float()
                elif name == "gate_up":
                    b[inter:] /= smooth["up_out"][:, None].float()
            fused[name] = (a.to(device).contiguous(), b.to(device).contiguous())
        layers.append(fused)
    return FusedAdapter(adapter.key, layers)


class LoraBatch:
    """The adapters of one model call: ``segments`` of rows, each with its adapter.

    Args:
        segments: ``(rows, adapter)`` with ``rows`` a slice (contiguous rows) or an int64
            index tensor, one entry per adapter present in the batch.
    """

    __slots__ = ("segments",)

    def __init__(self, segments: list[tuple[slice | torch.Tensor, FusedAdapter]]) -> None:
        self.segments = segments

    def apply(self, layer: int, name: str, x: torch.Tensor, out: torch.Tensor) -> None:
        """``out[rows] += (x[rows] @ A.T) @ B.T`` for every segment, in place.

        Args:
            layer: the layer index.
            name: ``qkv``, ``o``, ``gate_up`` or ``down``.
            x: Tensor[T, in], the projection's input.
            out: Tensor[T, out], the projection's output (any float dtype).
        """
        for rows, adapter in self.segments:
            pair = adapter.layers[layer].get(name)
            if pair is None:
                continue
            a, b = pair
            xs = x[rows]  # [n, in]
            delta = F.linear(F.linear(xs.to(a.dtype), a), b)  # [n, out] fp32
            if isinstance(rows, slice):
                out[rows].add_(delta.to(out.dtype))
            else:
                out.index_add_(0, rows, delta.to(out.dtype))
