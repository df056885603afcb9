"""Which GGUF tensor formats run as stored (``weights="gguf"``), on which block family.

Owner: the one table from a GGUF tensor type to the family that computes it and that
family's kernels. Two families compute a file's blocks as they are stored:

* ``legacy`` (``runtime.model.blocks``): 32-weight blocks, :data:`BLOCK_FORMATS`
  (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0), kernels ``blocks`` (exact) and ``blocks_q8`` (int8 activations);
* ``kquant`` (``runtime.model.kquants``): 256-weight super-blocks, :data:`KQUANT_FORMATS`
  (Q4_K, Q5_K, Q6_K), kernels ``kquant`` (exact) and ``kquant_q8`` (``q8_K`` activations).

Every other type the ``gguf`` package can dequantize (Q2_K, Q3_K, the IQ and TQ formats,
...) is dequantized at load (the converted folder holds its exact float values): the model
runs, with one log line naming those formats (:func:`note_dequantized`). Float tensors
(F32, F16, BF16) are the converted folder's too.
"""

from __future__ import annotations

import logging
from collections import Counter

import numpy as np

from runtime.model.blocks import BLOCK_FORMATS, BlockWeight
from runtime.model.kquants import KQUANT_FORMATS, KQuantWeight

__all__ = ["FAMILIES", "KERNELS", "GGUFWeight", "cat_weights", "family_of", "note_dequantized",
           "weight_from_gguf"]

log = logging.getLogger(__name__)

GGUFWeight = BlockWeight | KQuantWeight
# family -> its kernels: (exact, on int8 activations)
KERNELS: dict[str, tuple[str, str]] = {"legacy": ("blocks", "blocks_q8"),
                                       "kquant": ("kquant", "kquant_q8")}
FLOAT_FORMATS = ("F32", "F16", "BF16")


def _families() -> dict[str, str]:
    table = {kind: "legacy" for kind in BLOCK_FORMATS}
    table.update({kind: "kquant" for kind in KQUANT_FORMATS})
    return table


FAMILIES: dict[str, str] = _families()  # GGUF type name -> family that runs it as stored


def family_of(kind: str) -> str | None:
    """The family that computes GGUF type ``kind`` as stored, or None (dequantized)."""
    return FAMILIES.get(kind)


def weight_from_gguf(raw: np.ndarray, kind: str, shape: tuple[int, int]) -> GGUFWeight | None:
    """The weight of a GGUF tensor's bytes ``raw`` (uint8) of type ``kind`` and ``shape``
    [out, in], in its family's class, or None when no family runs ``kind`` as stored (the
    converted folder's dequantized floats serve it).

    Raises:
        ModelError: the bytes do not fit the shape (a corrupt file).
    """
    family = family_of(kind)
    if family == "legacy":
        return BlockWeight.from_gguf(raw, kind, shape)
    if family == "kquant":
        return KQuantWeight.from_gguf(raw, kind, shape)
    return None


def cat_weights(parts: list[GGUFWeight]) -> GGUFWeight | None:
    """The weights stacked along the output rows (a fused qkv / gate_up) by their family's
    ``cat``, or None where no one weight holds them (families or bit widths differ: the
    caller keeps that projection in float, the file's exact values)."""
    if all(isinstance(p, BlockWeight) for p in parts):
        return BlockWeight.cat(parts)  # type: ignore[arg-type]
    if all(isinstance(p, KQuantWeight) for p in parts):
        return KQuantWeight.cat(parts)  # type: ignore[arg-type]
    return None


def note_dequantized(counts: Counter[str], path: object) -> None:
    """Log (once, INFO) the formats of ``path``'s matrices that are not computed as stored
    and were dequantized at load: ``counts`` is type name -> number of tensors."""
    if counts:
        kinds = ", ".join(f"{kind} x{n}" for kind, n in sorted(counts.items()))
        log.info("%s: tensors in %s run dequantized to float32 (computed as stored: %s)",
                 path, kinds, ", ".join(FAMILIES))
