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

__all__ = ["FusedAdapter", "LoraBatch", "StackedAdapters", "fuse", "stack"]

Pair = tuple[torch.Tensor, torch.Tensor]  # A [R, in], B [out, R], fp32
_GROUPS = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",),
           "gate_up": ("gate_proj", "up_proj"), "down": ("down_proj",)}


@dataclass(slots=True)
class FusedAdapter:
    """One adapter fused for one model: ``layers[i][name]`` for name in qkv/o/gate_up/down
    (absent when the adapter leaves that projection alone)."""

    key: int
    layers: list[dict[str, Pair]]
    # layers[i][name]'s blocks, one per target: (out_lo, out_hi, col_lo, col_hi) of B
    blocks: list[dict[str, list[Block]]]


Block = tuple[int, int, int, int]


def _blocks(adapter: LoraAdapter, layer: int, targets: tuple[str, ...],
            outs: list[int]) -> list[Block]:
    """Where each target's B sits in the block-diagonal B (empty columns: no module)."""
    blocks, row, col = [], 0, 0
    for t, out in zip(targets, outs, strict=True):
        m = adapter.modules.get((layer, t))
        r = 0 if m is None else m[0].shape[0]
        blocks.append((row, row + out, col, col + r))
        row, col = row + out, col + r
    return blocks


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
    blocks: list[dict[str, list[Block]]] = []
    for i, lw in enumerate(model.layers):  # type: ignore[attr-defined]
        fused: dict[str, Pair] = {}
        blocks.append({name: _blocks(adapter, i, targets, outs[name])
                       for name, targets in _GROUPS.items()})
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
    return FusedAdapter(adapter.key, layers, blocks)


@dataclass(slots=True)
class StackedAdapters:
    """Several fused adapters side by side, for a batch whose rows use all of them.

    ``layers[i][name] = (A_all [W, in], parts)``: the A rows of every adapter, grouped by
    target then adapter; each part ``(out_lo, out_hi, col_lo, col_hi, B [out, w])`` is one
    target's B for every adapter (no block-diagonal zeros: the decode batch that uses this
    is bound by the bytes it reads). ``spans[name][j]``: the columns of adapter ``j``.
    """

    keys: tuple[int, ...]
    layers: list[dict[str, tuple[torch.Tensor, list[tuple[int, int, int, int, torch.Tensor]]]]]
    spans: dict[str, list[list[tuple[int, int]]]]


def stack(adapters: list[FusedAdapter]) -> StackedAdapters:
    """Lay ``adapters`` side by side (a copy of their weights; see :class:`LoraBatch`)."""
    num_layers = len(adapters[0].layers)
    layers: list[dict] = [{} for _ in range(num_layers)]
    spans: dict[str, list[list[tuple[int, int]]]] = {}
    for name, targets in _GROUPS.items():
        # widths[t][j]: adapter j's widest rank for target t over the layers
        widths = [[max(f.blocks[i][name][t][3] - f.blocks[i][name][t][2]
                       for i in range(num_layers)) for f in adapters]
                  for t in range(len(targets))]
        if not any(any(w) for w in widths):
            continue
        starts: list[list[int]] = []
        col = 0
        for t in range(len(targets)):
            starts.append([])
            for j in range(len(adapters)):
                starts[t].append(col)
                col += widths[t][j]
        total = col
        spans[name] = [[(starts[t][j], starts[t][j] + widths[t][j])
                        for t in range(len(targets)) if widths[t][j]]
                       for j in range(len(adapters))]
        for i in range(num_layers):
            pairs = [f.layers[i].get(name) for f in adapters]
            some = next((p for p in pairs if p is not None), None)
            if some is None:
                continue
            a_all = some[0].new_zeros(total, some[0].shape[1])  # [W, in]
            parts = []
            for t in range(len(targets)):
                out_lo, out_hi = adapters[0].blocks[i][name][t][:2]
                lo, hi = starts[t][0], starts[t][-1] + widths[t][-1]
                if hi == lo:
                    continue
                b_t = some[1].new_zeros(out_hi - out_lo, hi - lo)  # [out_t, w_t]
                for j, (f, pair) in enumerate(zip(adapters, pairs, strict=True)):
                    _, _, c_lo, c_hi = f.blocks[i][name][t]
                    if pair is None or c_hi == c_lo:
                        continue
                    st = starts[t][j]
                    a_all[st:st + c_hi - c_lo] = pair[0][c_lo:c_hi]
                    b_t[:, st - lo:st - lo + c_hi - c_lo] = pair[1][out_lo:out_hi, c_lo:c_hi]
                parts.append((out_lo, out_hi, lo, hi, b_t))
            layers[i][name] = (a_all, parts)
    return StackedAdapters(tuple(f.key for f in adapters), layers, spans)


