"""Projections (``x @ W.T + b``) that run the kernel measured fastest on this machine.

Owner: the model's fused weights. A :class:`Projection` holds its weight either as a float
tensor (the model dtype) or as :class:`Int8Weight` (int8, one scale per output channel),
and knows a few candidate kernels for it. :func:`choose_kernels` times the candidates once
at load, per distinct (form, shape, bias) and per row bucket (1 row: a lone decode; 8: a
decode batch; 256: a prefill chunk), keeps the fastest for each bucket, logs the choice,
and drops the layouts no bucket chose. Which kernel wins differs between machines (MKL vs
oneDNN rank differently on an AVX2 EPYC and an AVX-512 Xeon), so nothing is decided by rule.

Float candidates on CPU: ``mkl`` (``F.linear``), ``mm`` (``W @ x.T``, good for few rows on
some CPUs) and ``onednn`` (a oneDNN-packed copy of W, only for models whose weights take at
most ``PACK_MAX_BYTES``; ``PIE_CTX_PACKED_WEIGHTS=0/1`` forces it off/on), and for bf16 /
fp16 weights ``f32`` (fp32 GEMM on the weight widened once, rounded back: a row-count-
invariant class where the half-precision GEMMs are not, as oneDNN's on AMX cores). Other
devices: ``F.linear``.

Int8 candidates (CPU): activations are quantized per row, symmetric (scale = max|row|/127),
so a row's result never depends on the other rows of its batch; the integer products are
exact, so the candidates compute the same numbers up to fp32 rounding of the final scaling
(~1e-7): ``int_mm`` (``torch._int_mm`` for any row count, on W as stored), ``int_mm_kn``
(the same on a transposed copy of W: the two layouts rank differently on different CPUs;
on the AVX-512 Xeon the stored one was 1.4x faster at 8 rows) and ``fbgemm`` (one row
only: fbgemm's int8 linear with fp32 output, fed that row's own scale and the zero point
128 that makes its uint8 input the same integers).

Block candidates (CPU, a :class:`runtime.model.blocks.BlockWeight`: a GGUF file's Q4_0,
Q4_1, Q5_0, Q5_1 or Q8_0 blocks): ``blocks`` (pie-ctx's kernel over the blocks, fp32 activations,
``runtime/model/kernels/block_mm.cpp``), ``blocks_f32`` (the blocks dequantized per call,
then ``F.linear``: for many rows), ``blocks_q8`` (the blocks times int8-quantized
activations, llama.cpp's Q8 per 32, in integer SIMD: the same weights, the activations
rounded, its calibrated outlier channels exactly; see :class:`runtime.model.blocks.StripBlocks`;
``PIE_CTX_BLOCKS_Q8=0`` leaves it out) and ``int4pack`` (torch's groupwise int4 kernel,
``_weight_int4pack_mm_for_cpu`` on bf16 activations, see :class:`Int4Weight`), offered only
where it computes the same weights: when every scale and zero is exact in bf16, which a
file's float16 scales are not in general.

K-quant candidates (CPU, a :class:`runtime.model.kquants.KQuantWeight`: a GGUF file's Q4_K,
Q5_K or Q6_K super-blocks, read where the file holds them): ``kquant`` (exact weights, fp32
activations, ``runtime/model/kernels/kquant_mm.cpp``), ``blocks_f32`` (dequantized per call,
then ``F.linear``) and ``kquant_q8`` (llama.cpp's ``q8_K`` activations, integer dots;
``PIE_CTX_BLOCKS_Q8=0`` leaves it out too).

Invariants: every candidate of a projection computes the same projection (checked at load
against the first candidate, on the rounded activations for a kernel that rounds them:
:data:`ROUNDS_ACTIVATIONS`); results may differ in the last bits, never more.

Deterministic choice (``choose_kernels(..., deterministic=True)``, the engine's default,
docs/performance.md): a row's bits must not depend on how many rows share its call. Which
kernels keep them is measured, per signature, at load: each candidate runs a fixed set of
row counts (:data:`PROBE_ROWS`) and a row's result must be identical in every call of at
least ``p`` rows, at its first and at its last position; calls with fewer rows are then
padded with zero rows to ``p`` (kernel ``name@p``; on the EPYC, MKL's ``F.linear`` is
one class from 4 rows up, with a one-row and a two-to-three-row path of its own).
Candidates whose invariant results are the same bits form a class; each bucket takes the
fastest member of one class, the class that costs least against the free choice.

Once per machine: the deterministic probe takes ~20-45 s for the default model's five
signatures on a busy 2-core EPYC (the free timing up to ~25 s), so each signature's choice (:class:`KernelChoice`:
the kernels with their pads, the classes) is kept in :mod:`runtime.model.machine_cache`,
keyed by the signature, the candidates, this code and the machine; a later process on the
same machine uses it without probing (docs/performance.md, "Start-up").
"""

from __future__ import annotations

