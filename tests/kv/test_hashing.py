"""The chained page hash: pinned test vectors, encoding, sensitivity, extras folding."""

from __future__ import annotations

import struct
import subprocess
import sys

import xxhash

from runtime.kv.hashing import fold_extras, hash_page

PAGE1 = ([1, 2, 3, 4], [0, 1, 2, 3])
PAGE2 = ([5, 6, 7, 8], [4, 5, 6, 7])
H_EMPTY = 0x16773CEB7FE497B1
H1 = 0x4E315D72D61DC311
H2 = 0x7F6F76667BD1EA94
H1_EXTRA7 = 0xAEFFE34081496A6E


def test_vectors_are_pinned() -> None:
    # These values must never change: snapshots and cross-process sharing depend on them.
    assert hash_page(None, [], [], 0) == H_EMPTY
    assert hash_page(None, *PAGE1) == H1
    assert hash_page(H1, *PAGE2) == H2
    assert hash_page(None, *PAGE1, extra=7) == H1_EXTRA7
    assert fold_extras([0, 1, 0, 0]) == 0x88A33517D858CA22


def test_encoding_is_the_documented_layout() -> None:
    data = (
        struct.pack("<QI", H1, 4)
        + b"".join(struct.pack("<q", t) for t in PAGE2[0])
        + b"".join(struct.pack("<q", p) for p in PAGE2[1])
        + struct.pack("<Q", 0)
    )
    assert xxhash.xxh3_64_intdigest(data) == H2


def test_root_parent_is_zero() -> None:
    assert hash_page(None, *PAGE1) == hash_page(0, *PAGE1)  # type: ignore[arg-type]


def test_kv_formats_seed_their_chains_apart() -> None:
    """fp32 chains keep the zero root; an int8 page never shares a hash with an fp32 one."""
    from runtime.kv import PageStore
    from runtime.kv.hashing import chain_root

    assert chain_root("fp32") is None
    assert chain_root("int8") not in (None, 0)
    assert hash_page(chain_root("int8"), *PAGE1) != hash_page(None, *PAGE1)
    hashes = {}
    for kv_dtype in ("fp32", "int8"):
        store = PageStore(8, 4, 1, 1, 2, kv_dtype=kv_dtype)
        cid = store.create_context()
        store.reserve_working_pages(cid, 1)
        store.write_tokens(cid, [1, 2, 3, 4], [0, 1, 2, 3])
        store.commit_full_pages(cid)
        hashes[kv_dtype] = store._states.get(cid).tip.page_hash
        store.check_invariants()
    assert hashes["fp32"] == hash_page(None, [1, 2, 3, 4], [0, 1, 2, 3])
    assert hashes["int8"] == hash_page(chain_root("int8"), [1, 2, 3, 4], [0, 1, 2, 3])


def test_every_field_changes_the_hash() -> None:
    base = hash_page(None, *PAGE1)
    assert hash_page(1, *PAGE1) != base  # type: ignore[arg-type]
    assert hash_page(None, [1, 2, 3, 5], PAGE1[1]) != base
    assert hash_page(None, PAGE1[0], [0, 1, 2, 4]) != base
    assert hash_page(None, *PAGE1, extra=1) != base
    # Moving a token across the tokens/positions boundary is caught by the count field.
    assert hash_page(None, [1, 2, 3], [4, 0, 1]) != hash_page(None, [1, 2], [3, 4])


def test_stable_across_processes() -> None:
    code = "from runtime.kv.hashing import hash_page; print(hash_page(None, [1,2,3,4], [0,1,2,3]))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert int(out) == H1


def test_fold_extras() -> None:
    assert fold_extras([0, 0, 0]) == 0  # causal pages keep extra 0
    assert fold_extras([5, 5]) == 5  # uniform value folds to itself
    mixed = fold_extras([0, 5])
    assert mixed not in (0, 5)
    assert fold_extras([5, 0]) != mixed  # order matters