class LoraBatch:
    """The adapters of one model call.

    Two ways, chosen by the runner; both add ``(x[rows] @ A.T) @ B.T`` to each adapter's
    rows, right after the projection:

    * by segment: per adapter, a slice (contiguous rows) or an index tensor; two small
      matmuls per adapter per projection. For one adapter, or many rows (prefill);
    * stacked: the batch's adapters side by side (:func:`stack`, cached by the runner),
      ``out += ((x @ A_all.T) * mask) @ B_all.T`` where ``mask`` [T, W] keeps each row's
      own adapter's columns. Three ops per projection whatever the number of adapters, at
      the cost of ``T x W`` extra products: for decode batches of many adapters.

    Args:
        segments: ``(rows, adapter)``, one entry per adapter present in the batch.
        stacked: the stacked adapters, in the order of ``segments``, or None.
        num_rows: the batch's rows (for the stacked masks).
        device: where the model runs (the masks go there).
    """

    __slots__ = ("segments", "stacked", "_masks")

    def __init__(self, segments: list[tuple[slice | torch.Tensor, FusedAdapter]],
                 stacked: StackedAdapters | None = None, num_rows: int = 0,
                 device: torch.device | None = None) -> None:
        self.segments = segments
        self.stacked = stacked
        self._masks: dict[str, torch.Tensor] = {}
        if stacked is not None:
            for name, spans in stacked.spans.items():
                width = max(hi for cols in spans for _, hi in cols)
                mask = torch.zeros(num_rows, width, dtype=torch.float32)  # [T, W]
                for (rows, _), cols in zip(segments, spans, strict=True):
                    sel = rows if isinstance(rows, slice) else rows.cpu()
                    for lo, hi in cols:
                        mask[sel, lo:hi] = 1.0
                self._masks[name] = mask.to(device)

    def apply(self, layer: int, name: str, x: torch.Tensor, out: torch.Tensor) -> None:
        """Add the LoRA deltas of projection ``name`` of ``layer`` to its rows, in place.

        Args:
            layer: the layer index.
            name: ``qkv``, ``o``, ``gate_up`` or ``down``.
            x: Tensor[T, in], the projection's input.
            out: Tensor[T, out], the projection's output (any float dtype).
        """
        if self.stacked is not None:
            entry = self.stacked.layers[layer].get(name)
            if entry is not None:
                a, parts = entry
                xa = F.linear(x.to(a.dtype), a).mul_(self._masks[name])  # [T, W] fp32
                for out_lo, out_hi, lo, hi, b in parts:
                    view = out[:, out_lo:out_hi]  # [T, out_t]
                    if out.dtype == a.dtype:
                        view.addmm_(xa[:, lo:hi], b.t())
                    else:
                        view.add_(F.linear(xa[:, lo:hi], b).to(out.dtype))
            return
        for rows, adapter in self.segments:
            pair = adapter.layers[layer].get(name)
            if pair is None:
                continue
            a, b = pair
            xa = F.linear(x[rows].to(a.dtype), a)  # [n, R] fp32
            if not isinstance(rows, slice):
                out.index_add_(0, rows, F.linear(xa, b).to(out.dtype))
            elif out.dtype == a.dtype:
                out[rows].addmm_(xa, b.t())  # the second matmul adds in place: no temporary
            else:  # bf16/fp16 model: the fp32 delta is rounded once, as it is added
                out[rows].add_(F.linear(xa, b).to(out.dtype))