import functools
import json
import logging
import os
import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from pie_ctx.proto.errors import ModelError
from runtime.model import blocks as blocks_module
from runtime.model import kernels, machine_cache
from runtime.model import kquants as kquants_module
from runtime.model.blocks import (
    BlockWeight,
    Int4Weight,
    StripBlocks,
    int8_activations,
    round_activations,
)
from runtime.model.kquants import KQuantWeight, round_q8k
from runtime.model.kquants import int8_activations as kquant_int8_activations

__all__ = ["CHUNK_ROWS", "Int4Weight", "Int8Weight", "KernelChoice", "Projection", "ROW_BUCKETS",
           "STEP_KINDS", "adopt_kernel_choices", "choose_kernels", "has_step_form",
           "kernel_choices", "probe_signature", "should_pack"]

log = logging.getLogger(__name__)

ROW_BUCKETS = (1, 8, 256)  # rows the kernels are timed at: a decode, a decode batch, a chunk
CHUNK_ROWS = 64  # calls of this many rows and up use the chunk bucket's kernel (_bucket)
# Row counts a deterministic choice checks a kernel at (the lm_head's up to 64): calls of
# every size a step makes, the edges of the usual kernel tiles, and bigger prefill chunks.
PROBE_ROWS = (1, 2, 3, 4, 5, 7, 8, 9, 13, 16, 17, 31, 33, 64, 100, 256, 300, 512)
_MAX_PAD = 16  # the most rows a one-row call is padded to
_WINDOW = 64  # rows a probe covers with calls of each row count (see _invariant_from)
PACK_MAX_BYTES = 2 << 30
_PACK_HINT = 8  # batch size the oneDNN packed layout is tuned for
_INT8_MAX = 127.0
# kernels that round their input first -> that rounding (choose_kernels' check compares them
# with the reference kernel on the rounded input)
ROUNDS_ACTIVATIONS = {"blocks_q8": round_activations, "kquant_q8": round_q8k}

Kernel = Callable[[torch.Tensor], torch.Tensor]

# The kernels the fused decode step (runtime/model/fused_step.py) runs in C++, by name ->
# decode_step.cpp's Kind number; a deterministic choice takes its decode buckets from a
# class of these when there is one (a new kernel with a C++ form joins here).
STEP_KINDS = {"mkl": 0, "mm": 1, "onednn": 2, "int_mm": 3, "int_mm_kn": 3, "fbgemm": 4,
              "int4pack": 5, "blocks": 6, "blocks_q8": 7, "kquant": 8, "kquant_q8": 8}


def has_step_form(name: str) -> bool:
    """Whether kernel ``name`` (``base@p`` too) has a C++ form in the fused decode step."""
    return name.partition("@")[0] in STEP_KINDS


def _bucket(rows: int) -> int:
    """Index into ROW_BUCKETS of the bucket a call with ``rows`` rows belongs to."""
    return 0 if rows <= 1 else 1 if rows < CHUNK_ROWS else 2


def _packing_ops() -> tuple[object, object] | None:
    mkldnn = getattr(torch.ops, "mkldnn", None)
    reorder = getattr(mkldnn, "_reorder_linear_weight", None) if mkldnn is not None else None
    linear = getattr(mkldnn, "_linear_pointwise", None) if mkldnn is not None else None
    if reorder is None or linear is None or not torch.backends.mkldnn.is_available():
        return None
    return reorder, linear


def _fbgemm_op() -> object | None:
    quantized = getattr(torch.ops, "quantized", None)
    try:
        op = quantized.linear_with_input_q_dq_qweight_dq_output_fp32.default  # type: ignore[union-attr]
    except (AttributeError, RuntimeError):
        return None
    # The C++ entry point: the Python wrapper's per-call checks cost ~8 us, 120 times a
    # decode step of the default model (the arguments are plain tensors and numbers).
    return getattr(op, "_op", op)


def should_pack(device: torch.device, dtype: torch.dtype, weight_bytes: int) -> bool:
    """Whether float projections of a model this size may keep oneDNN-packed copies."""
    forced = os.environ.get("PIE_CTX_PACKED_WEIGHTS")
    if device.type != "cpu" or dtype != torch.float32 or _packing_ops() is None:
        return False
    if forced is not None:
        return forced not in ("0", "false", "no", "")
    return weight_bytes <= PACK_MAX_BYTES


@dataclass(slots=True)
class Int8Weight:
    """A weight as int8 with one fp32 scale per output row: ``W ~= q * scale[:, None]``."""

    q: torch.Tensor  # [out, in] int8
    scale: torch.Tensor  # [out] fp32

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> Int8Weight:
        """Symmetric per-row quantization of a float ``weight`` [out, in]."""
        w = weight.float()
        scale = w.abs().amax(dim=1).clamp_min(1e-12) / _INT8_MAX  # [out]
        q = torch.round(w / scale[:, None]).clamp_(-_INT8_MAX, _INT8_MAX).to(torch.int8)
        return cls(q, scale)

    def dequantize(self) -> torch.Tensor:
        """The fp32 weight this stands for, [out, in]."""
        return self.q.float() * self.scale[:, None]

    @property
    def nbytes(self) -> int:
        return self.q.numel() + self.scale.numel() * 4


