"""``PageStore.compact``: kept K/V copied at their positions, leading pages shared, the
identity of compacted pages, forks and snapshots of a compacted context, bad ``keep``."""

from __future__ import annotations

import random

import pytest
import torch

from pie_ctx.errors import InvalidArgument, OutOfPages
from runtime.kv.context import chain_nodes
from runtime.kv.store import PageStore

from .helpers import assert_unchanged, fill, make_store, prefill


def _entries(store, cid) -> list[torch.Tensor]:
    """Every token's K/V entry (all layers), in KV order."""
    table, ps = store.page_table(cid), store.page_size
    n = store.state(cid).seq_len
    return [store.pool.kv[table[i // ps], i % ps].clone() for i in range(n)]


def _noisy_store(num_pages: int = 32, page_size: int = 4):
    store = make_store(num_pages, page_size)
    store.pool.kv.copy_(torch.randn_like(store.pool.kv))  # each slot its own values
    return store


def test_compact_copies_kept_entries_at_their_positions() -> None:
    store = _noisy_store()
    cid = prefill(store, list(range(100, 118)))  # 4 committed pages + 2 working tokens
    before = _entries(store, cid)
    keep = [0, 1, 5, 6, 7, 12, 16, 17]
    assert store.compact(cid, keep) == 0  # token 2 dropped in page 0: nothing shared
    state = store.state(cid)
    assert state.seq_len == len(keep)
    assert store.tokens(cid) == [100 + i for i in keep]
    assert store.next_position(cid) == 18  # after the last kept token, not the length
    after = _entries(store, cid)
    for j, i in enumerate(keep):
        assert torch.equal(after[j], before[i])
    # 6 kept tokens came from committed pages: one full page commits, the rest is working
    assert state.num_committed_pages == 1 and state.num_working_tokens == 4
    store.check_invariants()


def test_wholly_kept_leading_pages_are_shared() -> None:
    store = _noisy_store()
    cid = prefill(store, list(range(20)))  # 5 committed pages
    ids = store.page_table(cid)
    keep = list(range(8)) + [9, 15, 19]  # pages 0 and 1 wholly kept
    assert store.compact(cid, keep) == 2
    assert store.page_table(cid)[:2] == ids[:2]  # the same physical pages
    assert store.state(cid).num_committed_pages == 2
    assert set(store.page_table(cid)[2:]).isdisjoint(ids[2:])
    store.check_invariants()


def test_compacted_pages_match_only_the_same_compaction_of_the_same_history() -> None:
    store = _noisy_store(64)
    a = prefill(store, list(range(1, 14)))  # 3 committed pages + 1 working token
    b = prefill(store, [1, 2, 3, 4, 0] + list(range(6, 14)))  # differs in a dropped token
    keep = [0, 1, 2, 3] + list(range(5, 13))
    store.compact(a, keep)
    store.compact(b, keep)
    assert store.tokens(a) == store.tokens(b)  # same tokens and positions ...
    na, nb = chain_nodes(store._states.get(a).tip), chain_nodes(store._states.get(b).tip)
    assert na[0] is nb[0]  # ... page 0 has the same history: shared
    assert na[1] is not nb[1] and na[1].page_hash != nb[1].page_hash  # page 1 does not
    c = prefill(store, list(range(1, 14)))
    store.compact(c, keep)  # the same compaction of the same history: deduplicated
    assert chain_nodes(store._states.get(c).tip)[1] is na[1]
    plain = prefill(store, [1, 2, 3, 4] + list(range(6, 14)))  # the same, written causally
    assert chain_nodes(store._states.get(plain).tip)[1].page_hash != na[1].page_hash
    store.check_invariants()


def test_fork_and_snapshot_of_a_compacted_context() -> None:
    store = _noisy_store()
    cid = prefill(store, list(range(30, 45)))
    store.compact(cid, [0, 3, 4, 10, 11, 12, 13, 14])
    fork = store.fork(cid)
    assert store.tokens(fork) == store.tokens(cid)
    assert store.next_position(fork) == 15
    assert _entries_equal(store, fork, cid)
    store.save_snapshot(cid, "s")
    opened = store.open_snapshot("s")
    assert store.tokens(opened) == store.tokens(cid)
    assert store.next_position(opened) == 15
    assert _entries_equal(store, opened, cid)
    fill(store, opened, [7])  # the next token continues from the last position
    assert store._states.get(opened).positions[-1] == 15
    store.check_invariants()


def _entries_equal(store, a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(_entries(store, a), _entries(store, b),
                                                strict=True))


@pytest.mark.parametrize("keep", [[], [2, 1], [1, 1], [0, 99], [-1, 0], "ab", [0.5]])
def test_bad_keep_is_a_typed_error_that_changes_nothing(keep) -> None:
    store = _noisy_store()
    cid = prefill(store, list(range(10)))
    assert_unchanged(store, lambda: store.compact(cid, keep), InvalidArgument)


def test_compact_without_room_changes_nothing() -> None:
    store = _noisy_store(num_pages=5, page_size=4)
    cid = prefill(store, list(range(19)))  # 4 committed pages + 1 working: the pool is full
    assert_unchanged(store, lambda: store.compact(cid, list(range(1, 19))), OutOfPages)


def test_random_keeps_hold_the_invariants() -> None:
    rng = random.Random(7)
    for page_size in (1, 3, 4):
        store = _noisy_store(96, page_size)
        cids = [prefill(store, [rng.randrange(3) for _ in range(rng.randrange(1, 25))])
                for _ in range(4)]
        cids.append(store.fork(cids[0]))
        for _ in range(30):
            cid = rng.choice(cids)
            n = store.state(cid).seq_len
            before = _entries(store, cid)
            keep = sorted(rng.sample(range(n), rng.randint(1, n)))
            store.compact(cid, keep)
            after = _entries(store, cid)
            assert all(torch.equal(after[j], before[i]) for j, i in enumerate(keep))
            store.check_invariants()
            fill(store, cid, [rng.randrange(3) for _ in range(rng.randrange(0, 6))])
            store.commit_full_pages(cid)
            store.check_invariants()


def test_a_durable_snapshot_of_a_compacted_context_reopens_after_a_restart(tmp_path) -> None:
    from .disk_helpers import check_kv, close, disk_store, write

    store = disk_store(tmp_path, num_pages=32)
    cid = store.create_context()
    write(store, cid, list(range(50, 69)))  # 4 committed pages + 3 working tokens
    keep = [0, 1, 2, 3, 4, 5, 6, 7, 9, 14, 16, 17, 18]
    store.compact(cid, keep)
    check_kv(store, cid)  # every kept token's K/V is the one it had, at its position
    store.save_snapshot(cid, "c")
    tokens, positions = store.tokens(cid), store.positions(cid)
    close(store)
    again = disk_store(tmp_path, num_pages=32)
    opened = again.open_snapshot("c")
    assert again.tokens(opened) == tokens and again.positions(opened) == positions == keep
    assert again.next_position(opened) == 19
    check_kv(again, opened)
    again.check_invariants()


def test_a_pool_that_cannot_copy_slots_refuses_compaction_and_changes_nothing() -> None:
    from runtime.kv.pool import PagePool

    class NoSlotCopies(PagePool):  # as a tensor-parallel pool declares itself
        __slots__ = ()
        copies_slots = False

    base = _noisy_store()
    store = PageStore(32, 4, num_layers=2, num_kv_heads=1, head_dim=2,
                      pool=NoSlotCopies(base.pool.shape))
    cid = prefill(store, list(range(10)))
    assert_unchanged(store, lambda: store.compact(cid, [0, 2, 4]), InvalidArgument)
    assert store.compact(cid, list(range(8))) == 2  # keeping whole pages copies no slot
