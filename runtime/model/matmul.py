"""Projections (``x @ W.T + b``) and the candidate kernels each can run.

Owner: the model's fused weights. A :class:`Projection` holds its weight either as a float
tensor (the model dtype) or as :class:`Int8Weight` (int8, one scale per output channel),
or a GGUF file's blocks, and knows a few candidate kernels for it;
:func:`runtime.model.kernel_choice.choose_kernels` times the candidates once at load, per
distinct (form, shape, bias) and per row bucket (1 row: a lone decode; 8: a decode batch;
256: a prefill chunk), keeps the fastest for each bucket (:meth:`Projection.use`), and
the layouts no bucket chose are dropped. Which kernel wins differs between machines (MKL
vs oneDNN rank differently on an AVX2 EPYC and an AVX-512 Xeon), so nothing is decided by
rule.

Float candidates on CPU: ``mkl`` (``F.linear``), ``mm`` (``W @ x.T``, good for few rows on
some CPUs), ``onednn`` (a oneDNN-packed copy of W, only for models whose weights take at
most ``PACK_MAX_BYTES``; ``PIE_CTX_PACKED_WEIGHTS=0/1`` forces it off/on), ``f32_strips``
(fp32 weights, packed like ``onednn``: pie-ctx's kernel on a copy of W in 16-row strips,
``runtime/model/kernels/strips_mm.cpp``, each output one chain of FMAs in input order, so
row-count invariant by construction; on the Sapphire Rapids Xeon it beat MKL and oneDNN
at 1, 8 and 256 rows), and for bf16 /
fp16 weights ``f32`` (fp32 GEMM on the weight widened once, rounded back: a row-count-
invariant class where the half-precision GEMMs are not, as oneDNN's on AMX cores). Other
devices: ``F.linear``.

Int8 candidates (CPU): activations are quantized per row, symmetric (scale = max|row|/127),
so a row's result never depends on the other rows of its batch; the integer products are
exact, so the candidates compute the same numbers up to fp32 rounding of the final scaling
(~1e-7): ``int_mm`` (``torch._int_mm`` for any row count, on W as stored), ``int_mm_kn``
(the same on a transposed copy of W: the two layouts rank differently on different CPUs;
on the AVX-512 Xeon the stored one was 1.4x faster at 8 rows), ``int8_strips`` (pie-ctx's
kernel on a copy of W in 16-row strips, ``runtime/model/kernels/strips_mm.cpp``, where the CPU
has AVX-512 VNNI: the same int32 sums as ``torch._int_mm`` and the same scaling, so the
same bits; ~10x faster at one row on the Xeon) and ``fbgemm`` (one row only: fbgemm's int8
linear with fp32 output, fed that row's own scale and the zero point 128 that makes its
uint8 input the same integers).

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

The choice itself (timing, the deterministic probe, the per-machine cache) is
:mod:`runtime.model.kernel_choice`'s.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from runtime.model import kernels
from runtime.model.blocks import (
    BlockWeight,
    Int4Weight,
    StripBlocks,
    int8_activations,
    round_activations,
)
from runtime.model.kquants import KQuantWeight, round_q8k
from runtime.model.kquants import int8_activations as kquant_int8_activations

__all__ = ["CHUNK_ROWS", "Int4Weight", "Int8Weight", "Kernel", "Projection", "ROUNDS_ACTIVATIONS",
           "ROW_BUCKETS", "bucket", "should_pack"]

ROW_BUCKETS = (1, 8, 256)  # rows the kernels are timed at: a decode, a decode batch, a chunk
CHUNK_ROWS = 64  # calls of this many rows and up use the chunk bucket's kernel (bucket)
PACK_MAX_BYTES = 2 << 30
_PACK_HINT = 8  # batch size the oneDNN packed layout is tuned for
_INT8_MAX = 127.0
# kernels that round their input first -> that rounding (the chooser's check compares them
# with the reference kernel on the rounded input, runtime.model.kernel_choice)
ROUNDS_ACTIVATIONS = {"blocks_q8": round_activations, "kquant_q8": round_q8k}

Kernel = Callable[[torch.Tensor], torch.Tensor]

def bucket(rows: int) -> int:
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

    Until :func:`runtime.model.kernel_choice.choose_kernels` runs, every call uses the
    first candidate (``mkl`` or ``int_mm``).
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
        self._kernels: list[Kernel] = [self.kernel(first)] * buckets

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
            # blocks_f32 dequantizes the whole weight on every call: the exact kernel's work
            # and a GEMM besides, which only a chunk's rows can repay (the lm_head, decode
            # rows only, never takes it: a 128k vocabulary's 1 GB a call took 44 s to probe)
            f32 = ["blocks_f32"] if self.buckets > bucket(CHUNK_ROWS) else []
            return ["kquant", *f32] + (["kquant_q8"] if kquant_int8_activations() else [])
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
            names = ["int_mm", "int_mm_kn"]
            ops = kernels.ops()
            if ops is not None and ops.int8_strips_native():
                names.append("int8_strips")
            return names + (["fbgemm"] if _fbgemm_op() is not None else [])
        names = ["mkl", "mm"]
        if self.pack and _packing_ops() is not None:
            names.append("onednn")
        if self.pack and self.weight.dtype == torch.float32 \
                and kernels.ops() is not None:  # type: ignore[union-attr]
            names.append("f32_strips")
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

    def kernel(self, name: str) -> Kernel:
        """Build (once) the layout kernel ``name`` needs and return the kernel
        (``base@p``: ``base`` on calls padded with zero rows to at least ``p`` rows)."""
        if "@" in name:
            base, pad = name.split("@")
            return _padded(self.kernel(base), int(pad))
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
        if name == "f32_strips":
            packed = self._layouts.get(name)
            if packed is None:  # [N/16, K, 16]: kernels/strips_mm.cpp
                packed = self._layouts[name] = kernels.ops().pack_f32_strips(w)
            n, mm, bias = w.shape[0], kernels.ops().f32_strips_mm, _NO_BIAS if b is None else b
            return lambda x: mm(x, packed, bias, n)
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
            return lambda x: _int8_linear(x, lambda xq: torch._int_mm(xq, qt), w.scale, b)
        if name == "int_mm_kn":
            qt = self._layouts.get(name)
            if qt is None:
                qt = self._layouts[name] = w.q.t().contiguous()  # a copy, [in, out] row-major
            return lambda x: _int8_linear(x, lambda xq: torch._int_mm(xq, qt), w.scale, b)
        if name == "int8_strips":
            strips = self._layouts.get(name)
            if strips is None:  # (packed [N/16, K/4, 16, 4], each row's sum)
                strips = self._layouts[name] = tuple(kernels.ops().pack_int8_strips(w.q))
            packed, sums = strips  # type: ignore[misc]
            n, mm = w.q.shape[0], kernels.ops().int8_strips_mm
            return lambda x: _int8_linear(x, lambda xq: mm(xq, packed, sums, n), w.scale, b)
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
        self._kernels = [self.kernel(n) for n in names]
        self.kernel_names = list(names)
        for unused in set(self._layouts) - {n.split("@")[0] for n in names}:
            del self._layouts[unused]

    # -------------------------------------------------------------------- layouts

    @property
    def layout_names(self) -> frozenset[str]:
        """The kernels whose own copy of the weight this projection holds now (after
        :meth:`use`: only chosen ones)."""
        return frozenset(self._layouts)

    def layout(self, name: str) -> object | None:
        """The weight in the layout kernel ``name`` (a base name, no ``@p``) reads, where
        that kernel keeps a copy of its own and it was built: ``onednn`` and ``f32`` their
        oneDNN-packed weights (``f32``: widened to fp32), ``int_mm_kn`` W transposed
        (``[in, out]`` row-major int8), ``f32_strips`` (W in 16-row strips), ``int8_strips``
        (W in 16-row strips, each row's sum), ``fbgemm`` its prepacked weight (bias inside),
        ``blocks_q8`` a :class:`runtime.model.blocks.StripBlocks`, ``int4pack`` an
        :class:`Int4Weight`. None otherwise (the other kernels read :attr:`weight`)."""
        return self._layouts.get(name)

    def move_layout(self, name: str, layout: object) -> None:
        """Hold ``layout`` for kernel ``name`` instead of the current one (the same values
        at other addresses, e.g. on huge pages) and rebuild the kernels that read it.

        Raises:
            ValueError: the projection holds no layout for ``name``.
        """
        if name not in self._layouts:
            raise ValueError(f"projection holds no {name!r} layout to move "
                             f"(has: {', '.join(sorted(self._layouts)) or 'none'})")
        self._layouts[name] = layout
        self.use(self.kernel_names)  # the kernels' closures hold the layout: rebuild them

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Tensor[rows, in] -> Tensor[rows, out]."""
        return self._kernels[min(bucket(x.shape[0]), self.buckets - 1)](x)


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


def _int8_linear(x: torch.Tensor, int_mm: Callable[[torch.Tensor], torch.Tensor],
                 scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """An int8 projection: ``x``'s rows quantized, ``int_mm`` of them (their exact int32
    products with W, ``[m, out]``), scaled back (and the bias added)."""
    xf = x if x.dtype == torch.float32 else x.float()
    xq, xs = _quantize_rows(xf)
    acc = int_mm(xq)  # [m, out] int32, exact
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


