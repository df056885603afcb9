"""Input validation for the page store: every check runs before any state changes.

Owns nothing. Each function either returns normalised plain-``int`` values or raises
``InvalidArgument`` with a message that says what to pass instead. Integers are accepted
through ``operator.index`` (so numpy integers work); ``bool`` is rejected where a count is
expected.
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import index

from pie_ctx.errors import InvalidArgument
from runtime.kv.hashing import MAX_EXTRA, MAX_TOKEN

__all__ = ["Extra", "count_arg", "page_inputs"]

Extra = int | Sequence[int]


def count_arg(value: object, what: str) -> int:
    """A count ``>= 0`` (not a bool), or ``InvalidArgument``."""
    if isinstance(value, bool):
        raise InvalidArgument(f"{what} must be an int >= 0, got {value!r}")
    try:
        n = index(value)  # type: ignore[arg-type]
    except TypeError:
        raise InvalidArgument(f"{what} must be an int >= 0, got {value!r}") from None
    if n < 0:
        raise InvalidArgument(f"{what} must be >= 0, got {n}")
    return n


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
