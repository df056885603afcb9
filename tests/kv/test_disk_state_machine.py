"""Hypothesis state machine for the page store with a disk tier.

A small pool (6-12 pages of 2-4 tokens) over a snapshot folder (a fresh temporary
directory per example, written through a ``FailingOps``), driven by random sequences of:
contexts created, written (every token's K/V is ``kv_of(token, position)``, so the bytes
say which token they belong to), forked, released; prefix reuse (``attach_prefix``, from
the pool or from disk); snapshots saved, opened, taken and deleted in two namespaces,
synchronously or as the engine does (``begin_save``, ``job.write()``, ``end_save``, with
other steps in between); memory pressure that spills snapshots and evicts cached pages to
disk (sometimes on a full disk); restarts (a new store on the same folder: live contexts
are gone, snapshots remain, a save cut short is there only if its manifest was written);
disk faults (ENOSPC / EIO while saving: the save fails typed and leaves no trace, before
or after a restart); and damaged page files (the snapshots using them fail to open with
``SnapshotCorrupt`` naming the file and the snapshot, the others open; then the broken
snapshots are deleted, or healed by saving their pages computed again).

The model is deliberately simple: every live context's token list and every snapshot's
token list and working-token count. After every step: ``check_invariants`` (which covers
the disk tier), the listing of both namespaces, one manifest file per durable snapshot and
nothing left in ``tmp/``, and every live context's tokens, counters and K/V bytes. Every
restart then opens every snapshot (the pool is empty: each must fit) and checks its
tokens, K/V, meta and last logits.

``OutOfPages`` is a legitimate outcome in a pool this small: it is accepted, and the store
must then be unchanged as far as the model sees (listing, contexts, invariants).

CI runs 200 examples of up to 40 steps; ``PIE_CTX_SLOW=1`` selects 2,000 of up to 50. The
regressions it found are in ``test_disk_regressions.py``.
"""

from __future__ import annotations

import errno
import os

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, rule

from pie_ctx.errors import (
    ContextClosed,
    OutOfPages,
    SnapshotCorrupt,
    SnapshotExists,
    SnapshotNotFound,
    StorageError,
)

from .disk_helpers import close, try_write
from .disk_machine import (
    MAX_LIVE,
    NAMES,
    NAMESPACES,
    OWNERS,
    TOKENS,
    DiskStoreModel,
    InFlight,
    Restoring,
    logits_of,
    meta_of,
)

SLOW = os.environ.get("PIE_CTX_SLOW") == "1"


