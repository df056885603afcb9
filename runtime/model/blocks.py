"""Weights kept in a GGUF file's own block formats (``weights="gguf"``): Q4_0, Q4_1, Q5_0,
Q5_1, Q8_0.

Owner: the model's projections, lm_head and embedding table when the model runs on the
blocks its GGUF stores (or, for a Hugging Face folder, on Q4_1 blocks made at load).
:class:`BlockWeight` holds one weight matrix as the file's bytes, regrouped into three
arrays (quants, scales, minimums) so the kernel reads them with aligned vector loads:

* Q4_1: a scale ``d`` and a minimum ``m`` (float16) per group of 32, 4-bit ``q``:
  ``w = q * d + m``;
* Q4_0: ``w = (q - 8) * d``: stored as Q4_1 with ``m = -8 d`` (exact in float16, and
  ``q * d - 8 d`` rounds to the same float32 as ``(q - 8) * d``);
* Q5_1: as Q4_1 with 5-bit ``q`` (the file's 4-byte ``qh`` holds each weight's 5th bit);
* Q5_0: ``w = (q - 16) * d`` with 5-bit ``q``: stored without minimums (the kernels form
  ``q * d - 16 d``, the same float32 value), so it reads the file's 5.5 bits a weight, and
  Q5_1 its 6 (the blocks' bytes regrouped, none added: the int8-activation layout's 5th bits
  become one 64-bit mask per 64 quant bytes, as many bytes as ``qh``);
* Q8_0: ``w = q * d`` with 8-bit ``q``.

The product (``runtime/model/kernels/block_mm.cpp``) forms each weight in float32 exactly as
ggml dequantizes it, then multiplies fp32 activations: the computed weights are the file's
dequantized values bit for bit, and the activations are not rounded at all. Without the
compiled kernels the same weights are dequantized per call and go through ``F.linear``.

:class:`Int4Weight` is the same 4-bit weight in the layout of torch's groupwise int4 CPU
kernel, made only where bf16 scales and zeros hold it exactly (``runtime.model.matmul``
offers it as a kernel candidate then).

:class:`StripBlocks` is the same weight laid out for the int8-activation kernel
(``blocks_q8``, llama.cpp's way): each activation row is rounded per group of 32 to int8
with a scale (:func:`round_activations` is its eager twin), and each block's product is an
integer dot (AVX-512 VNNI), scaled in fp32. The weights stay the file's; only the
activations are rounded (down_proj's in two levels: the first level's error rounded again,
``StripBlocks.levels``).

Other formats are not this family's: ``runtime.model.formats`` sends a file's K-quants to
``runtime.model.kquants`` and has the rest dequantized at load. A Hugging Face folder is quantized at load with llama.cpp's reference
Q4_1 quantizer (:meth:`BlockWeight.quantize_q4_1`); docs/performance.md gives its cost.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch

from pie_ctx.proto.errors import ModelError
from runtime.model import kernels

__all__ = ["BLOCK_FORMATS", "BlockWeight", "BlockEmbedding", "GROUP", "Int4Weight",
           "StripBlocks", "int8_activations", "outlier_channels", "round_activations"]

GROUP = 32  # weights per block in every supported format
BLOCK_FORMATS = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q8_0": 34}
# bytes of a block of 32 in BlockWeight.qs, by bits (5 bits: ggml's qh, then the nibbles)
_QS_BYTES = {4: 16, 5: 20, 8: 32}
Q5_0_OFFSET = 16  # Q5_0's w = (q - 16) * d
# Read once; the int8-activation kernel joins the choice unless PIE_CTX_BLOCKS_Q8=0. With its
# outlier split it meets the quality gates (greedy agreement 0.9891, +0.08% ppl;
# docs/performance.md); off, the block projections keep fp32 activations, the file's model.
INT8_ACTIVATIONS = os.environ.get("PIE_CTX_BLOCKS_Q8", "1").lower() in (
    "1", "true", "yes", "on")
OUTLIERS = 8  # input channels a norm-fed projection keeps out of blocks_q8's rounding
TWO_LEVELS = 256  # added to block_mm_q8's ``bits``: activations rounded in two levels


@dataclass(frozen=True, slots=True)
class BlockWeight:
    """One weight [out_features, in_features] in GGUF blocks of 32 along ``in_features``.

    Fields:
        bits: 4 (Q4_0 / Q4_1), 5 (Q5_0 / Q5_1) or 8 (Q8_0).
        qs: uint8 [out, in / 2] (4 bits, ggml's nibble order), uint8 [out, in / 32 * 20]
            (5 bits: each block's 4 bytes of ``qh``, then its 16 bytes of nibbles) or int8
            [out, in] (8 bits).
        d: float16 [out, in / 32] scales.
        m: float16 [out, in / 32] minimums (4 bits, Q4_0 with ``-8 d``; Q5_1), empty for
            Q5_0 (``-16 d``, formed by the kernels) and 8 bits.
        source: the format it came from (``"Q4_0"``, ``"Q4_1"``, ``"Q5_0"``, ...).
    """

    bits: int
    qs: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor
    out_features: int
    in_features: int
    source: str

    # ------------------------------------------------------------------ building

    @classmethod
    def from_gguf(cls, raw: np.ndarray, kind: str, shape: tuple[int, int]) -> BlockWeight:
        """The weight of a GGUF tensor's raw bytes ``raw`` (uint8, [out, row bytes]).

        Raises:
            ModelError: ``kind`` is not a supported block format, or the bytes do not fit.
        """
        if kind not in _BLOCK_BYTES:
            raise ModelError(f"GGUF block format {kind} is not supported by weights='gguf' "
                             f"(it runs {', '.join(BLOCK_FORMATS)}); use --weights fp32 or "
                             "int8, which dequantize the file at load")
        out_f, in_f = shape
        nb = in_f // GROUP
        if in_f % GROUP or raw.size != out_f * nb * _BLOCK_BYTES[kind]:
            raise ModelError(f"GGUF {kind} tensor of shape {shape} has {raw.size} bytes; the "
                             "file is corrupt")
        blocks = torch.from_numpy(np.array(raw, dtype=np.uint8).reshape(out_f, nb, -1))
        d = blocks[:, :, 0:2].contiguous().view(torch.float16).reshape(out_f, nb)
        if kind == "Q8_0":
            qs = blocks[:, :, 2:].contiguous().view(torch.int8).reshape(out_f, in_f)
            return cls(8, qs, d, torch.empty(0, dtype=torch.float16), out_f, in_f, kind)
        if kind == "Q5_0":  # d, qh, qs: the minimum -16 d is left to the kernels
            qs = blocks[:, :, 2:].reshape(out_f, nb * 20).contiguous()
            return cls(5, qs, d, torch.empty(0, dtype=torch.float16), out_f, in_f, kind)
        if kind == "Q5_1":  # d, m, qh, qs
            m = blocks[:, :, 2:4].contiguous().view(torch.float16).reshape(out_f, nb)
            return cls(5, blocks[:, :, 4:].reshape(out_f, nb * 20).contiguous(), d, m, out_f,
                       in_f, kind)
        if kind == "Q4_1":
            m = blocks[:, :, 2:4].contiguous().view(torch.float16).reshape(out_f, nb)
            qs = blocks[:, :, 4:].reshape(out_f, nb * 16).contiguous()
        else:  # Q4_0: (q - 8) d == q d + (-8 d), and -8 d is exact in float16
            m = (d.float() * -8).to(torch.float16)
            qs = blocks[:, :, 2:].reshape(out_f, nb * 16).contiguous()
        return cls(4, qs, d, m, out_f, in_f, kind)

    @classmethod
    def quantize_q4_1(cls, weight: torch.Tensor) -> BlockWeight:
        """Q4_1 blocks of a float ``weight`` [out, in] (llama.cpp's reference quantizer:
        ``d = (max - min) / 15``, ``m = min`` per group of 32, ``q = round((w - min) / d)``).

        Raises:
            ModelError: ``in`` is not a multiple of 32.
        """
        out_f, in_f = weight.shape
        if in_f % GROUP:
            raise ModelError(f"a weight with {in_f} input features cannot be split into groups "
                             f"of {GROUP}; use --weights fp32 or int8 for this model")
        g = weight.detach().float().reshape(out_f, in_f // GROUP, GROUP)
        lo, hi = g.amin(dim=2), g.amax(dim=2)
        d = (hi - lo) / 15
        inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
        q = ((g - lo[..., None]) * inv[..., None] + 0.5).to(torch.int32).clamp_(0, 15)
        packed = (q[..., :16] | (q[..., 16:] << 4)).to(torch.uint8).reshape(out_f, in_f // 2)
        return cls(4, packed.contiguous(), d.to(torch.float16), lo.to(torch.float16), out_f,
                   in_f, "Q4_1")

    @staticmethod
    def cat(parts: list[BlockWeight]) -> BlockWeight | None:
        """The weights stacked along the output rows (a fused qkv / gate_up), or None when
        their bit widths differ (the caller keeps that projection in float). Q5_0 beside
        Q5_1 gets its minimums ``-16 d`` stored (:meth:`minimums`)."""
        if len({p.bits for p in parts}) != 1 or len({p.in_features for p in parts}) != 1:
            return None
        first = parts[0]
        m = first.m
        if any(p.m.numel() for p in parts):
            m = torch.cat([p.m if p.m.numel() else p.minimums() for p in parts])
        kinds = sorted({p.source for p in parts})
        return BlockWeight(first.bits, torch.cat([p.qs for p in parts]),
                           torch.cat([p.d for p in parts]), m,
                           sum(p.out_features for p in parts), first.in_features,
                           "+".join(kinds))

    def take_rows(self, index: torch.Tensor) -> BlockWeight:
        """The weight of output rows ``index`` (Q/K row un-permutation, tensor-parallel
        shards)."""
        return BlockWeight(self.bits, self.qs[index].contiguous(), self.d[index].contiguous(),
                           self.m[index].contiguous() if self.m.numel() else self.m,
                           int(index.numel()), self.in_features, self.source)

    # ------------------------------------------------------------------ reading

    @property
    def nbytes(self) -> int:
        """Bytes a product reads: quants and float16 scales (and minimums)."""
        return self.qs.numel() + 2 * self.d.numel() + 2 * self.m.numel()

    @property
    def device(self) -> torch.device:
        return self.qs.device

    def minimums(self) -> torch.Tensor:
        """float16 [out, in / 32]: ``m`` as stored, or Q5_0's ``-16 d`` (exact in float16
        while ``16 |d|`` is within its range, as for any weight a quantizer writes).

        Raises:
            ModelError: a Q5_0 scale whose ``-16 d`` float16 cannot hold.
        """
        if self.m.numel():
            return self.m
        if self.bits != 5:
            raise RuntimeError(f"{self.source} weights have no minimums")
        m = self.d.float() * -Q5_0_OFFSET
        if not torch.isfinite(m.to(torch.float16)).all():
            raise ModelError(f"a {self.source} scale of 4096 or more cannot be stored beside "
                             "Q5_1 blocks; use --weights fp32 or int8 for this model")
        return m.to(torch.float16)

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """float32 [R, in] weights of output ``rows`` (None: all): ggml's values exactly."""
        index = rows if rows is not None else torch.arange(self.out_features)
        ops = kernels.block_ops()
        if ops is not None:
            return ops.block_rows(self.qs, self.d, self.m, self.bits, index)
        qs, d = self.qs[index], self.d[index].float()
        nb = self.in_features // GROUP
        if self.bits == 8:
            q = qs.view(-1, nb, GROUP).float()
            return (q * d[..., None]).reshape(-1, self.in_features)
        blk = qs.view(-1, nb, _QS_BYTES[self.bits])
        b = blk[..., -16:].to(torch.int32)
        q = torch.cat([b & 15, b >> 4], dim=2)  # element j, then j + 16
        if self.bits == 5:  # bit j of the little-endian qh: element j's 5th bit
            qh = blk[..., :4].contiguous().view(torch.int32)  # [R, nb, 1]
            q = q | (((qh >> torch.arange(GROUP, dtype=torch.int32)) & 1) << 4)
        m = self.m[index].float() if self.m.numel() else d * -Q5_0_OFFSET
        # q * d is exact in float32, so one rounding of the sum, as ggml's q * d + m
        return (q.float() * d[..., None] + m[..., None]).reshape(-1, self.in_features)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """float32 ``x`` [M, in] @ W.T -> [M, out] (the compiled kernel, or the eager twin)."""
        ops = kernels.block_ops()
        if ops is not None and x.device.type == "cpu":
            return ops.block_mm(x if x.stride(-1) == 1 else x.contiguous(), self.qs, self.d,
                                self.m, self.bits)
        return torch.nn.functional.linear(x, self.dequantize())


@dataclass(frozen=True, slots=True)
class BlockEmbedding:
    """An embedding table in GGUF blocks: the rows looked up are dequantized (exactly)."""

    table: BlockWeight  # [vocab, hidden]
    dtype: torch.dtype = torch.float32

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        """Tensor[T] ids -> Tensor[T, hidden] in ``dtype``."""
        return self.table.dequantize(tokens.to(torch.int64)).to(self.dtype)


@dataclass(frozen=True, slots=True)
class Int4Weight:
    """A 4-bit weight in the layout of torch's groupwise int4 CPU kernel.

    ``y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), packed,
    group_size, scales_and_zeros)`` computes ``x @ W.T`` with ``W = (q - 8) * scale + zero``
    per group of ``group_size`` inputs, in bf16 (then cast back to the compute dtype).
    """

    packed: torch.Tensor  # from _convert_weight_to_int4pack_for_cpu
    scales_and_zeros: torch.Tensor  # bf16 [in / group_size, out, 2]
    group_size: int
    out_features: int
    in_features: int

    @staticmethod
    def _scales_and_zeros(w: BlockWeight) -> torch.Tensor | None:
        if w.bits != 4 or w.out_features % 16:  # (the packing takes N in 16s)
            return None
        d, zero = w.d.float(), w.m.float() + 8 * w.d.float()  # q d + m = (q - 8) d + zero
        sz = torch.stack([d.t(), zero.t()], dim=2)  # [nb, out, 2]
        if not torch.equal(sz.to(torch.bfloat16).float(), sz) or not torch.equal(
                zero - 8 * d, w.m.float()):
            return None
        return sz

    @classmethod
    def fits(cls, w: BlockWeight) -> bool:
        """Whether bf16 scales and zeros hold ``w``'s weights exactly (a GGUF's float16
        scales in general do not) and its shape suits the kernel (out in 16s)."""
        return cls._scales_and_zeros(w) is not None

    @classmethod
    def from_blocks(cls, w: BlockWeight) -> Int4Weight | None:
        """The same weights as the 4-bit ``w``, or None where they do not :meth:`fit`."""
        sz = cls._scales_and_zeros(w)
        if sz is None:
            return None
        b = w.qs.view(w.out_features, -1, 16).to(torch.int32)
        q = torch.cat([b & 15, b >> 4], dim=2).reshape(w.out_features, w.in_features)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.contiguous(), 1)
        return cls(packed, sz.to(torch.bfloat16).contiguous(), GROUP, w.out_features,
                   w.in_features)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), self.packed,
                                                       self.group_size, self.scales_and_zeros)
        return y.to(x.dtype)


