"""Compaction: keep some tokens of a context, anywhere, and drop the rest.

Owns the page step behind ``PageStore.compact`` (``compact_state``) and the identity a
kept token takes (``compacted_extras``). The store validates ``keep`` first
(``check_keep``, the contract's ``checks.keep``); then, all or nothing, this module plans
the new contents (a ``runtime.kv.states.Rewrite``) and ``ContextStates``, the states'
owner, applies them:

* the leading committed pages that are wholly kept, with every token before them kept,
  stay on the chain as they are: shared, not copied (their K/V and identity are unchanged);
* every other kept token's K/V is copied, every layer, into fresh pages, in one pass of
  slot runs (``PagePool.copy_slots``), with the position it was computed at;
* the new full pages made only of tokens that were committed are committed (so the same
  compaction of the same history is found again); the rest stays in working pages.

Identity. A kept token's K/V was computed attending to everything before it in the
original context, dropped tokens included. So once a token before it was dropped, the
token's per-token ``extra`` (which enters its page's hash and is verified on every match)
becomes a tagged hash of the original chain up to and including the token (its parent
page's hash, then the tokens, positions and extras of its page up to it). The new chain
itself names the kept tokens before it with their positions, so a compacted page matches
only the same compaction of the same history. Tokens before the first dropped one keep
their extras: their history is unchanged, and so are their K/V.
"""

from __future__ import annotations

import struct
from operator import index

import xxhash

from pie_ctx.proto import checks
from pie_ctx.proto.errors import InvalidArgument
from runtime.kv.context import PageState, chain_nodes
from runtime.kv.hashing import fold_extras, hash_page
from runtime.kv.states import ContextStates, Rewrite
from runtime.kv.types import PageHash

__all__ = ["check_keep", "compact_state", "compacted_extras"]


def check_keep(keep: object, seq_len: int) -> list[int]:
    """``keep`` checked by the contract (``pie_ctx.proto.checks.keep``); numpy integers
    are taken as ints.

    Raises:
        InvalidArgument: empty, not ints, unsorted or repeated, or out of range.
    """
    if isinstance(keep, list | tuple | range):
        try:
            keep = [i if isinstance(i, bool) else index(i) for i in keep]
        except TypeError:
            pass  # the contract names the bad item
    return checks.keep(keep, seq_len)


_COMPACT_TAG = b"pie-ctx/compact/v1"


def compacted_extras(history: PageHash, extra: int) -> int:
    """The extra of a kept token whose history lost tokens: never 0 (never causal)."""
    return xxhash.xxh3_64_intdigest(_COMPACT_TAG + struct.pack("<QQ", history, extra)) or 1


def _history(root: PageHash | None, toks: list[int], poss: list[int], extras: list[int],
             page_hashes: list[PageHash], ps: int, i: int) -> PageHash:
    """Hash of the original chain up to and including token ``i``."""
    p = i // ps
    parent = root if p == 0 else page_hashes[p - 1]
    lo = p * ps
    return hash_page(parent, toks[lo: i + 1], poss[lo: i + 1], fold_extras(extras[lo: i + 1]))


def compact_state(states: ContextStates, state: PageState, keep: list[int]) -> int:
    """Compact ``state`` in place to the tokens ``keep`` (checked by ``check_keep``).

    Returns:
        The number of leading committed pages shared rather than copied.

    Raises:
        OutOfPages: the fresh pages cannot be allocated (nothing changed).
        InvalidArgument: the pool cannot copy single slots (tensor parallel), nothing changed.
    """
    ps = states.page_size
    pool, trie = states.pool, states.trie
    nodes = chain_nodes(state.tip)
    nc = len(nodes)
    # the whole original sequence, and where each token's K/V sits
    toks = [t for n in nodes for t in n.tokens] + state.tokens
    poss = [q for n in nodes for q in n.positions] + state.positions
    extras = [e for n in nodes for e in n.extras] + state.extras
    pages = [n.page_id for n in nodes] + state.working
    page_hashes = [n.page_hash for n in nodes]
    parent = page_hashes[-1] if page_hashes else trie.root_hash
    for w in range(len(state.tokens) // ps):  # the working pages' chain, as if committed
        lo = (nc + w) * ps
        parent = hash_page(parent, toks[lo:lo + ps], poss[lo:lo + ps],
                           fold_extras(extras[lo:lo + ps]))
        page_hashes.append(parent)

    first_drop = next((j for j, i in enumerate(keep) if i != j), len(keep))  # == keep[j] > j
    shared = min(first_drop // ps, nc)
    rest = keep[shared * ps:]
    n_new = -(-len(rest) // ps)
    if rest and not pool.copies_slots:
        raise InvalidArgument("compact needs to copy single token slots, which this engine's "
                              "pool (tensor parallel) does not do yet; run without --tp")
    new_pages = states.allocate_or_raise(n_new, "compact") if n_new else []

    # one pass over the kept tokens: runs of consecutive source slots to consecutive slots
    src = [(pages[i // ps], i % ps) for i in rest]
    dst = [(new_pages[j // ps], j % ps) for j in range(len(rest))]
    pool.copy_slots(dst, src)

    new_toks = [toks[i] for i in rest]
    new_poss = [poss[i] for i in rest]
    new_extras = []
    for j, i in enumerate(rest, start=shared * ps):
        if j == i:  # nothing before it was dropped: the same history, the same identity
            new_extras.append(extras[i])
        else:
            new_extras.append(compacted_extras(
                _history(trie.root_hash, toks, poss, extras, page_hashes, ps, i), extras[i]))
    committed_kept = sum(1 for i in rest if i < nc * ps)
    states.rewrite(state, Rewrite(nodes[shared - 1] if shared else None, new_pages, new_toks,
                                  new_poss, new_extras, committed_kept // ps))
    return shared