class DiskStoreMachine(DiskStoreModel):
    """A small PageStore on a snapshot folder, against a token-list model."""

    @initialize(num_pages=st.integers(6, 12), page_size=st.integers(2, 4),
                cache_pages=st.sampled_from([0, 2, 64]))
    def setup(self, num_pages: int, page_size: int, cache_pages: int) -> None:
        self.num_pages, self.page_size, self.cache_pages = num_pages, page_size, cache_pages
        self.store = self._new_store()

    @rule(owner=st.sampled_from(OWNERS), tokens=st.lists(TOKENS, max_size=12))
    def create(self, owner: str | None, tokens: list[int]) -> None:
        """A new context, and its prompt written (when the pool has room)."""
        if len(self.ctx) >= MAX_LIVE:
            return
        cid = self.s.create_context(owner)
        self.ctx[cid] = []
        if tokens and try_write(self.s, cid, tokens):
            self.ctx[cid] = tokens

    @rule(data=st.data(), tokens=st.lists(TOKENS, min_size=1, max_size=9))
    def write(self, data: st.DataObject, tokens: list[int]) -> None:
        cid = self._live(data)
        if try_write(self.s, cid, tokens):
            self.ctx[cid] = self.ctx[cid] + tokens
        else:
            event("write: pool full")

    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        cid = self._live(data)
        if len(self.ctx) >= MAX_LIVE:
            return
        try:
            child = self.s.fork(cid)
        except OutOfPages:
            return
        self.ctx[child] = list(self.ctx[cid])

    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        cid = self._live(data)
        self.s.release(cid)
        self._remember(self.ctx.pop(cid))
        try:
            self.s.release(cid)
        except ContextClosed:
            pass
        else:
            raise AssertionError("releasing a released context must raise ContextClosed")

    @rule(spare=st.integers(0, 4), disk_full_after=st.sampled_from([None, None, 0, 1, 3]))
    def pressure(self, spare: int, disk_full_after: int | None) -> None:
        """A burst of working pages (all the pool but ``spare``): spills snapshots and
        evicts cached pages (to disk). Fails, changing nothing, when contexts hold more.
        ``disk_full_after``: the disk fills up during the burst (evicted pages are then
        lost instead of cached on disk: no error, nothing half-written)."""
        hog = self.s.create_context()
        before = self._listing()
        if disk_full_after is not None:
            self.ops.fail_after(disk_full_after)
        try:
            if not self.s.reserve_working_pages(hog, self.num_pages - spare):
                event("pressure: reserve refused")
                assert self._listing() == before
        finally:
            self.ops.heal()
        self.s.release(hog)

    @rule(data=st.data(), fresh=st.sampled_from([True, True, False]),
          reuse=st.sampled_from([True, True, True, False]), then_write=st.booleans())
    def attach(self, data: st.DataObject, fresh: bool, reuse: bool, then_write: bool) -> None:
        """Prefix reuse: continue a context (a new one, as a new request does, or a live
        one) with a sequence seen before (a snapshot's, a released context's) or random
        tokens, attaching what the pool or the disk has."""
        cid = None if fresh else self._live(data)
        if cid is None:
            cid = self.s.create_context()
            self.ctx[cid] = []
        try:
            self._attach(data, cid, reuse, then_write)
        finally:
            if len(self.ctx) > MAX_LIVE:
                self.s.release(cid)
                self._remember(self.ctx.pop(cid))

    @rule(data=st.data(), name=st.sampled_from(NAMES), ns=st.sampled_from(NAMESPACES))
    def begin_save(self, data: st.DataObject, name: str, ns: str) -> None:
        """The engine's save: begun on the event loop, written later off it, then ended;
        other rules run in between. The name is taken but not listed meanwhile."""
        key = (ns, name)
        self._settle(key)
        if self.flight is not None:
            return
        cid = self._live(data)
        if key in self.snaps:
            self._delete(key)
        tokens = self.ctx[cid]
        before = self._listing()
        try:
            job = self.s.begin_save(cid, name, ns, meta=meta_of(key, tokens),
                                    last_logits=logits_of(tokens))
        except OutOfPages:
            return
        assert job is not None
        self.flight = InFlight(job, key, list(tokens))
        assert self._listing() == before
        try:
            self.s.begin_save(cid, name, ns)
        except SnapshotExists:
            pass
        else:
            raise AssertionError("a name being saved must be taken")

    @rule(fault=st.sampled_from([None, None, None, 0, 6]))
    def write_in_flight(self, fault: int | None) -> None:
        if self.flight is not None and not self.flight.written:
            self._write_flight(fault)

    @rule(fault=st.sampled_from([None, None, None, 0, 6]))
    def end_in_flight(self, fault: int | None) -> None:
        if self.flight is not None:
            self._finish(fault)

    @rule(data=st.data(), name=st.sampled_from(NAMES), ns=st.sampled_from(NAMESPACES),
          replace=st.booleans())
    def save(self, data: st.DataObject, name: str, ns: str, replace: bool) -> None:
        """Save a context (``replace``: deleting the snapshot of that name first)."""
        self._settle((ns, name))
        cid = self._live(data)
        if (ns, name) in self.snaps and replace:
            self._delete((ns, name))
        if (ns, name) in self.snaps:
            try:
                self.s.save_snapshot(cid, name, ns)
            except SnapshotExists:
                event("save: SnapshotExists")
                return
            raise AssertionError("saving over a snapshot must raise SnapshotExists")
        try:
            self._save(cid, (ns, name))
        except OutOfPages:
            event("save: OutOfPages")
        else:
            event("save: ok")

    @rule(data=st.data(), name=st.sampled_from(NAMES), ns=st.sampled_from(NAMESPACES),
          after=st.sampled_from([0, 0, 1, 2, 4, 8, 30]),
          error=st.sampled_from([errno.ENOSPC, errno.EIO]), restart=st.booleans())
    def save_with_disk_fault(self, data: st.DataObject, name: str, ns: str, after: int,
                             error: int, restart: bool) -> None:
        """The disk fails ``after`` writes into a save: the save raises a StorageError and
        leaves no trace (not listed, now or after a restart), or it completed first."""
        self._settle((ns, name))
        cid = self._live(data)
        if (ns, name) in self.snaps:
            self._delete((ns, name))
        before = self._listing()
        self.ops.fail_after(after, error)
        try:
            self._save(cid, (ns, name))
        except OutOfPages:
            assert self._listing() == before
            event("fault save: OutOfPages")
        except StorageError as err:
            event(f"fault save: {type(err).__name__}")
            assert not isinstance(err, SnapshotCorrupt), err
            assert ("disk is full" if error == errno.ENOSPC else "cannot write") in str(err)
            assert self._listing() == before
            assert (ns, name) not in self.snaps
        else:
            assert after > 0, "a save writes its manifest: it cannot succeed with no write"
            event("fault save: completed first")
        finally:
            self.ops.heal()
        self._check_invariants()
        if restart:
            self._restart()
            self._verify_every_snapshot(must_open=True)

    @rule(data=st.data(), read_now=st.booleans(), spill_first=st.booleans())
    def begin_restore(self, data: st.DataObject, read_now: bool, spill_first: bool) -> None:
        """The engine's reopen of a snapshot: planned on the event loop, read off it (now
        or later), finished on the loop; other steps (even restarts) run in between.
        ``spill_first``: a burst first spills every snapshot (this one comes from disk)."""
        self.end_restore(check=False)  # one at a time
        if not self.snaps:
            with pytest.raises(SnapshotNotFound):
                self.s.plan_restore("a")
            return
        ns, name = data.draw(st.sampled_from(sorted(self.snaps)))
        if spill_first:
            self._flush_pool()
        job = self.s.plan_restore(name, ns)
        if job is not None and read_now:
            job.read()
        self.restoring = Restoring((ns, name), job, read_now)
        event(f"restore: planned ({'resident' if job is None else 'spilled'})")

    @rule(check=st.booleans())
    def end_restore(self, check: bool) -> None:
        """Finish the restore: the snapshot is resident (its pages counted by where they
        came from), or it was deleted meanwhile (SnapshotNotFound); ``check``: open it."""
        restoring, self.restoring = self.restoring, None
        if restoring is None:
            return
        (ns, name), job = restoring.key, restoring.job
        if job is not None and not restoring.read:
            job.read()
        if restoring.key not in self.snaps:
            with pytest.raises(SnapshotNotFound):
                self.s.restore_snapshot(name, ns, job)
            event("restore: deleted meanwhile")
            return
        try:
            from_memory, from_disk = self.s.restore_snapshot(name, ns, job)
        except OutOfPages:
            event("restore: OutOfPages")
            return
        event(f"restore: {'some' if from_disk else 'no'} pages from disk")
        tokens, working = self.snaps[restoring.key]
        ps = self.page_size
        assert from_memory + from_disk == (len(tokens) - working) // ps + -(-working // ps)
        if check:
            try:
                cid = self.s.open_snapshot(name, ns)
            except OutOfPages:
                return
            self._check_opened(restoring.key, cid)
            self.s.release(cid)

    @rule(name=st.sampled_from(NAMES), ns=st.sampled_from(NAMESPACES), keep=st.booleans(),
          owner=st.sampled_from(OWNERS))
    def open(self, name: str, ns: str, keep: bool, owner: str | None) -> None:
        key = (ns, name)
        if key not in self.snaps:
            with pytest.raises(SnapshotNotFound):
                self.s.open_snapshot(name, ns, owner)
            return
        before = self._listing()
        try:
            cid = self.s.open_snapshot(name, ns, owner)
        except OutOfPages:
            assert self._listing() == before
            return
        self._check_opened(key, cid)
        if keep and len(self.ctx) < MAX_LIVE:
            self.ctx[cid] = list(self.snaps[key][0])
        else:
            self.s.release(cid)

    @rule(name=st.sampled_from(NAMES), ns=st.sampled_from(NAMESPACES),
          owner=st.sampled_from(OWNERS))
    def take(self, name: str, ns: str, owner: str | None) -> None:
        key = (ns, name)
        if key not in self.snaps:
            with pytest.raises(SnapshotNotFound):
                self.s.take_snapshot(name, ns, owner)
            return
        before = self._listing()
        try:
            cid = self.s.take_snapshot(name, ns, owner)
        except OutOfPages:
            assert self._listing() == before
            return
        tokens, working = self.snaps.pop(key)
        self._check_context(cid, tokens)
        assert self.s.state(cid).num_working_tokens == working
        if len(self.ctx) < MAX_LIVE:
            self.ctx[cid] = tokens
        else:
            self.s.release(cid)
            self._remember(tokens)

    @rule(name=st.sampled_from(NAMES), ns=st.sampled_from(NAMESPACES))
    def delete(self, name: str, ns: str) -> None:
        key = (ns, name)
        if key not in self.snaps:
            with pytest.raises(SnapshotNotFound):
                self.s.delete_snapshot(name, ns)
            return
        self._delete(key)

    @rule(reverse=st.booleans())
    def verify_snapshots(self, reverse: bool) -> None:
        """Open every snapshot (spilled ones come back from disk) and check it."""
        self._verify_every_snapshot(must_open=not self.ctx, reverse=reverse)

    @rule(cache_pages=st.sampled_from([0, 2, 64]), reverse=st.booleans())
    def restart(self, cache_pages: int, reverse: bool) -> None:
        """A new store on the folder (the disk cache budget may change: it is not part
        of the fingerprint); every snapshot opens from disk."""
        self.cache_pages = cache_pages
        self._restart()
        self._verify_every_snapshot(must_open=True, reverse=reverse)

    @rule(data=st.data(), damage=st.sampled_from(["flip", "truncate", "remove"]),
          mode=st.sampled_from(["restart", "flush", "live"]), heal=st.booleans())
    def corrupt_page_file(self, data: st.DataObject, damage: str, mode: str,
                          heal: bool) -> None:
        """Damage one page file a snapshot uses. Every snapshot listing it then fails to
        open with SnapshotCorrupt naming the file and the snapshot, unless the page is
        still in the pool: after a restart nothing is; after a flush only what live
        contexts hold; else (``live``) the pool's copy may serve it (and must be right).
        Every other snapshot opens. Then, with ``heal`` and once the store has found the
        damage, the page is computed again and saved, which heals the broken snapshots;
        else (or if that cannot be done) the broken snapshots are deleted."""
        self._settle()
        heads = {key: self.s.snapshot(key[1], key[0]).head for key in self.snaps}
        used = sorted({h for head in heads.values() for h in head.pages})
        if not used:
            return
        victim_hash = data.draw(st.sampled_from(used))
        if damage == "remove" and mode != "restart":
            damage = "flip"  # a file vanishing under a running store is not a store bug
        victim = self.s.tier.files.page_path(victim_hash)  # type: ignore[union-attr]
        if mode == "restart":
            for tokens in self.ctx.values():
                self._remember(tokens)
            close(self.s)
            self.store = None
        payload = victim.read_bytes()
        if damage == "flip":
            at = data.draw(st.integers(0, len(payload) - 1))
            victim.write_bytes(payload[:at] + bytes([payload[at] ^ 0x40]) + payload[at + 1:])
        elif damage == "truncate":
            victim.write_bytes(payload[: data.draw(st.integers(0, len(payload) - 1))])
        else:
            victim.unlink()
        if mode == "restart":
            self.store = self._new_store()
            self.ctx = {}
            assert self._listing() == self._expected_listing()
        elif mode == "flush":
            self._flush_pool()
        broken = sorted(key for key, head in heads.items() if victim_hash in head.pages)
        for key in broken:
            tokens = self.snaps[key][0]
            upto = (heads[key].pages.index(victim_hash) + 1) * self.page_size
            may_open = mode == "live" or (mode == "flush" and self._holds(tokens, upto))
            try:
                cid = self.s.open_snapshot(key[1], key[0])
            except SnapshotCorrupt as err:
                event(f"corrupt: SnapshotCorrupt ({mode})")
                assert victim.name in str(err), err
                assert repr(key[1]) in str(err), err
            except OutOfPages:
                assert mode != "restart"
            else:
                assert may_open, f"snapshot {key} opened from a damaged file"
                event(f"corrupt: opened from the pool ({mode})")
                self._check_opened(key, cid)
                self.s.release(cid)
            self._check_invariants()
        if heal and not victim.exists() and self._heal(broken[0], victim_hash):
            event(f"corrupt: healed ({mode})")
            assert victim.exists()
            self._flush_pool()  # the healed snapshots now open from disk
        else:
            for key in broken:
                self._delete(key)
            assert not victim.exists()  # no snapshot lists it any more
        self._verify_every_snapshot(must_open=not self.ctx)

    @invariant()
    def consistent(self) -> None:
        if self.store is None:
            return
        store = self.s
        self._check_invariants()
        flight = self.flight
        assert self._listing() == self._expected_listing()
        stats = store.stats()
        assert stats.num_snapshots == len(self.snaps)
        assert stats.num_contexts == len(self.ctx)
        if stats.num_snapshots_spilled:
            event("a snapshot was spilled")
        if stats.disk_pages_loaded:
            event("pages were loaded from disk")
        if stats.num_disk_pages > sum(len(self.s.snapshot(n, ns).head.pages)
                                      for ns, n in self.snaps):
            event("cache pages on disk")
        files = store.tier.files  # type: ignore[union-attr]
        durable = flight is not None and flight.written and flight.job.error is None
        assert len(list(files.snaps_dir.glob("*.snap"))) == len(self.snaps) + durable
        assert not any(files.tmp_dir.iterdir())
        for cid, tokens in self.ctx.items():
            self._check_context(cid, tokens)


DiskStoreMachine.TestCase.settings = settings(
    max_examples=2_000 if SLOW else 200,
    stateful_step_count=50 if SLOW else 40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestDiskStoreMachine = DiskStoreMachine.TestCase