def _fifth_bit_masks(qh: torch.Tensor) -> torch.Tensor:
    """uint8 [strips, nb, 64]: the 5th bits of 5-bit blocks for ``block_mm_q8``, from their
    ``qh`` (uint8 [strips, 16, nb, 4]: row 16 s + l's 4 bytes of block b): 8 little-endian
    64-bit masks a strip's block, mask (k, h) at byte 16 k + 8 h, whose bit 4 l + t is the
    5th bit of element 16 h + 4 k + t of row l (the element of byte 4 l + t of quant vector
    k, in its low nibble for h = 0, its high nibble for h = 1)."""
    strips, _, nb, _ = qh.shape
    word = qh.contiguous().view(torch.int32)  # [s, l, b, 1]: bit j is element j's
    bits = (word >> torch.arange(GROUP, dtype=torch.int32)) & 1  # [s, l, b, 32]
    bits = bits.view(strips, 16, nb, 2, 4, 4).permute(0, 2, 4, 3, 1, 5)  # [s, b, k, h, l, t]
    octets = bits.reshape(strips, nb, 64, 8) << torch.arange(8, dtype=torch.int32)
    return octets.sum(dim=3).to(torch.uint8)  # byte 8 (2k + h) + i holds bits 8i..8i+7


def int8_activations() -> bool:
    """Whether the ``blocks_q8`` kernel may run here: not turned off by
    ``PIE_CTX_BLOCKS_Q8=0`` (read at import), and the block kernels built with it."""
    if not INT8_ACTIVATIONS:
        return False
    ops = kernels.block_ops()
    return ops is not None and hasattr(ops, "block_mm_q8")


