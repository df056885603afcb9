"""``SeqInput``: one context's share of a model call, as plain data.

Torch-free on purpose: the scheduler builds these (and is tested without a model), the
model runner consumes them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

__all__ = ["SeqInput", "ScoreQuery"]


@dataclass(slots=True)
class SeqInput:
    """One context's share of a forward."""

    tokens: list[int]  # new tokens of this context in this step
    positions: list[int]  # their rotary positions (arbitrary)
    page_table: list[int]  # every page of the context, in KV order
    num_cached: int  # KV entries already present before these tokens
    logit_indices: list[int]  # which of `tokens` need logits (indices into tokens)
    mask: np.ndarray | None = None  # bool [len(tokens), num_cached + len(tokens)]; None = causal
    adapter: int = 0  # the LoRA adapter's key (runtime.model.adapters); 0 = the base model
    scores: list[ScoreQuery] | None = None  # attention weights wanted (runtime.model.scores)


@dataclass(slots=True)
class ScoreQuery:
    """Attention weights wanted from one sequence of a forward (``runtime.model.scores``).

    The runner fills ``out`` (float32, on CPU): the softmax weight each of the sequence's
    ``num_cached + len(tokens)`` KV entries received from the query ``rows``, averaged
    over query heads (``heads="mean"``) or per head (``"all"``, a leading ``[H]``), the
    rows combined by ``reduce`` (``"sum"``/``"max"``), and the ``layers`` combined the
    same way unless ``by_layer`` (a leading ``[len(layers)]``)."""

    rows: list[int]  # indices into the sequence's new tokens
    layers: list[int]
    reduce: str = "sum"
    heads: str = "mean"
    by_layer: bool = False
    out: Any = field(default=None)
