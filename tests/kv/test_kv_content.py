"""KV content: bytes written through the store come back exactly through the page table.

A fake model computes each token's K/V as a deterministic function of its whole prefix
(as a real model does), writes it into the slots ``write_tokens`` returns, and a dense
reference keeps the same tensors in a plain list per context. After fork, truncate,
overwrite, commit with dedup, prefix reuse, snapshots, release and eviction (with the
freed pages scribbled over), gathering every live context's pages must reproduce the
dense reference bit for bit.
"""

from __future__ import annotations

import random

import pytest
import torch
import xxhash

from runtime.kv import ContextId, PageStore

from .reference import Entry

L, H, D = 2, 2, 3  # layers, kv heads, head dim


def kv_of(prefix: list[Entry]) -> torch.Tensor:
    """K/V of the last token of ``prefix``: [L, 2, H, D], a function of the whole prefix."""
    seed = xxhash.xxh3_64_intdigest(repr(prefix).encode()) % (2**63)
    return torch.randn((L, 2, H, D), generator=torch.Generator().manual_seed(seed))


class Harness:
    """A PageStore driven like an engine, plus the dense reference of every context."""

    def __init__(self, num_pages: int = 24, page_size: int = 4) -> None:
        self.store = PageStore(num_pages, page_size, num_layers=L, num_kv_heads=H, head_dim=D)
        self.entries: dict[ContextId, list[Entry]] = {}
        self.dense: dict[ContextId, list[torch.Tensor]] = {}

    def create(self) -> ContextId:
        cid = self.store.create_context()
        self.entries[cid], self.dense[cid] = [], []
        return cid

    def write(self, cid: ContextId, tokens: list[int], extra: int = 0) -> None:
        """Reserve, record and 'compute' tokens; commits nothing."""
        store, ps = self.store, self.store.page_size
        s = store.state(cid)
        room = s.num_working_pages * ps - s.num_working_tokens
        if len(tokens) > room:
            assert store.reserve_working_pages(cid, -(-(len(tokens) - room) // ps))
        start = store.next_position(cid)
        positions = list(range(start, start + len(tokens)))
        slots = store.write_tokens(cid, tokens, positions, extra)
        for tok, pos, (page_id, slot) in zip(tokens, positions, slots, strict=True):
            self.entries[cid].append((tok, pos, extra))
            value = kv_of(self.entries[cid])
            store.pool.kv[page_id, slot] = value  # [L, 2, H, D]
            self.dense[cid].append(value)

    def fork(self, cid: ContextId) -> ContextId:
        child = self.store.fork(cid)
        self.entries[child] = list(self.entries[cid])
        self.dense[child] = list(self.dense[cid])
        return child

    def truncate(self, cid: ContextId, n: int) -> None:
        self.store.truncate_working_page_tokens(cid, n)
        if n:
            del self.entries[cid][-n:], self.dense[cid][-n:]

    def attach(self, cid: ContextId, tokens: list[int]) -> int:
        start = self.store.next_position(cid)
        positions = list(range(start, start + len(tokens)))
        n = self.store.attach_prefix(cid, tokens, positions)
        for tok, pos in zip(tokens[: n * self.store.page_size], positions, strict=False):
            self.entries[cid].append((tok, pos, 0))
            self.dense[cid].append(kv_of(self.entries[cid]))
        return n

    def release(self, cid: ContextId) -> None:
        self.store.release(cid)
        del self.entries[cid], self.dense[cid]

    def scribble_free_pages(self) -> None:
        """Overwrite every free page: a freed page must never still be read."""
        free = self.store.pool.free_ids()
        if free:
            self.store.pool.kv[free] = float("nan")

    def check(self) -> None:
        store = self.store
        store.check_invariants()
        for cid, dense in self.dense.items():
            table = store.page_table(cid)
            seq_len = store.state(cid).seq_len
            assert seq_len == len(dense)
            assert store.tokens(cid) == [e[0] for e in self.entries[cid]]
            if not table:
                continue
            pages = store.pool.kv[table]  # [n, ps, L, 2, H, D]
            n, ps = len(table), store.page_size
            gathered = pages.reshape(n * ps, L, 2, H, D).permute(1, 2, 0, 3, 4)[:, :, :seq_len]
            if dense:
                expected = torch.stack(dense).permute(1, 2, 0, 3, 4)  # [L, 2, seq, H, D]
                assert torch.equal(gathered, expected), f"context {cid} KV differs"


def test_scripted_fork_truncate_dedup_attach_snapshot_evict() -> None:
    h = Harness(num_pages=16)
    store = h.store
    base = h.create()
    h.write(base, list(range(10)))  # 2 full pages + 2 tokens
    store.commit_full_pages(base)
    h.check()
    f = h.fork(base)  # working page (2 tokens) copied
    h.write(base, [50, 51])
    h.write(f, [60, 61, 62])
    h.check()
    h.truncate(f, 2)  # back to [.., 8, 9, 60]
    h.write(f, [70, 71, 72, 73, 74])  # overwrites the truncated slots
    h.check()
    store.commit_full_pages(base)
    store.commit_full_pages(f)
    twin = h.create()
    h.write(twin, list(range(10)) + [50, 51])  # same content as base: dedups on commit
    working_pages = store.page_table(twin)
    assert store.commit_full_pages(twin) == 3
    assert store.page_table(twin) == store.page_table(base)
    assert set(working_pages).isdisjoint(store.page_table(twin))
    h.scribble_free_pages()
    h.check()
    reuse = h.create()
    assert h.attach(reuse, list(range(10)) + [50, 51, 99]) == 3  # no compute
    h.write(reuse, [99])
    h.check()
    store.save_snapshot(f, "snap")
    h.release(f)
    for cid in (base, twin, reuse):
        h.release(cid)
    assert store.stats().num_pages_cached > 0
    opened = store.open_snapshot("snap")
    h.entries[opened] = [(t, p, 0) for p, t in enumerate(store.tokens(opened))]
    h.dense[opened] = [kv_of(h.entries[opened][: i + 1]) for i in range(len(h.entries[opened]))]
    # Fill the pool: cached pages get evicted and scribbled; survivors must be intact.
    hog = h.create()
    while store.num_pages_available() >= 1:
        h.write(hog, [7] * store.page_size)
    h.scribble_free_pages()
    assert store.stats().num_evictions > 0
    h.check()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_operations_keep_kv_exact(seed: int) -> None:
    rng = random.Random(seed)
    h = Harness(num_pages=24, page_size=2)
    store, ps = h.store, h.store.page_size
    h.create()
    for _ in range(300):
        cids = list(h.dense)
        cid = rng.choice(cids) if cids else h.create()
        op = rng.random()
        s = store.state(cid)
        if op < 0.35:
            tokens = [rng.randrange(2) for _ in range(rng.randint(1, 5))]
            need = max(0, len(tokens) - (s.num_working_pages * ps - s.num_working_tokens))
            if -(-need // ps) <= store.num_pages_available():
                h.write(cid, tokens)
        elif op < 0.5:
            store.commit_full_pages(cid)
        elif op < 0.6 and s.num_working_pages <= store.num_pages_available():
            h.fork(cid)
        elif op < 0.7:
            h.truncate(cid, rng.randint(0, s.num_working_tokens))
        elif op < 0.8 and s.num_working_tokens == 0:
            h.attach(cid, [rng.randrange(2) for _ in range(rng.randint(0, 9))])
        elif op < 0.9 and len(cids) > 1:
            h.release(cid)
        elif op < 0.95:
            h.create()
        h.scribble_free_pages()
        h.check()