def _quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row symmetric int8 of fp32 ``x`` [m, k]: (q [m, k] int8, scale [m, 1] fp32)."""
    ops = kernels.ops()
    if ops is not None and x.stride(1) == 1 and x.device.type == "cpu":
        return ops.quantize_rows(x)  # the same values in one pass (runtime.model.kernels)
    scale = x.abs().amax(dim=1, keepdim=True).clamp_min_(1e-12).div_(_INT8_MAX)
    return torch.div(x, scale).round_().to(torch.int8), scale


class Projection:
    """``x @ W.T + b`` for ``x`` of shape ``[rows, in]``.

    Args:
        weight: Tensor[out, in] in the compute dtype, an :class:`Int8Weight` or a
            :class:`runtime.model.blocks.BlockWeight` (a GGUF's blocks).
        bias: Tensor[out] or None.
        pack: a float weight may get a oneDNN-packed copy (if chosen, see module doc).
        buckets: how many of ROW_BUCKETS to time (the lm_head, which rarely sees many
            rows, uses the first two; calls with more rows use the last bucket's kernel).
        outliers: blocks_q8's input channels kept out of its rounding (int64), or None.
        act_levels: blocks_q8 rounds the activations in 1 or 2 levels (2: down_proj's, see
            :func:`runtime.model.blocks.round_activations`).

    Until :func:`choose_kernels` runs, every call uses the first candidate (``mkl`` or
    ``int_mm``).
    """

    __slots__ = ("weight", "bias", "pack", "buckets", "outliers", "act_levels", "kernel_names",
                 "_kernels", "_layouts")

    def __init__(self, weight: torch.Tensor | Int8Weight | BlockWeight, bias: torch.Tensor | None = None, *,
                 pack: bool = False, buckets: int = len(ROW_BUCKETS),
                 outliers: torch.Tensor | None = None, act_levels: int = 1) -> None:
        self.weight = weight
        self.bias = bias
        self.outliers = outliers
        self.act_levels = act_levels
        self.pack = pack
        self.buckets = buckets
        self._layouts: dict[str, object] = {}
        first = self.candidate_names()[0]
        self.kernel_names = [first] * buckets
        self._kernels: list[Kernel] = [self._kernel(first)] * buckets

    # ---------------------------------------------------------------- description

    @property
    def is_int8(self) -> bool:
        return isinstance(self.weight, Int8Weight)

    @property
    def is_blocks(self) -> bool:
        return isinstance(self.weight, (BlockWeight, KQuantWeight))

    @property
    def shape(self) -> tuple[int, int]:
        if isinstance(self.weight, (BlockWeight, KQuantWeight)):
            return self.weight.out_features, self.weight.in_features
        w = self.weight.q if isinstance(self.weight, Int8Weight) else self.weight
        return int(w.shape[0]), int(w.shape[1])

    @property
    def device(self) -> torch.device:
        if isinstance(self.weight, (BlockWeight, KQuantWeight)):
            return self.weight.device
        w = self.weight.q if isinstance(self.weight, Int8Weight) else self.weight
        return w.device

    @property
    def form(self) -> str:
        """``"int8"``, ``"q4"`` / ``"q8"`` (blocks), the K-quant formats (``"q4_k+q6_k"``)
        or the float dtype."""
        if isinstance(self.weight, KQuantWeight):
            return self.weight.source.lower()
        if isinstance(self.weight, BlockWeight):
            return f"q{self.weight.bits}"
        return "int8" if self.is_int8 else str(self.weight.dtype)

    @property
    def signature(self) -> tuple:
        """Projections with equal signatures get the same kernels."""
        dtype = self.form
        if isinstance(self.weight, BlockWeight) and not Int4Weight.fits(self.weight):
            dtype += "-f16"  # scales bf16 cannot hold: int4pack is not a candidate
        sig = (dtype, self.shape, self.bias is not None, self.pack, self.buckets,
               str(self.device))
        return sig if self.act_levels == 1 else (*sig, f"levels={self.act_levels}")

    @property
    def nbytes(self) -> int:
        """Bytes of the weight (one layout) and bias a call reads."""
        w = self.weight
        n = (w.nbytes if isinstance(w, (Int8Weight, BlockWeight, KQuantWeight))
             else w.numel() * w.element_size())
        return n + (self.bias.numel() * self.bias.element_size() if self.bias is not None else 0)

    def candidate_names(self) -> list[str]:
        """Kernels that can run this projection here, the reference one first."""
        if isinstance(self.weight, KQuantWeight):
            if self.device.type != "cpu":
                return ["blocks_f32"]
            return ["kquant", "blocks_f32"] + (["kquant_q8"] if kquant_int8_activations() else [])
        if self.is_blocks:
            if self.device.type != "cpu":
                return ["blocks_f32"]
            names = ["blocks", "blocks_f32"]
            if int8_activations():
                names.append("blocks_q8")
            if "-f16" not in self.signature[0]:
                names.append("int4pack")
            return names
        if self.device.type != "cpu":
            return ["mkl"] if not self.is_int8 else ["int_mm"]
        if self.is_int8:
            return ["int_mm", "int_mm_kn"] + (["fbgemm"] if _fbgemm_op() is not None else [])
        names = ["mkl", "mm"]
        if self.pack and _packing_ops() is not None:
            names.append("onednn")
        if self.weight.dtype in (torch.bfloat16, torch.float16):  # type: ignore[union-attr]
            # where the half-precision GEMMs round a row by its batch (oneDNN on AMX
            # cores), deterministic numerics still have an invariant kernel: fp32 GEMM on
            # the weight widened once, its result rounded back
            names.append("f32")
        return names

    def allowed(self, name: str, bucket: int) -> bool:
        """Whether kernel ``name`` may serve bucket ``bucket`` (fbgemm: one row only)."""
        return name != "fbgemm" or ROW_BUCKETS[bucket] == 1

    # -------------------------------------------------------------------- kernels

    def _kernel(self, name: str) -> Kernel:
        """Build (once) the layout kernel ``name`` needs and return the kernel
        (``base@p``: ``base`` on calls padded with zero rows to at least ``p`` rows)."""
        if "@" in name:
            base, pad = name.split("@")
            return _padded(self._kernel(base), int(pad))
        w, b = self.weight, self.bias
        if name == "mkl":
            assert isinstance(w, torch.Tensor)
            return lambda x: F.linear(x, w, b)
        if name == "mm":
            assert isinstance(w, torch.Tensor)
            if b is None:
                return lambda x: torch.mm(w, x.t()).t().contiguous()
            return lambda x: torch.mm(w, x.t()).t().contiguous().add_(b)
        if name == "f32":
            assert isinstance(w, torch.Tensor)
            ops = _packing_ops()
            wide = self._layouts.get(name)
            if wide is None:  # oneDNN's packed fp32 weight where torch has it (as onednn)
                wide = w.float() if ops is None else ops[0](w.float(), _PACK_HINT)
                self._layouts[name] = wide
            wide_b = None if b is None else b.float()
            if ops is None:
                return lambda x: F.linear(x.float(), wide, wide_b).to(x.dtype)
            return lambda x: ops[1](x.float(), wide, wide_b, "none", [], "").to(x.dtype)
        if name == "onednn":
            reorder, linear = _packing_ops()  # type: ignore[misc]
            packed = self._layouts.get(name)
            if packed is None:
                packed = self._layouts[name] = reorder(w, _PACK_HINT)  # type: ignore[operator]
            return lambda x: linear(x, packed, b, "none", [], "")  # type: ignore[operator]
        if isinstance(w, BlockWeight):
            return self._block_kernel(name, w, b)
        if isinstance(w, KQuantWeight):
            return _kquant_kernel(name, w, b)
        assert isinstance(w, Int8Weight)
        if name == "int_mm":
            qt = w.q.t()  # a view of W as stored, [out, in] row-major
            return lambda x: _int8_int_mm(x, qt, w.scale, b)
        if name == "int_mm_kn":
            qt = self._layouts.get(name)
            if qt is None:
                qt = self._layouts[name] = w.q.t().contiguous()  # a copy, [in, out] row-major
            return lambda x: _int8_int_mm(x, qt, w.scale, b)
        if name == "fbgemm":
            packed = self._layouts.get(name)
            if packed is None:
                packed = self._layouts[name] = _fbgemm_prepack(w, b)
            return lambda x: _int8_fbgemm(x, packed)
        raise ValueError(f"unknown projection kernel {name!r}")

    def _block_kernel(self, name: str, w: BlockWeight, b: torch.Tensor | None) -> Kernel:
        if name == "blocks":
            if b is None:
                return lambda x: _as(w.matmul(_f32(x)), x)
            return lambda x: _as(w.matmul(_f32(x)).add_(b), x)
        if name == "blocks_f32":
            return lambda x: _as(F.linear(_f32(x), w.dequantize(), b), x)
        if name == "blocks_q8":
            strips = self._layouts.get(name)
            if strips is None:
                strips = self._layouts[name] = StripBlocks.from_blocks(w, self.outliers,
                                                                       self.act_levels)
            if b is None:
                return lambda x: _as(strips.matmul(_f32(x)), x)  # type: ignore[union-attr]
            return lambda x: _as(strips.matmul(_f32(x)).add_(b), x)  # type: ignore[union-attr]
        if name == "int4pack":
            i4 = self._layouts.get(name)
            if i4 is None:
                i4 = self._layouts[name] = Int4Weight.from_blocks(w)
            if i4 is None:
                raise ValueError("int4pack cannot hold these weights exactly")
            if b is None:
                return i4  # type: ignore[return-value]
            return lambda x: i4(x).add_(b)  # type: ignore[operator]
        raise ValueError(f"unknown projection kernel {name!r}")

    def use(self, names: list[str]) -> None:
        """Route each bucket to the named kernel; drop layouts no bucket uses."""
        self._kernels = [self._kernel(n) for n in names]
        self.kernel_names = list(names)
        for unused in set(self._layouts) - {n.split("@")[0] for n in names}:
            del self._layouts[unused]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Tensor[rows, in] -> Tensor[rows, out]."""
        return self._kernels[min(_bucket(x.shape[0]), self.buckets - 1)](x)


def _kquant_kernel(name: str, w: KQuantWeight, b: torch.Tensor | None) -> Kernel:
    """Kernel ``name`` of a K-quant weight (the file's super-blocks serve every kernel)."""
    if name == "kquant":
        product: Kernel = w.matmul
    elif name == "kquant_q8":
        product = w.matmul_q8
    elif name == "blocks_f32":
        return lambda x: _as(F.linear(_f32(x), w.dequantize(), b), x)
    else:
        raise ValueError(f"unknown projection kernel {name!r}")
    if b is None:
        return lambda x: _as(product(_f32(x)), x)
    return lambda x: _as(product(_f32(x)).add_(b), x)


def _f32(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.float32 else x.float()


def _as(y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return y if y.dtype == x.dtype else y.to(x.dtype)


def _padded(kernel: Kernel, rows: int) -> Kernel:
    """``kernel`` on calls of at least ``rows`` rows: fewer are padded with zero rows."""
    if rows <= 1:
        return kernel

    def run(x: torch.Tensor) -> torch.Tensor:
        m = x.shape[0]
        if m >= rows:
            return kernel(x)
        return kernel(torch.cat([x, x.new_zeros(rows - m, x.shape[1])]))[:m]

    return run


def _int8_int_mm(x: torch.Tensor, qt: torch.Tensor, scale: torch.Tensor,
                 bias: torch.Tensor | None) -> torch.Tensor:
    xf = x if x.dtype == torch.float32 else x.float()
    xq, xs = _quantize_rows(xf)
    acc = torch._int_mm(xq, qt)  # [m, out] int32, exact
    ops = kernels.ops()
    if ops is not None and acc.device.type == "cpu":  # the same bits in one pass
        out = ops.dequantize_int32(acc, xs, scale, _NO_BIAS if bias is None else bias.float())
    else:
        out = acc.float().mul_(xs).mul_(scale)
        if bias is not None:
            out.add_(bias)
    return out if x.dtype == torch.float32 else out.to(x.dtype)


_NO_BIAS = torch.empty(0)


def _fbgemm_prepack(w: Int8Weight, bias: torch.Tensor | None) -> object:
    with warnings.catch_warnings():  # quantized tensors are deprecated; the kernel is not
        warnings.simplefilter("ignore")
        qw = torch._make_per_channel_quantized_tensor(
            w.q, w.scale.double(), torch.zeros_like(w.scale, dtype=torch.int64), 0)
        return torch.ops.quantized.linear_prepack(qw, None if bias is None else bias.float())


def _int8_fbgemm(x: torch.Tensor, packed: object) -> torch.Tensor:
    # (few ops: a decode step runs this 4 times a layer; max |x| is exact either way)
    xf = x if x.dtype == torch.float32 else x.float()
    scale = max(float(torch.linalg.vector_norm(xf, float("inf"))), 1e-12) / _INT8_MAX
    out = _fbgemm_op()(xf, scale, 128, packed)  # type: ignore[misc]
    return out if x.dtype == torch.float32 else out.to(x.dtype)


def _best_seconds(kernels: list[Kernel], x: torch.Tensor, repeats: int) -> float:
    """Best time of one call, averaged over running every member's kernel in turn: each
    member has its own weight, so (for models larger than the caches) the weights come
    from memory as in a real step, not hot from a cache."""
    for k in kernels:  # warm up (and build lazily initialised kernel state)
        k(x)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for k in kernels:
            k(x)
        best = min(best, time.perf_counter() - t0)
    return best / len(kernels)


_CHOSEN: dict[tuple, tuple[list[str], str]] = {}  # signature -> (kernels, log line)


def kernel_choices() -> dict[str, list[Any]]:
    """Every kernel choice made in this process, as JSON-ready data (``boot_engine`` keeps
    them beside durable snapshots, so a restarted engine computes exactly as before)."""
    return {json.dumps(sig): [names, line] for sig, (names, line) in _CHOSEN.items()}


def adopt_kernel_choices(choices: dict[str, list[Any]]) -> None:
    """Use choices saved by :func:`kernel_choices` instead of timing those signatures again
    (a choice naming a kernel this machine lacks is timed again instead)."""

    def tuples(v: Any) -> Any:
        return tuple(tuples(x) for x in v) if isinstance(v, list) else v

    for key, (names, line) in choices.items():
        _CHOSEN.setdefault(tuples(json.loads(key)), (list(names), str(line)))


def _one_rounding(chosen: list[str], times: list[dict[str, float]]) -> list[str]:
    """The per-bucket choice ``chosen`` made consistent: a kernel that rounds the activations
    (:data:`ROUNDS_ACTIVATIONS`) computes other numbers than the rest, not only other last
    bits, so it serves every bucket or none (else a sequence's tokens would depend on the
    bucket its batch falls in): every bucket when its time over the best other kernel's,
    multiplied over the buckets, is at most 1 (a geometric mean: decode counts as much as
    prefill)."""
    rounding = {n for n in chosen if n in ROUNDS_ACTIVATIONS}
    if not rounding:
        return chosen
    name = sorted(rounding)[0]
    others = [min((n for n in t if n not in ROUNDS_ACTIVATIONS), key=t.__getitem__)
              for t in times]
    if not all(name in t for t in times):
        return others
    ratio = 1.0
    for t, other in zip(times, others, strict=True):
        ratio *= t[name] / t[other]
    return [name] * len(times) if ratio <= 1 else others


@dataclass(slots=True)
class KernelChoice:
    """What the probe of one signature decided: the kernel per row bucket (``name@p`` for a
    kernel padded to ``p`` rows), the log line, and (deterministic) the classes of
    row-count-invariant kernels with equal bits it chose among."""

    chosen: list[str]
    line: str
    classes: list[list[str]]

    def encode(self) -> dict[str, Any]:
        return {"chosen": self.chosen, "line": self.line, "classes": self.classes}

    @classmethod
    def decode(cls, data: Any, candidates: list[str], buckets: int) -> KernelChoice:
        """The choice stored by :meth:`encode`; ValueError unless it names ``buckets``
        kernels of ``candidates``."""
        chosen, line, classes = data["chosen"], data["line"], data["classes"]
        if (not isinstance(line, str) or not isinstance(chosen, list) or len(chosen) != buckets
                or not all(isinstance(n, str) and n.split("@")[0] in candidates
                           for n in chosen)
                or not all(isinstance(c, list) and all(isinstance(n, str) for n in c)
                           for c in classes)):
            raise ValueError(f"not a choice of {buckets} of {candidates}")
        return cls(list(chosen), line, [list(c) for c in classes])


@functools.cache
def _probe_code() -> str:
    """The version of the probe's code: this module's and the block kernels' Python side
    (the compiled kernels are in the machine facts)."""
    return machine_cache.source_digest(Path(__file__), Path(blocks_module.__file__),
                                       Path(kquants_module.__file__))


def _probe_inputs(rep: Projection, sig: tuple, names: list[str], repeats: int) -> dict[str, Any]:
    """Everything besides the machine that decides the probe of ``rep``'s signature ``sig``
    (:mod:`runtime.model.machine_cache` adds the machine's facts)."""
    w = rep.weight
    return {"signature": sig, "candidates": names, "repeats": repeats,
            "source": w.source if isinstance(w, (BlockWeight, KQuantWeight)) else None,
            "outliers": 0 if rep.outliers is None else int(rep.outliers.numel()),
            "probe": [PROBE_ROWS, ROW_BUCKETS, _MAX_PAD, _WINDOW], "code": _probe_code()}


def choose_kernels(projections: Iterable[Projection], *, repeats: int = 3,
                   deterministic: bool = False) -> list[str]:
    """Time every candidate kernel per projection signature and row bucket; route each
    projection to the fastest. Returns the log lines (also logged at INFO).

    Candidates that disagree with the reference kernel beyond rounding are discarded
    (with a log line) before timing. A signature is timed once per process: later models
    with the same shapes reuse the choice, so two engines in one process compute alike;
    and once per machine: the choice is kept in :mod:`runtime.model.machine_cache` (kind
    ``"probe"``, keyed by the signature, the candidates, the probe's code and the
    machine), which later processes reuse without timing (``PIE_CTX_MACHINE_CACHE=0``:
    time every time; ``refresh``: time again and keep the new choice).

    ``deterministic``: only kernels whose row results do not depend on the call's row
    count, all of one class of equal bits (see the module doc); the choice is kept apart
    from the free one.
    """
    groups: dict[tuple, list[Projection]] = {}
    for p in projections:
        sig = p.signature + (("deterministic",) if deterministic else ())
        groups.setdefault(sig, []).append(p)
    lines = []
    for sig, members in groups.items():
        if sig in _CHOSEN and ({n.split("@")[0] for n in _CHOSEN[sig][0]}
                               <= set(members[0].candidate_names())):
            names, line = _CHOSEN[sig]
            for p in members:
                p.use(names)
            lines.append(line)
            continue
        rep = members[0]
        names = rep.candidate_names()
        if len(names) == 1 and not deterministic:
            continue
        choice, hit = machine_cache.cached(
            "probe", _probe_inputs(rep, sig, names, repeats),
            lambda rep=rep, members=members, names=names: probe_signature(
                rep, members, names, repeats, deterministic),
            KernelChoice.encode,
            lambda data, names=names, rep=rep: KernelChoice.decode(data, names, rep.buckets))
        for p in members:
            p.use(choice.chosen)
        log.info("projection kernels%s: %s", " (machine cache)" if hit else "", choice.line)
        _CHOSEN[sig] = (choice.chosen, choice.line)
        lines.append(choice.line)
    return lines


def probe_signature(rep: Projection, members: list[Projection], names: list[str],
                    repeats: int, deterministic: bool) -> KernelChoice:
    """The probe of one signature (what :func:`choose_kernels` caches per machine): check
    each of the candidates ``names`` against the first, then time them per row bucket
    over ``members`` (all of ``rep``'s signature) and keep the fastest, or with
    ``deterministic`` the fastest of the best class of row-count-invariant kernels.

    Raises:
        ModelError: deterministic, and no candidate class is invariant for every bucket.
    """
    names = list(names)
    out_f, in_f = rep.shape
    # one seed per signature: a signature probes the same inputs whichever were probed
    # before it (or came from the cache)
    gen = torch.Generator().manual_seed(0)
    dtype = (torch.float32 if rep.is_int8 or rep.is_blocks
             else rep.weight.dtype)  # type: ignore[union-attr]
    probe = torch.randn(_PACK_HINT, in_f, generator=gen).to(dtype=dtype, device=rep.device)
    want = rep._kernel(names[0])(probe)
    for n in names[1:]:
        rows = probe[:1] if not rep.allowed(n, 1) else probe
        got = rep._kernel(n)(rows)
        ref = want[: rows.shape[0]]
        if n in ROUNDS_ACTIVATIONS:  # its product of the input it actually multiplies
            ref = rep._kernel(names[0])(
                ROUNDS_ACTIVATIONS[n](rows, rep.outliers, rep.act_levels).to(rows.dtype))
        if not torch.allclose(got.float(), ref.float(), rtol=1e-3,
                              atol=1e-3 * float(ref.abs().max())):
            log.info("projection kernel %s disagrees with %s on %dx%d; not used", n,
                     names[0], out_f, in_f)
            names.remove(n)
    if deterministic:
        return _choose_invariant(rep, members, names, gen, repeats)
    kernels = {n: [p._kernel(n) for p in members] for n in names}
    chosen, report, all_times = [], [], []
    for b in range(rep.buckets):
        rows = ROW_BUCKETS[b]
        x = torch.randn(rows, in_f, generator=gen).to(dtype=dtype, device=rep.device)
        # Few rows are memory-bound (cycle through every member's weight); many rows are
        # compute-bound, where four members time the same and cost less to load.
        sample = slice(None) if rows < 64 else slice(4)
        times = {n: _best_seconds(k[sample], x, repeats) for n, k in kernels.items()
                 if rep.allowed(n, b)}
        best = min(times, key=times.__getitem__)
        chosen.append(best)
        all_times.append(times)
    chosen = _one_rounding(chosen, all_times)
    for b, (best, times) in enumerate(zip(chosen, all_times, strict=True)):
        rows = ROW_BUCKETS[b]
        report.append(f"{rows} row{'s' if rows > 1 else ''}: {best} ("
                      + ", ".join(f"{n} {t * 1e3:.2f}" for n, t in times.items()) + " ms)")
    line = (f"{len(members)} x {out_f}x{in_f} {rep.form}: "
            + "; ".join(report))
    return KernelChoice(chosen, line, [])


def _invariant_from(rep: Projection, name: str, x: torch.Tensor) -> tuple[int, bytes] | None:
    """``(p, bits)``: kernel ``name`` gives a row the same bits in every call of at least
    ``p`` of the :data:`PROBE_ROWS` rows (every row of each call against the biggest
    call's, and against itself moved one position on), ``p <= _MAX_PAD``; ``bits``: the
    biggest call's whole result (kernels of one class must agree on every row); None if
    no such ``p``.

    Many rows are compared for every row count, not a sample: a bf16 or fp16 result
    rounds two accumulations that differ in their last fp32 bits to the same
    half-precision value unless the sum lies near a rounding boundary (measured: 1 row in
    9 of 576 outputs differs between MKL's one-row and multi-row bf16 paths), so the
    first and last row of one call per count (the earlier probe) let a batch-dependent
    bf16 kernel pass, and bf16 speculation parted from plain greedy decoding."""
    kernel = rep._kernel(name)
    limit = 1 if not rep.allowed(name, 1) else x.shape[0]
    counts = [m for m in PROBE_ROWS if m <= limit]
    biggest = kernel(x[:counts[-1]])

    def same(m: int) -> bool:
        # calls of m rows over the first _WINDOW rows (at least one call): each row at
        # another position than in the biggest call, and many rows even for small m
        starts = range(0, max(1, min(_WINDOW, x.shape[0]) - m + 1), m)
        out = torch.cat([kernel(x[a: a + m]) for a in starts])
        if not torch.equal(out, biggest[: len(out)]):
            return False
        if m == 1:
            return True
        moved = kernel(x[:m].roll(1, 0))  # each row one position on, the last first
        return torch.equal(moved[1:], biggest[: m - 1]) and torch.equal(moved[0],
                                                                         biggest[m - 1])

    p = None
    for m in reversed(counts):
        if not same(m):
            break
        p = m
    if p is None or p > _MAX_PAD:
        return None
    return p, biggest.float().numpy().tobytes()


_STEP_BUCKETS = 2  # the buckets the fused decode step runs (a decode, a decode batch)


def _step_kernels(rep: Projection, dtype: torch.dtype) -> Callable[[str], bool]:
    """Which kernels the fused decode step can run for ``rep`` (:data:`STEP_KINDS`; the step:
    CPU, fp32 compute); a deterministic choice takes its decode buckets from a class of
    these when there is one, since the step saves more than any kernel ranking here."""
    if rep.device.type != "cpu" or dtype != torch.float32:
        return lambda name: False
    return has_step_form


def _choose_invariant(rep: Projection, members: list[Projection], names: list[str],
                      gen: torch.Generator, repeats: int) -> KernelChoice:
    """The deterministic choice for one signature: per bucket, the fastest member of the
    class of row-count-invariant kernels (equal bits) that costs least against the
    fastest kernel of each bucket, among the classes whose decode buckets the fused decode
    step can run when there are any (:func:`_step_kernels`)."""
    out_f, in_f = rep.shape
    dtype = (torch.float32 if rep.is_int8 or rep.is_blocks
             else rep.weight.dtype)  # type: ignore[union-attr]
    top = PROBE_ROWS[-1] if rep.buckets == len(ROW_BUCKETS) else 64
    x = torch.randn(top, in_f, generator=gen).to(dtype=dtype, device=rep.device)
    classes: dict[bytes, list[str]] = {}
    for n in names:
        found = _invariant_from(rep, n, x)
        if found is not None:
            classes.setdefault(found[1], []).append(f"{n}@{found[0]}" if found[0] > 1 else n)
    if not classes:
        raise ModelError(
            f"no projection kernel for {out_f}x{in_f} {dtype} gives a row the same result "
            f"whatever its batch on this machine (tried {', '.join(names)}); start the engine "
            "with --deterministic off (deterministic=False)")
    times: dict[tuple[str, int], float] = {}
    for b in range(rep.buckets):
        rows = torch.randn(ROW_BUCKETS[b], in_f, generator=gen).to(dtype=dtype,
                                                                   device=rep.device)
        sample = slice(None) if ROW_BUCKETS[b] < 64 else slice(4)
        wanted = set(names) | {n for c in classes.values() for n in c}
        for n in wanted:
            if rep.allowed(n.split("@")[0], b):
                times[n, b] = _best_seconds([p._kernel(n) for p in members][sample], rows,
                                            repeats)
    free = [min(t for (n, bb), t in times.items() if bb == b and n in names)
            for b in range(rep.buckets)]
    stepped = _step_kernels(rep, dtype)
    options = []  # (not all decode picks in C++, cost, picks) per class that covers all
    for members_of in classes.values():
        picks = []
        for b in range(rep.buckets):
            timed = [n for n in members_of if (n, b) in times]
            if b < _STEP_BUCKETS and any(stepped(n) for n in timed):
                timed = [n for n in timed if stepped(n)]
            picks.append(min(timed, key=lambda n, b=b: times[n, b]) if timed else None)
        if None in picks:
            continue
        cost = max(times[n, b] / free[b] for b, n in enumerate(picks))
        options.append((not all(stepped(n) for n in picks[:_STEP_BUCKETS]), cost, picks))
    chosen = min(options, key=lambda o: o[:2])[2] if options else []
    if not chosen:
        raise ModelError(f"no row-count-invariant projection kernel class covers every row "
                         f"bucket for {out_f}x{in_f} {dtype}; start the engine with "
                         "--deterministic off (deterministic=False)")
    report = [f"{ROW_BUCKETS[b]} row{'s' if ROW_BUCKETS[b] > 1 else ''}: {n} "
              f"({times[n, b] * 1e3:.2f} ms, x{times[n, b] / free[b]:.2f} of the fastest)"
              for b, n in enumerate(chosen)]
    line = (f"{len(members)} x {out_f}x{in_f} {rep.form} "
            "deterministic: " + "; ".join(report))
    return KernelChoice(chosen, line, list(classes.values()))
