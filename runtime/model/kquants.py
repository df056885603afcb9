"""Weights kept in a GGUF file's K-quant super-blocks (``weights="gguf"``): Q4_K, Q5_K, Q6_K.

Owner: the model's projections, lm_head and embedding table whose GGUF tensors are stored
in the K-quant family (256 weights a super-block, sub-block scales and minimums in the
block). :class:`KQuantWeight` holds one weight matrix as the file's own bytes, in ggml's
layout (``block_q4_K``: ``d``, ``dmin`` float16, ``scales[12]``, ``qs[128]`` = 144 bytes;
``block_q5_K`` 176; ``block_q6_K`` 210), a uint8 tensor [out, row bytes] that may be a view
of the memory-mapped file: nothing is copied at load unless rows must be permuted (Q/K).
A fused projection (qkv, gate_up) keeps its parts' bytes apart (:attr:`KQuantWeight.parts`,
each its own format: a Q4_K_M file mixes Q4_K and Q6_K in one layer's qkv).

Where the AVX-512 VNNI path is built, each matrix whose rows are a multiple of 16 is
*packed* at load (:func:`pack_wanted`; ``PIE_CTX_KQUANT_PACK=0`` keeps the file's
layout): the same bytes reordered so that 16 output rows sit in the lanes of one vector
(``kquant_mm.cpp``, "the packed layout"), as llama.cpp repacks its K-quants for its CPU
kernels. The packed copy replaces the file's bytes (their pages of the mapping are
released), so memory holds one copy; every product gives the same bits on either layout.

The products (``runtime/model/kernels/kquant_mm.cpp``):

* ``kquant`` (:meth:`KQuantWeight.matmul`): the file's weights dequantized exactly as
  ``gguf.quants.dequantize`` (ggml's ``dequantize_row_q*_K``) forms them, times fp32
  activations;
* ``kquant_q8`` (:meth:`KQuantWeight.matmul_q8`): llama.cpp's way: each activation row
  rounded per 256 to ``q8_K`` (:func:`round_q8k` is its eager twin), integer dots with
  the sub-block scales and minimums, AVX-512 VNNI, AVX2 or portable code (:data:`ISAS`).

Both give a row the same bits whatever its batch. Without the compiled kernels the weights
are dequantized per call (numpy, ``gguf.quants``) and go through ``F.linear``.
"""

from __future__ import annotations

import mmap
import os
import warnings
from dataclasses import dataclass

import numpy as np
import torch

from pie_ctx.proto.errors import ModelError
from runtime.model import blocks, kernels

__all__ = ["ISAS", "KQUANT_FORMATS", "PACK", "QK_K", "KQuantPart", "KQuantWeight", "built_isas",
           "int8_activations", "pack_wanted", "round_q8k"]

QK_K = 256  # weights a super-block
# format -> (ggml type id: kquant_mm.cpp's ``kind``, bytes a super-block)
KQUANT_FORMATS: dict[str, tuple[int, int]] = {"Q4_K": (12, 144), "Q5_K": (13, 176),
                                              "Q6_K": (14, 210)}
# the q8_K product's code paths, by name -> kquant_mm_parts' ``isa`` argument
ISAS = {"portable": 0, "avx2": 1, "avx512_vnni": 2}
PACK = 16  # output rows a packed group holds (a part's rows must be a multiple)
_PACKED = 100  # added to a packed part's kind code
_PACKING = os.environ.get("PIE_CTX_KQUANT_PACK", "1").lower() in ("1", "true", "yes", "on")


@dataclass(frozen=True, slots=True)
class KQuantPart:
    """One stored matrix: ``raw`` uint8 [rows, row bytes] in format ``kind``, in the file's
    layout or (``packed``) in the packed one (see the module docstring)."""

    kind: str
    raw: torch.Tensor
    packed: bool = False

    @property
    def rows(self) -> int:
        return int(self.raw.shape[0])

    @property
    def code(self) -> int:
        return KQUANT_FORMATS[self.kind][0] + (_PACKED if self.packed else 0)

    def natural(self) -> torch.Tensor:
        """The bytes in the file's layout (``raw`` itself, or a copy of a packed part's)."""
        if not self.packed:
            return self.raw
        return kernels.kquant_ops().kquant_unpack(self.raw, KQUANT_FORMATS[self.kind][0])

    def packed_copy(self) -> KQuantPart:
        """This part in the packed layout (needs the kernels and rows a multiple of 16)."""
        if self.packed:
            return self
        ops = kernels.kquant_ops()
        return KQuantPart(self.kind, ops.kquant_pack(self.raw, KQUANT_FORMATS[self.kind][0]), True)

    def dequantize(self, index: torch.Tensor) -> torch.Tensor:
        """float32 [R, in] weights of rows ``index`` (int64): ggml's values exactly."""
        ops = kernels.kquant_ops()
        if ops is not None and self.raw.device.type == "cpu":
            return ops.kquant_rows(self.raw, self.code, index.to(torch.int64).contiguous())
        import gguf

        rows = self.natural()[index.to(self.raw.device)].cpu().numpy()
        kind = gguf.GGMLQuantizationType[self.kind]
        return torch.from_numpy(np.asarray(gguf.quants.dequantize(rows, kind), np.float32))


