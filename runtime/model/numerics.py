"""How a native model computes: decided once, from the boot options and the machine.

Owner: ``boot_engine`` decides one :class:`Numerics` per engine (``Numerics.decide``: its
``deterministic``, ``weights`` and dtype options, checked against the device and pie-ctx's
kernels) and hands it to the :class:`runtime.model.runner.ModelRunner`; nothing below reads
the options again. The record says:

* ``deterministic``: batch-invariant numerics (docs/performance.md), where they can run:
  on CPU with pie-ctx's kernels built (:func:`deterministic_here`; elsewhere it is logged
  and the record says False, as ``EngineInfo.deterministic`` does);
* ``weight_format``: ``"fp32"`` (unquantized, in the compute dtype), ``"int8"``
  (``runtime.model.quant``) or ``"gguf"`` (``runtime.model.gguf_weights``);
* ``dtype``: the compute dtype of the activations;
* ``attention``: the attention backend asked for (``$PIE_CTX_ATTENTION``, read here,
  or ``auto``; ``runtime.model.attention.select_backend`` decides with the pool).

:func:`finish_weights` is the one place a model's weights become final: the weight format
turns the float projections into its own (int8, GGUF blocks), then every projection's
kernels are chosen, once (``runtime.model.kernel_choice.choose_kernels``, under the
record's determinism).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pie_ctx.proto.errors import InvalidArgument
from runtime.model import kernels
from runtime.model.attention import attention_choice
from runtime.model.gguf_weights import strips_on_huge_pages, use_blocks
from runtime.model.kernel_choice import choose_kernels
from runtime.model.quant import WEIGHT_FORMATS, quantize_int8

if TYPE_CHECKING:
    from runtime.model.blocks import BlockWeight
    from runtime.model.model import Transformer

__all__ = ["Numerics", "deterministic_here", "finish_weights"]

log = logging.getLogger(__name__)


def deterministic_here(device: torch.device) -> bool:
    """Whether batch-invariant numerics can run on ``device`` (CPU, with pie-ctx's kernels
    built: the invariant attention is theirs); logs why not."""
    if device.type != "cpu":
        log.warning("deterministic numerics are a CPU mode; %s runs the fastest kernels, "
                    "and a row's bits may depend on its batch", device)
        return False
    if kernels.ops() is None:
        log.warning("deterministic numerics need pie-ctx's CPU kernels (not built or "
                    "PIE_CTX_KERNELS=0); a row's bits may depend on its batch")
        return False
    return True


@dataclass(frozen=True, slots=True)
class Numerics:
    """How one native model computes (see the module docstring); build it with
    :meth:`decide`."""

    deterministic: bool
    weight_format: str
    dtype: torch.dtype
    attention: str

    @classmethod
    def decide(cls, device: torch.device, dtype: torch.dtype, *, deterministic: bool = False,
               weight_format: str = "fp32", attention: str | None = None) -> Numerics:
        """The numerics a model on ``device`` computing in ``dtype`` runs with.

        Args:
            device: the model's device.
            dtype: the compute dtype.
            deterministic: ask for batch-invariant numerics; honoured where
                :func:`deterministic_here` says so (else logged, and False).
            weight_format: one of ``runtime.model.quant.WEIGHT_FORMATS``.
            attention: the attention backend asked for; default ``$PIE_CTX_ATTENTION``,
                else ``auto``.

        Raises:
            InvalidArgument: an unknown weight format or attention backend.
        """
        if weight_format not in WEIGHT_FORMATS:
            raise InvalidArgument(f"weights must be one of {', '.join(WEIGHT_FORMATS)}, "
                                  f"got {weight_format!r}")
        return cls(deterministic=deterministic and deterministic_here(device),
                   weight_format=weight_format, dtype=dtype,
                   attention=attention_choice(attention))


def finish_weights(model: Transformer, numerics: Numerics, *,
                   calibration: list[int] | None = None,
                   blocks: dict[str, BlockWeight] | None = None,
                   head: Callable[[Transformer], None] | None = None) -> None:
    """Make ``model``'s projections final, then choose their kernels once.

    Args:
        model: a ``Transformer`` as built (float, or on a GGUF's blocks), no kernels
            chosen yet.
        numerics: the model's numerics: the weight format to convert to, and the
            determinism the kernels are chosen under.
        calibration: token ids int8 measures activation ranges on (with ``"gguf"``: the
            pass that picks ``blocks_q8``'s outlier channels).
        blocks: with ``"gguf"``, the block weights of the model's GGUF
            (``runtime.model.loader.load_blocks``; ``{}``: the model holds them already);
            None: Q4_1 blocks made now.
        head: replaces the model's lm_head before the choice (tensor parallelism's
            vocab-parallel head, ``runtime.distributed``).

    Raises:
        InvalidArgument: the weight format cannot run this model (see ``quantize_int8``,
            ``use_blocks``).
        ModelError: deterministic, and no row-count-invariant kernel fits a projection.
    """
    if numerics.weight_format == "int8":
        quantize_int8(model, calibration or [])
    elif numerics.weight_format == "gguf":
        use_blocks(model, blocks, calibration)
    if head is not None:
        head(model)
    model.kernel_report = choose_kernels(model.projections(),
                                         deterministic=numerics.deterministic)
    if numerics.weight_format == "gguf":  # the chosen blocks_q8 strips, on huge pages
        strips_on_huge_pages(model.projections())
