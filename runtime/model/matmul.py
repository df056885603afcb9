"""Projections (``x @ W.T + b``) that pick the fastest CPU kernel for the batch at hand.

Owner: the model's fused weights. On CPU in fp32, MKL's sgemm (``F.linear``) is best for a
single row (one decoding sequence), but slow for a few rows: 8-row projections of SmolLM2
run ~1.4x faster through oneDNN with the weight reordered ("packed") once at load. A
:class:`Projection` keeps the weight and, when packing is enabled, its packed copy, and
routes each call by row count. Packing doubles the projection weights' memory, so it is
on by default only for models whose weights take at most ``PACK_MAX_BYTES``; set
``PIE_CTX_PACKED_WEIGHTS=0`` (or ``1``) to force it off (or on).

Invariants: both paths compute the same projection (checked at load against ``F.linear``);
results may differ in the last bits (accumulation order), never more.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F

__all__ = ["Projection", "should_pack"]

log = logging.getLogger(__name__)

PACKED_MIN_ROWS = 2  # a single row stays on MKL's gemv path
PACK_MAX_BYTES = 2 << 30
_PACK_HINT = 8  # batch size the packed layout is tuned for


def _packing_ops() -> tuple[object, object] | None:
    mkldnn = getattr(torch.ops, "mkldnn", None)
    reorder = getattr(mkldnn, "_reorder_linear_weight", None) if mkldnn is not None else None
    linear = getattr(mkldnn, "_linear_pointwise", None) if mkldnn is not None else None
    if reorder is None or linear is None or not torch.backends.mkldnn.is_available():
        return None
    return reorder, linear


def should_pack(device: torch.device, dtype: torch.dtype, weight_bytes: int) -> bool:
    """Whether projections of a model this size on this device get packed copies."""
    forced = os.environ.get("PIE_CTX_PACKED_WEIGHTS")
    if device.type != "cpu" or dtype != torch.float32 or _packing_ops() is None:
        return False
    if forced is not None:
        return forced not in ("0", "false", "no", "")
    return weight_bytes <= PACK_MAX_BYTES


class Projection:
    """``x @ weight.T + bias`` for ``x`` of shape ``[rows, in]``.

    Args:
        weight: Tensor[out, in].
        bias: Tensor[out] or None.
        pack: also keep a oneDNN-packed copy for multi-row calls (falls back silently,
            with a log line, if the packed kernel is unavailable or disagrees).
    """

    __slots__ = ("weight", "bias", "_packed", "_linear")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                 pack: bool = False) -> None:
        self.weight = weight
        self.bias = bias
        self._packed: torch.Tensor | None = None
        self._linear = None
        if pack:
            self._try_pack()

    def _try_pack(self) -> None:
        ops = _packing_ops()
        if ops is None:
            return
        reorder, linear = ops
        try:
            packed = reorder(self.weight, _PACK_HINT)  # type: ignore[operator]
            probe = torch.randn(_PACK_HINT, self.weight.shape[1], dtype=self.weight.dtype)
            got = linear(probe, packed, self.bias, "none", [], "")  # type: ignore[operator]
            want = F.linear(probe, self.weight, self.bias)
            if not torch.allclose(got, want, rtol=1e-4, atol=1e-4):
                raise RuntimeError("packed projection disagrees with F.linear")
        except (RuntimeError, TypeError) as e:
            log.info("packed projections unavailable (%s); using F.linear", e)
            return
        self._packed, self._linear = packed, linear

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Tensor[rows, in] -> Tensor[rows, out]."""
        if self._packed is not None and x.shape[0] >= PACKED_MIN_ROWS:
            return self._linear(x, self._packed, self.bias, "none", [], "")  # type: ignore[misc]
        return F.linear(x, self.weight, self.bias)
