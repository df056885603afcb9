"""Argument checks shared by the SDK (early, client-side) and the engine (authoritative)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from pie_ctx.errors import InvalidArgument

__all__ = ["token_ids"]


def token_ids(tokens: Iterable[Any], vocab_size: int, what: str) -> list[int]:
    """A list copy of ``tokens`` after checking each is an int id in ``[0, vocab_size)``.

    Raises:
        InvalidArgument: an id is not an int or is out of range (``what`` names the caller).
    """
    ids = list(tokens)
    for t in ids:
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size:
            raise InvalidArgument(f"{what}: token id {t!r} is not in [0, {vocab_size}) for this model")
    return ids
