"""Regressions the disk-tier state machine (``test_disk_state_machine.py``) found: damaged
or missing page files saved again, and saves and restores in flight."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from pie_ctx.errors import (
    SnapshotCorrupt,
    StorageError,
)
from runtime.kv import ContextId, PageStore
from runtime.kv.durable import SaveJob

from .disk_helpers import FailingOps, check_kv, close, disk_store, try_write

# ---------------------------------------------------------- bugs the machine found
# Damaged or missing page files, then the same pages saved again (fixed in 7d91138).


def _saved_then_damaged(root: Path, damage: str) -> tuple[list[int], Path]:
    """A snapshot ``a`` of 2 committed pages, then (store closed) its first page file
    damaged; returns its tokens and that file."""
    tokens = list(range(100, 108))
    store = disk_store(root)
    cid = store.create_context()
    try_write(store, cid, tokens)
    store.save_snapshot(cid, "a")
    victim = store.tier.files.page_path(store.snapshot("a").head.pages[0])  # type: ignore[union-attr]
    close(store)
    if damage == "remove":
        victim.unlink()
    else:
        data = bytearray(victim.read_bytes())
        data[len(data) // 2] ^= 0x40
        victim.write_bytes(bytes(data))
    return tokens, victim


def test_resaving_a_page_whose_file_went_missing_keeps_the_new_snapshot(tmp_path: Path) -> None:
    """Boot must keep the count of manifests listing a missing page: a save writing the
    page again then counts them, and deleting the old snapshot keeps the new one's file."""
    tokens, _ = _saved_then_damaged(tmp_path, "remove")
    store = disk_store(tmp_path)
    cid = store.create_context()
    try_write(store, cid, tokens)  # the same pages, computed again
    store.save_snapshot(cid, "b")
    store.check_invariants()
    store.delete_snapshot("a")
    store.check_invariants()
    close(store)
    again = disk_store(tmp_path)
    cid = again.open_snapshot("b")
    assert again.tokens(cid) == tokens
    check_kv(again, cid)


def test_a_fresh_save_does_not_reuse_a_page_file_found_corrupt(tmp_path: Path) -> None:
    """A page file found damaged is not reused by a later save of the same pages (which
    writes it afresh, healing the snapshot that found it damaged too)."""
    tokens, victim = _saved_then_damaged(tmp_path, "flip")
    store = disk_store(tmp_path)
    with pytest.raises(SnapshotCorrupt, match=victim.name):
        store.open_snapshot("a")
    cid = store.create_context()
    try_write(store, cid, tokens)  # the same pages, computed again
    store.save_snapshot(cid, "b")
    store.check_invariants()
    close(store)
    again = disk_store(tmp_path)
    for name in ("b", "a"):
        cid = again.open_snapshot(name)
        assert again.tokens(cid) == tokens
        check_kv(again, cid)
    again.check_invariants()


# ------------------------------------------------- regressions: saves and restores in flight
# 1. A save in flight (begin_save, job.write() off the event loop, end_save) has written
#    page files the disk index learns of only at end_save. Another save of the same pages
#    that is deleted, or fails, must not delete them (DiskTier.pending).
# 2. check_invariants must not take those files for orphans.
# 3. A restore job whose read failed, finished after the page was written afresh, must not
#    delete the healthy file (drop_damaged re-reads it).
# 4. When both saves fail, the files the second one wrote must not outlive them (found in
#    review: the second save's cleanup kept them for the first, which wrote nothing).


class _ManifestFails(FailingOps):
    """When ``armed``, a save writes its page files, then fails renaming its manifest
    into place (ENOSPC)."""

    armed = False

    def replace(self, src: Path, dst: Path) -> None:
        if self.armed and dst.suffix == ".snap":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        super().replace(src, dst)


def _in_flight(store: PageStore, tokens: list[int]) -> tuple[ContextId, SaveJob]:
    """A context of ``tokens`` and its save "slow", begun and written but not ended."""
    cid = store.create_context()
    try_write(store, cid, tokens)
    job = store.begin_save(cid, "slow")
    assert job is not None
    job.write()  # a worker thread writes it ...
    assert job.error is None
    return cid, job


def _slow_survives(root: Path, store: PageStore, job: SaveJob, tokens: list[int]) -> None:
    store.end_save(job)  # ... and the event loop ends it: listed
    assert "slow" in store.list_snapshots()
    close(store)
    again = disk_store(root)
    cid = again.open_snapshot("slow")
    assert again.tokens(cid) == tokens
    check_kv(again, cid)


def test_deleting_a_snapshot_keeps_the_files_of_a_save_in_flight(tmp_path: Path) -> None:
    tokens = list(range(100, 108))
    store = disk_store(tmp_path)
    cid, job = _in_flight(store, tokens)
    store.save_snapshot(cid, "quick")  # meanwhile on the loop: the same pages, saved ...
    store.delete_snapshot("quick")  # ... and deleted: their page files go
    _slow_survives(tmp_path, store, job, tokens)


def test_a_failed_save_keeps_the_files_of_a_save_in_flight(tmp_path: Path) -> None:
    tokens = list(range(100, 108))
    ops = _ManifestFails()
    store = disk_store(tmp_path, ops=ops)
    cid, job = _in_flight(store, tokens)
    ops.armed = True
    with pytest.raises(StorageError, match="disk is full"):
        store.save_snapshot(cid, "quick")  # writes the same page files, then fails
    ops.armed = False
    _slow_survives(tmp_path, store, job, tokens)


def test_two_failed_saves_of_the_same_pages_leave_no_file(tmp_path: Path) -> None:
    ops = _ManifestFails()
    store = disk_store(tmp_path, ops=ops)
    cid = store.create_context()
    try_write(store, cid, list(range(100, 108)))
    job = store.begin_save(cid, "slow")
    assert job is not None
    ops.fail_after(0)
    job.write()  # fails before writing anything
    ops.heal()
    ops.armed = True
    with pytest.raises(StorageError, match="disk is full"):
        store.save_snapshot(cid, "quick")  # writes the page files, then fails
    ops.armed = False
    with pytest.raises(StorageError):
        store.end_save(job)
    store.check_invariants()
    assert not list(store.tier.files.pages_dir.iterdir())  # type: ignore[union-attr]


def test_invariants_hold_between_a_save_write_and_its_end(tmp_path: Path) -> None:
    store = disk_store(tmp_path)
    _, job = _in_flight(store, list(range(100, 108)))
    store.check_invariants()
    store.end_save(job)


def test_a_stale_failed_restore_does_not_delete_a_page_file_written_since(tmp_path: Path) -> None:
    tokens, victim = _saved_then_damaged(tmp_path, "flip")
    store = disk_store(tmp_path)
    job = store.plan_restore("a")  # a request reopens "a": its read (off the loop) fails
    assert job is not None
    job.read()
    assert job.error is not None
    with pytest.raises(SnapshotCorrupt):  # meanwhile another request finds the damage
        store.open_snapshot("a")
    cid = store.create_context()
    try_write(store, cid, tokens)
    store.save_snapshot(cid, "b")  # the pages computed again: a healthy file
    try:  # the first request ends with its stale job: re-read, or its error, either is fine
        store.restore_snapshot("a", job=job)
    except SnapshotCorrupt:
        pass
    store.check_invariants()
    close(store)
    again = disk_store(tmp_path)
    cid = again.open_snapshot("b")  # fails: the healthy file was deleted
    assert again.tokens(cid) == tokens
    check_kv(again, cid)
