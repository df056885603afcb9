"""The model and helpers of the disk-tier state machine (``test_disk_state_machine.py``):
the constants its rules draw from, the records of a save or restore in flight, and
``DiskStoreModel``, which holds the store and the token-list model and checks one against
the other. The rules live in the test module."""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine

from pie_ctx.errors import (
    InvalidArgument,
    OutOfPages,
    StorageError,
)
from runtime.kv import ContextId, PageStore
from runtime.kv.durable import RestoreJob, SaveJob

from .disk_helpers import FailingOps, check_kv, close, disk_store, try_write

NAMES = ["a", "b", "c"]
NAMESPACES = ["default", "other"]
OWNERS = [None, "alice"]
TOKENS = st.integers(0, 3)  # a small alphabet: prefixes collide, pages dedup
MAX_LIVE = 4  # live contexts at most (more would only make everything OutOfPages)
Key = tuple[str, str]  # (namespace, name)


@dataclass
class InFlight:
    """A save begun (``begin_save``: name reserved, state forked) and not ended yet."""

    job: SaveJob
    key: Key
    tokens: list[int]
    written: bool = False  # job.write() ran (its manifest is on disk unless job.error)


@dataclass
class Restoring:
    """A restore planned (``plan_restore``; None: the snapshot was resident), maybe read,
    not finished yet (``restore_snapshot``). Kept across restarts: a stale job is re-read."""

    key: Key
    job: RestoreJob | None
    read: bool




def logits_of(tokens: list[int]) -> np.ndarray:
    """The last logits saved with a snapshot of ``tokens`` (never empty)."""
    return np.asarray([len(tokens), *tokens], dtype="<f4") + 0.5


def meta_of(key: Key, tokens: list[int]) -> str:
    return f"{key[0]}/{key[1]}/{len(tokens)}"


def common_pages(a: list[int], b: list[int], ps: int) -> int:
    """Leading full pages ``a`` and ``b`` have in common."""
    n = 0
    while (n + 1) * ps <= min(len(a), len(b)) and a[n * ps:(n + 1) * ps] == b[n * ps:(n + 1) * ps]:
        n += 1
    return n



