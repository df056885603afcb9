"""The chained page hash: one function, stable across processes, machines and versions.

``h_i = xxh3_64(encode(h_{i-1}, tokens_i, positions_i, extra_i))`` where ``encode`` is a
fixed little-endian layout::

    parent  u64   (the chain root for the first page: 0 for fp32 KV pages,
                   chain_root(kv_dtype) for other formats)
    count   u32   (number of tokens in the page)
    tokens  i64 x count
    positions i64 x count
    extra   u64

Snapshots and cross-process prefix sharing depend on this never changing; the test vectors
in ``tests/kv/test_hashing.py`` pin it. Python's ``hash()`` is never used (it is salted per
process). A hash is only an index: every hit is verified against the stored tokens,
positions, per-token extras and parent page before pages are shared.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import xxhash

from runtime.kv.types import PageHash

__all__ = ["hash_page", "fold_extras", "adapter_extras", "chain_root", "MAX_TOKEN",
           "MAX_EXTRA"]

MAX_TOKEN = 2**63 - 1
"""Largest token id or position the i64 encoding can carry."""

MAX_EXTRA = 2**64 - 1
"""Largest ``extra`` value the u64 encoding can carry."""

_EXTRAS_TAG = b"pie-ctx/extras/v1"
_ADAPTER_TAG = b"pie-ctx/adapter/v1"


def hash_page(
    parent: PageHash | None,
    tokens: Sequence[int],
    positions: Sequence[int],
    extra: int = 0,
) -> PageHash:
    """Chained hash of one page.

    Args:
        parent: hash of the previous page of the chain, ``None`` for the first page.
        tokens: token ids in the page (each in ``[0, 2**63)``).
        positions: rotary positions of those tokens, same length as ``tokens``.
        extra: u64 folding in anything else that changes the KV (mask pattern, adapter);
            0 for the default causal mask.

    Returns:
        The unsigned 64-bit page hash.

    Raises:
        ValueError: lengths differ (``struct.error`` for out-of-range values is a
            ``ValueError`` subclass too, but the store validates before calling).
    """
    n = len(tokens)
    if len(positions) != n:
        raise ValueError(f"hash_page: {n} tokens but {len(positions)} positions")
    data = struct.pack(
        f"<QI{n}q{n}qQ", 0 if parent is None else parent, n, *tokens, *positions, extra
    )
    return PageHash(xxhash.xxh3_64_intdigest(data))


def chain_root(kv_dtype: str) -> PageHash | None:
    """The parent hash of a chain's first page for pages stored as ``kv_dtype``.

    fp32 chains start from 0 (None) as they always have; any other format seeds the chain
    with a tag of its name, so pages of different formats never share a hash (a durable
    page index can hold both).
    """
    if kv_dtype == "fp32":
        return None
    return PageHash(xxhash.xxh3_64_intdigest(b"pie-ctx/kv-format/" + kv_dtype.encode()) or 1)


def adapter_extras(extras: list[int], adapter: int) -> list[int]:
    """Per-token extras of a context that runs LoRA adapter ``adapter`` (its u64 key,
    ``runtime.model.adapters``; 0 = the base model, whose extras are unchanged).

    The one place an adapter's identity enters the page hash: each extra ``e`` becomes a
    tagged xxh3-64 of ``(adapter, e)``, never 0, so pages computed under two adapters, or
    under an adapter and the base model, never hash or verify alike.
    """
    if adapter == 0:
        return extras
    memo: dict[int, int] = {}
    out = []
    for e in extras:
        v = memo.get(e)
        if v is None:
            v = memo[e] = xxhash.xxh3_64_intdigest(
                _ADAPTER_TAG + struct.pack("<QQ", adapter, e)) or 1
        out.append(v)
    return out


def fold_extras(extras: Sequence[int]) -> int:
    """Fold per-token ``extra`` values into the single u64 ``extra`` of a page.

    A page whose tokens all share one value ``e`` folds to ``e`` (so the default causal
    page folds to 0 and ``attach_prefix(..., extra=e)`` matches pages written with ``e``).
    Mixed values fold to a tagged xxh3-64 of the values, never 0, so a page written partly
    under a custom mask can never hash like a causal page.

    Args:
        extras: per-token extra values, each in ``[0, 2**64)``; must be non-empty.

    Returns:
        The page's u64 extra.
    """
    first = extras[0]
    for e in extras:
        if e != first:
            break
    else:
        return first
    digest = xxhash.xxh3_64_intdigest(_EXTRAS_TAG + struct.pack(f"<{len(extras)}Q", *extras))
    return digest or 1
