"""Input validation for the page store: every check runs before any state changes.

Owns nothing. ``page_inputs`` either returns normalised plain-``int`` values or raises
``InvalidArgument`` with a message that says what to pass instead. Integers are accepted
through ``operator.index`` (so numpy integers work). Counts use the contract's
``pie_ctx.proto.checks.count``.
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import index

from pie_ctx.proto.errors import InvalidArgument
from runtime.kv.hashing import MAX_EXTRA, MAX_TOKEN

__all__ = ["Extra", "page_inputs"]

Extra = int | Sequence[int]


def _int_list(values: Sequence[int], what: str, limit: int) -> list[int]:
    try:
        out = [index(v) for v in values]
    except TypeError:
        raise InvalidArgument(f"{what} must be a sequence of ints") from None
    for v in out:
        if v < 0 or v > limit:
            raise InvalidArgument(f"{what} must be in [0, {limit}], got {v}")
    return out


def page_inputs(
    tokens: Sequence[int], positions: Sequence[int], extra: Extra
) -> tuple[list[int], list[int], list[int]]:
    """Validate a (tokens, positions, extra) triple; return three equal-length lists."""
    toks = _int_list(tokens, "tokens", MAX_TOKEN)
    poss = _int_list(positions, "positions", MAX_TOKEN)
    if len(toks) != len(poss):
        raise InvalidArgument(f"got {len(toks)} tokens but {len(poss)} positions; pass one each")
    if isinstance(extra, bool):
        raise InvalidArgument("extra must be an int or a sequence of ints, not a bool")
    if isinstance(extra, int):
        if extra < 0 or extra > MAX_EXTRA:
            raise InvalidArgument(f"extra must be in [0, 2**64), got {extra}")
        extras = [extra] * len(toks)
    else:
        extras = _int_list(extra, "extra", MAX_EXTRA)
        if len(extras) != len(toks):
            raise InvalidArgument(f"got {len(toks)} tokens but {len(extras)} extras")
    return toks, poss, extras