class DiskStoreModel(RuleBasedStateMachine):
    """A small PageStore on a snapshot folder and the token-list model it is checked
    against; the rules are :class:`DiskStoreMachine`'s."""

    def __init__(self) -> None:
        super().__init__()
        self.root = Path(tempfile.mkdtemp(prefix="pie-disk-sm-"))
        self.ops = FailingOps()
        self.store: PageStore | None = None
        self.num_pages = self.page_size = self.cache_pages = 0
        self.ctx: dict[ContextId, list[int]] = {}  # live context -> its tokens
        self.snaps: dict[Key, tuple[list[int], int]] = {}  # -> (tokens, working tokens)
        self.seen: list[list[int]] = []  # token lists of released contexts (prefix reuse)
        self.flight: InFlight | None = None  # the save being written, if any
        self.restoring: Restoring | None = None  # the restore being read, if any

    def teardown(self) -> None:
        if self.store is not None:
            close(self.store)
        shutil.rmtree(self.root, ignore_errors=True)

    @property
    def s(self) -> PageStore:
        assert self.store is not None
        return self.store

    def _new_store(self) -> PageStore:
        return disk_store(self.root, self.num_pages, self.page_size, ops=self.ops,
                          cache_pages=self.cache_pages)

    def _live(self, data: st.DataObject) -> ContextId:
        """A live context; a new one with a prompt when there is none."""
        if self.ctx:
            return data.draw(st.sampled_from(sorted(self.ctx)))
        cid = self.s.create_context()
        self.ctx[cid] = []
        tokens = data.draw(st.lists(TOKENS, min_size=1, max_size=12))
        if try_write(self.s, cid, tokens):
            self.ctx[cid] = tokens
        return cid

    def _check_invariants(self) -> None:
        self.s.check_invariants()  # (a save in flight: its written files are pending)

    def _working(self, tokens: list[int]) -> int:
        return len(tokens) % self.page_size  # every full page is committed (try_write)

    def _listing(self) -> dict[str, list[str]]:
        return {ns: self.s.list_snapshots(ns) for ns in NAMESPACES}

    def _check_context(self, cid: ContextId, tokens: list[int]) -> None:
        store = self.s
        assert store.tokens(cid) == tokens
        counters = store.state(cid)
        assert counters.num_working_tokens == self._working(tokens)
        assert counters.seq_len == len(tokens)
        assert store.next_position(cid) == len(tokens)
        check_kv(store, cid)

    def _check_opened(self, key: Key, cid: ContextId) -> None:
        """``cid`` was just opened from snapshot ``key``: tokens, K/V, meta, logits."""
        tokens, working = self.snaps[key]
        self._check_context(cid, tokens)
        assert self.s.state(cid).num_working_tokens == working
        snap = self.s.snapshot(key[1], key[0])
        assert snap.meta == meta_of(key, tokens)
        assert np.array_equal(snap.last_logits, logits_of(tokens))

    def _remember(self, tokens: list[int]) -> None:
        if tokens and tokens not in self.seen:
            self.seen = (self.seen + [tokens])[-8:]

    def _restart(self) -> None:
        """Close the folder and start a new store on it: contexts go, snapshots stay.
        A save in flight is cut short (a crash): its snapshot is there after the restart
        if its manifest was written, else not at all."""
        for tokens in self.ctx.values():
            self._remember(tokens)
        if self.flight is not None:
            flight, self.flight = self.flight, None
            if flight.written and flight.job.error is None:
                event("restart: a written save in flight survives")
                self.snaps[flight.key] = (flight.tokens, self._working(flight.tokens))
        close(self.s)
        self.store = None
        self.store = self._new_store()
        self.ctx = {}
        assert self._listing() == self._expected_listing()
        # cache pages are swept at boot: the files left are exactly the snapshots' pages
        pages = {h for key in self.snaps for h in self.s.snapshot(key[1], key[0]).head.pages}
        assert self.s.stats().num_disk_pages == len(pages)

    def _verify_every_snapshot(self, *, must_open: bool, reverse: bool = False) -> None:
        """Open every snapshot, check it, release it. ``must_open``: no live context (or
        save in flight) holds pages, so each snapshot fits (it fitted beside its context
        when saved)."""
        must_open = must_open and self.flight is None
        for key in sorted(self.snaps, reverse=reverse):
            try:
                cid = self.s.open_snapshot(key[1], key[0])
            except OutOfPages:
                assert not must_open, f"snapshot {key} does not fit in an empty pool"
                continue
            self._check_opened(key, cid)
            self.s.release(cid)

    def _expected_listing(self) -> dict[str, list[str]]:
        return {ns: sorted(n for (s, n) in self.snaps if s == ns) for ns in NAMESPACES}

    def _attach(self, data: st.DataObject, cid: ContextId, reuse: bool,
                then_write: bool) -> None:
        have, ps = self.ctx[cid], self.page_size
        sources = [t for t, _ in self.snaps.values()] + self.seen
        sources = [t for t in sources if len(t) > len(have) and t[: len(have)] == have]
        if sources and reuse:
            full = data.draw(st.sampled_from(sources))
        else:
            full = have + data.draw(st.lists(TOKENS, min_size=1, max_size=8))
        suffix = full[len(have):]
        positions = list(range(len(have), len(full)))
        if self._working(have):
            try:
                self.s.attach_prefix(cid, suffix, positions)
            except InvalidArgument:
                event("attach: InvalidArgument (working tokens)")
                return
            raise AssertionError("attach_prefix with working tokens must raise InvalidArgument")
        n = self.s.attach_prefix(cid, suffix, positions)
        assert 0 <= n <= len(suffix) // ps
        # A snapshot's committed pages are always in the pool or on disk: they attach
        # unless the pool has no page left to load them into.
        floor = 0
        for tokens, working in self.snaps.values():
            k = common_pages(full, tokens[: len(tokens) - working], ps) - len(have) // ps
            floor = max(floor, k)
        if n < floor:
            assert self.s.num_pages_available() == 0, (n, floor)
            assert self.s.stats().num_snapshots_resident == 0, (n, floor)
        event(f"attach: {'no' if n == 0 else 'some'} pages, floor {min(floor, 1)}")
        self.ctx[cid] = have + suffix[: n * ps]
        rest = suffix[n * ps:]
        if then_write and rest and try_write(self.s, cid, rest):
            self.ctx[cid] = full

    def _save(self, cid: ContextId, key: Key) -> None:
        tokens = self.ctx[cid]
        self.s.save_snapshot(cid, key[1], key[0], meta=meta_of(key, tokens),
                             last_logits=logits_of(tokens))
        self.snaps[key] = (list(tokens), self._working(tokens))

    def _delete(self, key: Key) -> None:
        self.s.delete_snapshot(key[1], key[0])
        self._remember(self.snaps.pop(key)[0])

    def _settle(self, key: Key | None = None) -> None:
        """Before a save of ``key`` (or, None, a step that needs no save in flight):
        finish the save in flight, unless it has another name (saves overlap)."""
        if self.flight is not None and (key is None or self.flight.key == key):
            self._finish(None)

    def _finish(self, fault: int | None) -> None:
        """Write the save in flight if not yet (the disk failing after ``fault`` writes),
        then end it: listed, or a StorageError and no trace."""
        flight = self.flight
        assert flight is not None
        if not flight.written:
            self._write_flight(fault)
        self.flight = None
        try:
            self.s.end_save(flight.job)
        except StorageError as err:
            assert flight.job.error is err
            event("in flight: failed")
        else:
            assert flight.job.error is None
            self.snaps[flight.key] = (flight.tokens, self._working(flight.tokens))
            event("in flight: saved")

    def _write_flight(self, fault: int | None) -> None:
        flight = self.flight
        assert flight is not None and not flight.written
        if fault is not None:
            self.ops.fail_after(fault)
        try:
            flight.job.write()  # never raises: the error is kept for end_save
        finally:
            self.ops.heal()
        flight.written = True
        if fault == 0:
            assert isinstance(flight.job.error, StorageError)

    def _flush_pool(self) -> None:
        """Evict every cached page and spill every resident snapshot: the largest burst
        the pool can take beside the live contexts."""
        hog = self.s.create_context()
        for k in range(self.num_pages, 0, -1):
            if self.s.reserve_working_pages(hog, k):
                break
        self.s.release(hog)

    def _holds(self, tokens: list[int], upto: int) -> bool:
        """Whether a live context's committed pages include ``tokens[:upto]``."""
        return any(len(have) - self._working(have) >= upto and have[:upto] == tokens[:upto]
                   for have in self.ctx.values())

    def _heal(self, key: Key, page_hash: int) -> bool:
        """Compute snapshot ``key``'s pages up to ``page_hash`` again in a new context and
        save them under a free name; False when the pool or the names do not allow it."""
        free = [(ns, n) for ns in NAMESPACES for n in NAMES if (ns, n) not in self.snaps]
        if not free:
            return False
        head = self.s.snapshot(key[1], key[0]).head
        tokens = self.snaps[key][0][: (head.pages.index(page_hash) + 1) * self.page_size]
        cid = self.s.create_context()
        self.ctx[cid] = []
        try:
            if not try_write(self.s, cid, tokens):
                return False
            self.ctx[cid] = list(tokens)
            try:
                self._save(cid, free[0])
            except OutOfPages:
                return False
            return True
        finally:
            self.s.release(cid)
            self._remember(self.ctx.pop(cid))
