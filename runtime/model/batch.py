"""``SeqInput``: one context's share of a model call, as plain data.

Torch-free on purpose: the scheduler builds these (and is tested without a model), the
model runner consumes them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

__all__ = ["SeqInput"]


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