def _as_tensor(raw: np.ndarray | torch.Tensor) -> torch.Tensor:
    """``raw`` as a uint8 tensor sharing its memory (a read-only memory map too)."""
    if isinstance(raw, torch.Tensor):
        return raw
    with warnings.catch_warnings():  # read-only mmap: the kernels never write to it
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(raw)


@dataclass(frozen=True, slots=True)
class KQuantWeight:
    """One weight [out_features, in_features]: its parts' rows stacked (see module doc).

    Fields:
        parts: the stored matrices, top to bottom (one, or a fused projection's).
        out_features, in_features: the shape (``in_features`` a multiple of 256).
        source: the formats, ``"Q4_K"`` or ``"Q4_K+Q6_K"``.
        codes: int64 [parts]: each part's kind, as the kernels take it.
    """

    parts: tuple[KQuantPart, ...]
    out_features: int
    in_features: int
    source: str
    codes: torch.Tensor

    @classmethod
    def of(cls, parts: tuple[KQuantPart, ...], in_features: int) -> KQuantWeight:
        """The weight of ``parts`` stacked (each ``in_features`` wide)."""
        return cls(parts, sum(p.rows for p in parts), in_features,
                   "+".join(sorted({p.kind for p in parts})),
                   torch.tensor([p.code for p in parts], dtype=torch.int64))

    @classmethod
    def from_gguf(cls, raw: np.ndarray | torch.Tensor, kind: str, shape: tuple[int, int],
                  pack: bool | None = None) -> KQuantWeight:
        """The weight of a GGUF tensor's bytes ``raw`` (uint8 [out, row bytes] or flat), in
        place: the tensor shares ``raw``'s memory (a view of the memory-mapped file), or,
        packed (``pack``; None: :func:`pack_wanted`), a packed copy, the pages of the
        mapping it was read from released.

        Raises:
            ModelError: ``kind`` is not a K-quant format, or the bytes do not fit ``shape``.
        """
        if kind not in KQUANT_FORMATS:
            raise ModelError(f"GGUF format {kind} is not a K-quant format "
                             f"({', '.join(KQUANT_FORMATS)})")
        out_f, in_f = shape
        row_bytes = in_f // QK_K * KQUANT_FORMATS[kind][1]
        if in_f % QK_K or raw.size != out_f * row_bytes or raw.dtype != np.uint8:
            raise ModelError(f"GGUF {kind} tensor of shape {shape} has {raw.size} bytes; the "
                             "file is corrupt")
        part = KQuantPart(kind, _as_tensor(raw).reshape(out_f, row_bytes))
        if pack_wanted(out_f) if pack is None else pack:
            part = part.packed_copy()
            if isinstance(raw, np.ndarray):
                _release_mapped(raw)
        return cls.of((part,), in_f)

    @staticmethod
    def cat(parts: list[KQuantWeight]) -> KQuantWeight | None:
        """The weights stacked along the output rows (a fused qkv / gate_up; each part keeps
        its bytes and format), or None when their input sizes differ."""
        if len({p.in_features for p in parts}) != 1:
            return None
        return KQuantWeight.of(tuple(q for p in parts for q in p.parts), parts[0].in_features)

    def take_rows(self, index: torch.Tensor) -> KQuantWeight:
        """The weight of output rows ``index`` (a copy of those rows' bytes: Q/K row
        un-permutation); only for a single stored matrix."""
        if len(self.parts) != 1:
            raise RuntimeError("take_rows of a fused K-quant weight")
        part = self.parts[0]
        raw = part.natural()[index.to(torch.int64)].contiguous()
        taken = KQuantPart(part.kind, raw)
        if part.packed and taken.rows % PACK == 0:  # (a packed weight's rows stay packed)
            taken = taken.packed_copy()
        return KQuantWeight.of((taken,), self.in_features)

    # ------------------------------------------------------------------ reading

    @property
    def nbytes(self) -> int:
        """Bytes a product reads: the super-blocks."""
        return sum(p.raw.numel() for p in self.parts)

    @property
    def device(self) -> torch.device:
        return self.parts[0].raw.device

    def _spans(self) -> list[tuple[KQuantPart, int, int]]:
        spans, at = [], 0
        for p in self.parts:
            spans.append((p, at, at + p.rows))
            at += p.rows
        return spans

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """float32 [R, in] weights of output ``rows`` (None: all): ggml's values exactly."""
        if rows is None:
            return torch.cat([p.dequantize(torch.arange(p.rows)) for p in self.parts])
        rows = rows.to(torch.int64).cpu()
        if len(self.parts) == 1:
            return self.parts[0].dequantize(rows)
        out = torch.empty(rows.numel(), self.in_features)
        for p, lo, hi in self._spans():
            hit = ((rows >= lo) & (rows < hi)).nonzero().flatten()
            if hit.numel():
                out[hit] = p.dequantize(rows[hit] - lo)
        return out

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """float32 ``x`` [M, in] @ W.T -> [M, out] on the exact weights (the compiled
        kernel, or the eager twin)."""
        ops = kernels.kquant_ops()
        if ops is None or x.device.type != "cpu":
            return torch.nn.functional.linear(x, self.dequantize().to(x.device))
        x = x if x.stride(-1) == 1 else x.contiguous()
        return ops.kquant_mm_parts(x, [p.raw for p in self.parts], self.codes, False, -1)

    def matmul_q8(self, x: torch.Tensor, isa: str | None = None) -> torch.Tensor:
        """float32 ``x`` [M, in] @ W.T -> [M, out] on ``x`` rounded to ``q8_K``
        (:func:`round_q8k`), on code path ``isa`` (:data:`ISAS`; None: the best built here);
        needs the compiled kernels."""
        ops = kernels.kquant_ops()
        if ops is None:
            raise RuntimeError("the K-quant kernels are not built here")
        x = x if x.stride(-1) == 1 else x.contiguous()
        return ops.kquant_mm_parts(x, [p.raw for p in self.parts], self.codes, True,
                                   -1 if isa is None else ISAS[isa])