def _round_groups(g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, d) of groups g [..., 32]: ``d = max|g| / 127``, ``q = round(g * (1 / d))``."""
    d = g.abs().amax(dim=-1, keepdim=True) / 127
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    return torch.round(g * inv), d


def round_activations(x: torch.Tensor, outliers: torch.Tensor | None = None,
                      levels: int = 1) -> torch.Tensor:
    """float32 ``x`` [..., K] as the ``blocks_q8`` kernel rounds it (llama.cpp's Q8_0 of
    activations): per group of 32, ``d = max|x| / 127`` and ``q = round(x * (1 / d))`` (ties
    to even); the values ``q * d``. With ``levels=2`` the error ``x - q * d`` (one rounding)
    is rounded the same way (``q2``, ``d2``) and the values are ``q * d + q2 * d2`` (the
    kernel's two levels: ~1/254 of one level's error). With ``outliers`` (input channels,
    int64 [n]) those channels are zeroed before the rounding and keep their exact values
    (the kernel's outlier split: their product is exact). The kernel's input (up to the
    last bit of a two-level value), for tests and the check of
    :func:`runtime.model.kernel_choice.choose_kernels`."""
    xf = x.float()
    if outliers is not None and outliers.numel():
        xf = xf.clone()
        xf[..., outliers] = 0
    g = xf.reshape(*x.shape[:-1], -1, GROUP)
    q, d = _round_groups(g)
    vals = q * d
    if levels == 2:  # the error with one rounding (the kernel's fma): exact in float64
        q2, d2 = _round_groups((g.double() - q.double() * d.double()).float())
        vals = vals + q2 * d2
    out = vals.reshape(x.shape)
    if outliers is not None and outliers.numel():
        out[..., outliers] = x.float()[..., outliers]
    return out


def outlier_channels(amax: torch.Tensor, k: int = OUTLIERS) -> torch.Tensor:
    """The ``k`` input channels of a projection that the ``blocks_q8`` kernel keeps out of
    its activation rounding: those of largest ``amax`` (its input's max |x| per channel
    over the calibration text; the outliers of a transformer's activations sit in the same
    few channels token after token), sorted."""
    return torch.topk(amax.detach().float().cpu(), min(k, amax.numel())).indices.sort().values


@dataclass(frozen=True, slots=True)
class StripBlocks:
    """A :class:`BlockWeight`'s blocks in the layout of ``block_mm_q8`` (block_mm.cpp):
    output rows in strips of 16 (the last padded with zero rows), each block's quants for
    the strip's 16 rows interleaved 4 bytes at a time (one vector: 4 bytes of every row).

    Fields:
        bits: 4, 5 or 8.
        qs: uint8 [strips, nb, 4, 16, 4] (4 bits: [s, b, k, l, t] is ggml's byte 4k + t of
            row 16 s + l's block b), [strips, nb, 320] (5 bits: those 256 bytes, then the
            5th bits as 8 masks, :func:`_fifth_bit_masks`) or [strips, nb, 8, 16, 4] (8
            bits: ``q + 128`` of element 4k + t).
        d: float16 [strips, nb, 16] scales; m: the same minimums (4 bits, Q5_1) or empty.
        outliers: int64 [K] input channels kept out of the rounding (K may be 0).
        side: float32 [K, out]: the file's dequantized weights of those channels (exact).
        levels: 1, or 2: the activations rounded in two levels (:func:`round_activations`;
            for down_proj, whose inputs the rounding hurts most: see docs/performance.md).

    The outlier split: the channels ``outliers`` are zeroed before the activations are
    rounded (so a group's scale follows its ordinary channels) and multiplied exactly by
    ``side`` instead (:func:`round_activations` with ``outliers`` is the kernel's input).
    """

    bits: int
    qs: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor
    out_features: int
    in_features: int
    outliers: torch.Tensor
    side: torch.Tensor
    levels: int = 1

    @property
    def code(self) -> int:
        """block_mm_q8's ``bits`` argument: the weights' bits, + TWO_LEVELS for two."""
        return self.bits + (TWO_LEVELS if self.levels == 2 else 0)

    @classmethod
    def from_blocks(cls, w: BlockWeight, outliers: torch.Tensor | None = None,
                    levels: int = 1) -> StripBlocks:
        """The same weights as ``w`` (every quant, scale and minimum, moved), with the input
        channels ``outliers`` (None: none) kept out of the activation rounding, which has
        ``levels`` (1 or 2) levels."""
        n, nb = w.out_features, w.in_features // GROUP
        strips = -(-n // 16)
        pad = strips * 16 - n

        def rows(t: torch.Tensor, fill: int = 0) -> torch.Tensor:  # pad to whole strips
            return torch.cat([t, t.new_full((pad, *t.shape[1:]), fill)]) if pad else t

        def per_strip(t: torch.Tensor) -> torch.Tensor:  # [n, nb] -> [strips, nb, 16]
            return rows(t).view(strips, 16, nb).transpose(1, 2).contiguous()

        m = per_strip(w.m) if w.m.numel() else torch.empty(0, dtype=torch.float16)
        if w.bits == 8:
            q = rows(w.qs.view(torch.uint8) ^ 0x80, 0x80).view(strips, 16, nb, 8, 4)
            qs = q.permute(0, 2, 3, 1, 4).contiguous()  # [s, b, k, l, t]
        else:
            blk = rows(w.qs).view(strips, 16, nb, _QS_BYTES[w.bits])
            q = blk[..., -16:].view(strips, 16, nb, 4, 4)  # [s, l, b, k, t]
            qs = q.permute(0, 2, 3, 1, 4).contiguous()
            if w.bits == 5:
                qs = torch.cat([qs.view(strips, nb, 256), _fifth_bit_masks(blk[..., :4])], dim=2)
        idx = (torch.empty(0, dtype=torch.int64) if outliers is None
               else outliers.to(torch.int64).contiguous())
        side = w.dequantize()[:, idx].t().contiguous()  # [K, out]
        return cls(w.bits, qs, per_strip(w.d), m, n, w.in_features, idx, side, levels)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """float32 ``x`` [M, in] @ W.T -> [M, out] on ``x`` rounded per group of 32 to int8
        in ``levels`` levels (:func:`round_activations`); needs the compiled block kernels."""
        ops = kernels.block_ops()
        if ops is None or not hasattr(ops, "block_mm_q8"):
            raise RuntimeError("the int8-activation block kernel is not built here")
        return ops.block_mm_q8(x if x.stride(-1) == 1 else x.contiguous(), self.qs, self.d,
                               self.m, self.code, self.out_features, self.outliers, self.side)
