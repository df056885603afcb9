"""Hypothesis state machine: random operation sequences against the dense reference.

Every rule drives one PageStore operation, valid or not. Invalid calls must raise the
typed error the reference predicts and leave ``describe_state`` (every page, count, LRU
position and counter) unchanged. After every step the invariant checker runs and every
context and snapshot is compared with the reference (counters, tokens, next position,
page-table length, engine-wide page accounting).

CI runs a few hundred examples; ``PIE_CTX_SLOW=1`` selects 10,000.
"""

from __future__ import annotations

import os
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from pie_ctx.errors import (
    ContextClosed,
    InvalidArgument,
    OutOfPages,
    SnapshotExists,
    SnapshotNotFound,
)
from runtime.kv import ContextId, PageStore
from runtime.kv.invariants import describe_state

from .reference import DenseReference, Entry, RefContext

SLOW = os.environ.get("PIE_CTX_SLOW") == "1"
NAMES = ["a", "b", "c"]
NAMESPACES = ["default", "other"]
OWNERS = [None, "alice", "bob"]  # per-owner page counts are checked after every step
TOKENS = st.integers(0, 2)  # a small alphabet so prefixes collide and dedup often
EXTRAS = st.sampled_from([0, 0, 0, 1])


class PageStoreMachine(RuleBasedStateMachine):
    """Drives a small PageStore and a DenseReference in lockstep."""

    def __init__(self) -> None:
        super().__init__()
        self.store: PageStore
        self.ref: DenseReference
        self.ids: list[ContextId] = []

    @initialize(num_pages=st.integers(4, 16), page_size=st.sampled_from([1, 2, 3]))
    def setup(self, num_pages: int, page_size: int) -> None:
        self.store = PageStore(num_pages, page_size, num_layers=1, num_kv_heads=1, head_dim=1)
        self.ref = DenseReference(num_pages, page_size)

    # -- helpers -----------------------------------------------------------------------

    def _cid(self, data: st.DataObject) -> ContextId:
        """A live id most of the time, else a released or never-issued one."""
        live = list(self.ref.contexts)
        if live and data.draw(st.integers(0, 9)) > 0:
            return data.draw(st.sampled_from(live))  # type: ignore[return-value]
        return data.draw(st.sampled_from(self.ids + [ContextId(10_000)]))

    def _fails(self, error: type[BaseException], call: Any) -> None:
        before = describe_state(self.store)
        try:
            call()
        except error:
            pass
        else:
            raise AssertionError(f"expected {error.__name__}")
        assert describe_state(self.store) == before, "a failing call changed state"

    def _new_id(self, cid: ContextId, ref_ctx: RefContext) -> None:
        assert cid not in self.ids
        self.ids.append(cid)
        self.ref.contexts[cid] = ref_ctx

    # -- lifecycle ---------------------------------------------------------------------

    @rule(owner=st.sampled_from(OWNERS))
    def create(self, owner: str | None) -> None:
        self._new_id(self.store.create_context(owner), RefContext())

    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        cid = self._cid(data)
        ctx = self.ref.contexts.get(cid)
        if ctx is None:
            self._fails(ContextClosed, lambda: self.store.fork(cid))
        elif ctx.num_working_pages > self.ref.num_available():
            self._fails(OutOfPages, lambda: self.store.fork(cid))
        else:
            self._new_id(self.store.fork(cid), ctx.copy())

    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        cid = self._cid(data)
        if cid not in self.ref.contexts:
            self._fails(ContextClosed, lambda: self.store.release(cid))
        else:
            self.store.release(cid)
            del self.ref.contexts[cid]

    # -- working pages -----------------------------------------------------------------

    @rule(data=st.data(), n=st.integers(-1, 4))
    def reserve(self, data: st.DataObject, n: int) -> None:
        cid = self._cid(data)
        ctx = self.ref.contexts.get(cid)
        if ctx is None:
            self._fails(ContextClosed, lambda: self.store.reserve_working_pages(cid, n))
        elif n < 0:
            self._fails(InvalidArgument, lambda: self.store.reserve_working_pages(cid, n))
        else:
            can = n <= self.ref.num_available()
            before = None if can else describe_state(self.store)
            assert self.store.reserve_working_pages(cid, n) is can
            if can:
                ctx.num_working_pages += n
            else:
                assert describe_state(self.store) == before, "back-pressure changed state"

    @rule(data=st.data(), tokens=st.lists(TOKENS, max_size=5), extra=EXTRAS, jump=st.booleans())
    def write(self, data: st.DataObject, tokens: list[int], extra: int, jump: bool) -> None:
        cid = self._cid(data)
        ctx = self.ref.contexts.get(cid)
        start = 7 if jump else (ctx.next_position() if ctx else 0)
        positions = list(range(start, start + len(tokens)))
        call = lambda: self.store.write_tokens(cid, tokens, positions, extra)  # noqa: E731
        if ctx is None:
            self._fails(ContextClosed, call)
        elif len(ctx.working) + len(tokens) > ctx.num_working_pages * self.ref.page_size:
            self._fails(InvalidArgument, call)
        else:
            slots = call()
            ps, base = self.ref.page_size, len(ctx.working)
            table = self.store.page_table(cid)[len(ctx.committed) :]
            assert slots == [(table[(base + i) // ps], (base + i) % ps) for i in range(len(tokens))]
            ctx.working.extend((t, p, extra) for t, p in zip(tokens, positions, strict=True))

    @rule(data=st.data(), tokens=st.lists(TOKENS, min_size=1, max_size=7), extra=EXTRAS)
    def extend(self, data: st.DataObject, tokens: list[int], extra: int) -> None:
        """Reserve what is missing, then write: how the engine fills a context."""
        cid = self._cid(data)
        ctx = self.ref.contexts.get(cid)
        if ctx is None:
            return
        room = ctx.num_working_pages * self.ref.page_size - len(ctx.working)
        need = -(-(len(tokens) - room) // self.ref.page_size) if len(tokens) > room else 0
        if need > self.ref.num_available():
            return
        assert self.store.reserve_working_pages(cid, need)
        ctx.num_working_pages += need
        start = ctx.next_position()
        positions = list(range(start, start + len(tokens)))
        self.store.write_tokens(cid, tokens, positions, extra)
        ctx.working.extend((t, p, extra) for t, p in zip(tokens, positions, strict=True))

    @rule(data=st.data(), k=st.integers(-1, 3))
    def commit_working(self, data: st.DataObject, k: int) -> None:
        cid = self._cid(data)
        ctx = self.ref.contexts.get(cid)
        call = lambda: self.store.commit_working_pages(cid, k)  # noqa: E731
        if ctx is None:
            self._fails(ContextClosed, call)
        elif k < 0 or k > ctx.num_working_pages or k * self.ref.page_size > len(ctx.working):
            self._fails(InvalidArgument, call)
        else:
            call()
            self.ref.commit(ctx, k)

    @rule(data=st.data())
    def commit_full(self, data: st.DataObject) -> None:
        cid = self._cid(data)
        ctx = self.ref.contexts.get(cid)
        if ctx is None:
            self._fails(ContextClosed, lambda: self.store.commit_full_pages(cid))
        else:
            k = len(ctx.working) // self.ref.page_size
            assert self.store.commit_full_pages(cid) == k
            self.ref.commit(ctx, k)

    @rule(data=st.data(), n=st.integers(-1, 3))
    def release_working(self, data: st.DataObject, n: int) -> None:
        cid = self._cid(data)
        ctx = self.ref.contexts.get(cid)
        call = lambda: self.store.release_working_pages(cid, n)  # noqa: E731
        if ctx is None:
            self._fails(ContextClosed, call)
        elif n < 0 or n > ctx.num_working_pages:
            self._fails(InvalidArgument, call)
        else:
            call()
            ctx.num_working_pages -= n
            del ctx.working[ctx.num_working_pages * self.ref.page_size :]

    @rule(data=st.data(), n=st.integers(-1, 6))
    def truncate(self, data: st.DataObject, n: int) -> None:
        cid = self._cid(data)
        ctx = self.ref.contexts.get(cid)
        call = lambda: self.store.truncate_working_page_tokens(cid, n)  # noqa: E731
        if ctx is None:
            self._fails(ContextClosed, call)
        elif n < 0 or n > len(ctx.working):
            self._fails(InvalidArgument, call)
        else:
            call()
            del ctx.working[len(ctx.working) - n :]

    @rule(data=st.data(), kind=st.sampled_from(["random", "random", "unsorted", "range",
                                                "empty"]))
    def compact(self, data: st.DataObject, kind: str) -> None:
        """Keep a random subset anywhere (or a bad ``keep``: a typed error, no change)."""
        cid = self._cid(data)
        ctx = self.ref.contexts.get(cid)
        n = ctx.seq_len(self.ref.page_size) if ctx is not None else 0
        if kind == "random":
            keep = sorted(data.draw(st.sets(st.integers(0, max(n - 1, 0)), min_size=1)))
        elif kind == "unsorted":
            keep = [1, 0]
        elif kind == "range":
            keep = [0, n]
        else:
            keep = []
        call = lambda: self.store.compact(cid, keep)  # noqa: E731
        if ctx is None:
            self._fails(ContextClosed, call)
        elif kind != "random" or n == 0:
            self._fails(InvalidArgument, call)
        else:
            after, n_new = self.ref.compact(ctx, keep)
            if n_new > self.ref.num_available():
                self._fails(OutOfPages, call)
                return
            first_drop = next((j for j, i in enumerate(keep) if i != j), len(keep))
            shared = min(first_drop // self.ref.page_size, len(ctx.committed))
            before_ids = self.store.page_table(cid)[:shared]
            assert call() == shared
            assert self.store.page_table(cid)[:shared] == before_ids  # shared, not copied
            self.ref.contexts[cid] = after

    @rule(data=st.data(), tokens=st.lists(TOKENS, max_size=7), extra=EXTRAS)
    def attach(self, data: st.DataObject, tokens: list[int], extra: int) -> None:
        cid = self._cid(data)
        ctx = self.ref.contexts.get(cid)
        start = ctx.next_position() if ctx else 0
        positions = list(range(start, start + len(tokens)))
        call = lambda: self.store.attach_prefix(cid, tokens, positions, extra)  # noqa: E731
        if ctx is None:
            self._fails(ContextClosed, call)
        elif ctx.working:
            self._fails(InvalidArgument, call)
        else:
            entries: list[Entry] = [(t, p, extra) for t, p in zip(tokens, positions, strict=True)]
            floor = self.ref.live_prefix_hits(ctx, entries)
            assert self.store.match_prefix(cid, tokens, positions, extra) >= floor
            n = call()
            assert floor <= n <= len(tokens) // self.ref.page_size
            ps = self.ref.page_size
            ctx.committed.extend(tuple(entries[i * ps : (i + 1) * ps]) for i in range(n))

    # -- snapshots ---------------------------------------------------------------------

    @rule(data=st.data(), name=st.sampled_from(NAMES), ns=st.sampled_from(NAMESPACES))
    def save(self, data: st.DataObject, name: str, ns: str) -> None:
        cid = self._cid(data)
        ctx = self.ref.contexts.get(cid)
        call = lambda: self.store.save_snapshot(cid, name, ns)  # noqa: E731
        if ctx is None:
            self._fails(ContextClosed, call)
        elif (ns, name) in self.ref.snapshots:
            self._fails(SnapshotExists, call)
        elif ctx.num_working_pages > self.ref.num_available():
            self._fails(OutOfPages, call)
        else:
            call()
            self.ref.snapshots[(ns, name)] = ctx.copy()

    @rule(name=st.sampled_from(NAMES), ns=st.sampled_from(NAMESPACES),
          owner=st.sampled_from(OWNERS))
    def open(self, name: str, ns: str, owner: str | None) -> None:
        snap = self.ref.snapshots.get((ns, name))
        call = lambda: self.store.open_snapshot(name, ns, owner)  # noqa: E731
        if snap is None:
            self._fails(SnapshotNotFound, call)
        elif snap.num_working_pages > self.ref.num_available():
            self._fails(OutOfPages, call)
        else:
            self._new_id(call(), snap.copy())

    @rule(name=st.sampled_from(NAMES), ns=st.sampled_from(NAMESPACES),
          owner=st.sampled_from(OWNERS))
    def take(self, name: str, ns: str, owner: str | None) -> None:
        if (ns, name) not in self.ref.snapshots:
            self._fails(SnapshotNotFound, lambda: self.store.take_snapshot(name, ns, owner))
        else:
            cid = self.store.take_snapshot(name, ns, owner)
            self._new_id(cid, self.ref.snapshots.pop((ns, name)))

    @rule(name=st.sampled_from(NAMES + [""]), ns=st.sampled_from(NAMESPACES))
    def delete(self, name: str, ns: str) -> None:
        if not name:
            self._fails(InvalidArgument, lambda: self.store.delete_snapshot(name, ns))
        elif (ns, name) not in self.ref.snapshots:
            self._fails(SnapshotNotFound, lambda: self.store.delete_snapshot(name, ns))
        else:
            self.store.delete_snapshot(name, ns)
            del self.ref.snapshots[(ns, name)]

    # -- after every step --------------------------------------------------------------

    @invariant()
    def agrees_with_reference(self) -> None:
        store, ref, ps = self.store, self.ref, self.ref.page_size
        store.check_invariants()
        for cid, ctx in ref.contexts.items():
            counters = store.state(cid)
            assert counters.num_committed_pages == len(ctx.committed)
            assert counters.num_working_pages == ctx.num_working_pages
            assert counters.num_working_tokens == len(ctx.working)
            assert counters.seq_len == ctx.seq_len(ps)
            assert store.tokens(cid) == ctx.tokens()
            assert store.next_position(cid) == ctx.next_position()
            assert len(store.page_table(cid)) == len(ctx.committed) + ctx.num_working_pages
        for ns in NAMESPACES:
            assert store.list_snapshots(ns) == sorted(n for (s, n) in ref.snapshots if s == ns)
        stats = store.stats()
        assert stats.num_pages_committed == len(ref.prefixes())
        assert stats.num_pages_working == ref.num_working_pages()
        assert store.num_pages_available() == ref.num_available()
        assert stats.num_contexts == len(ref.contexts)
        assert stats.num_snapshots == len(ref.snapshots)


PageStoreMachine.TestCase.settings = settings(
    max_examples=10_000 if SLOW else 300,
    stateful_step_count=50 if SLOW else 40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestPageStoreMachine = PageStoreMachine.TestCase