def pack_wanted(rows: int) -> bool:
    """Whether a matrix of ``rows`` output rows is packed at load: the AVX-512 VNNI path is
    built (the packed layout's kernel), rows are a multiple of :data:`PACK`, and
    ``PIE_CTX_KQUANT_PACK`` is not 0."""
    return _PACKING and rows % PACK == 0 and "avx512_vnni" in built_isas()


def _release_mapped(raw: np.ndarray) -> None:
    """Drop ``raw``'s whole pages from this process if it is a view of a read-only file
    mapping (they come back from the file if read again): the packed copy serves instead,
    and resident memory holds one copy of the weights, not two."""
    base = raw
    while isinstance(base, np.ndarray):
        base = base.base
    if isinstance(base, memoryview):  # (numpy.frombuffer's)
        base = base.obj
    if not isinstance(base, mmap.mmap) or raw.flags.writeable:
        return
    start = raw.ctypes.data - np.frombuffer(base, np.uint8).ctypes.data
    lo = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE
    hi = (start + raw.nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
    if hi > lo:
        base.madvise(mmap.MADV_DONTNEED, lo, hi - lo)


def int8_activations() -> bool:
    """Whether ``kquant_q8`` may run here: not turned off by ``PIE_CTX_BLOCKS_Q8=0`` (the
    switch of every int8-activation block kernel), and the K-quant kernels built."""
    return blocks.INT8_ACTIVATIONS and kernels.kquant_ops() is not None


def built_isas() -> list[str]:
    """The ``kquant_q8`` code paths the compiled kernels have here (empty: not built)."""
    ops = kernels.kquant_ops()
    if ops is None:
        return []
    names = {v: k for k, v in ISAS.items()}
    return [names[i] for i in ops.kquant_isas()]


def round_q8k(x: torch.Tensor, outliers: torch.Tensor | None = None,
              levels: int = 1) -> torch.Tensor:
    """float32 ``x`` [..., K] as ``kquant_q8`` rounds it (llama.cpp's ``q8_K``): per 256,
    ``iscale = -127 / v`` (``v`` the first value of largest magnitude), ``q = min(127,
    round(x * iscale))`` (ties to even), ``d = 1 / iscale``; the values ``q * d``.
    (``outliers`` and ``levels`` are the other rounding's arguments: this one has neither.)"""
    del outliers, levels
    g = x.float().reshape(*x.shape[:-1], -1, QK_K)
    v = g.gather(-1, g.abs().argmax(dim=-1, keepdim=True))
    # (true divisions: a Python number over a tensor is a reciprocal and a product)
    iscale = torch.where(v != 0, torch.full_like(v, -127.0) / torch.where(v != 0, v, 1), 0)
    q = torch.round(g * iscale).clamp_(max=127)
    d = torch.where(v != 0, torch.ones_like(v) / torch.where(iscale != 0, iscale, 1), 0)
    return (q * d).reshape(x.shape)
