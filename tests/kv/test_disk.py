"""The disk tier at the page-store level: durable saves, restart, spill and reload, prefix
matching from disk, and the disk's faults (a full disk, write errors, damaged files, a
missing, read-only or locked folder), injected at the file layer."""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from pie_ctx.errors import (
    OutOfPages,
    SnapshotCorrupt,
    SnapshotExists,
    SnapshotIncompatible,
    SnapshotNotFound,
    StorageError,
)
from runtime.kv import PageStore
from runtime.kv.context import chain_nodes
from runtime.kv.disk import PageFiles
from runtime.kv.file_format import Fingerprint, PageRecord
from runtime.kv.types import PageHash

from .disk_helpers import FailingOps, check_kv, close, disk_store, fingerprint, write

A = list(range(100, 110))  # 2 full pages + 2 working tokens at page size 4
B = list(range(100, 108)) + [7, 7, 7, 7, 7]  # shares A's first 2 pages


def _files(store) -> list[str]:
    return sorted(p.name for p in store.tier.files.pages_dir.iterdir())


def test_save_restart_open_restores_every_byte(tmp_path: Path) -> None:
    store = disk_store(tmp_path)
    cid = store.create_context()
    write(store, cid, A)
    logits = np.arange(5, dtype="<f4")
    store.save_snapshot(cid, "a", meta="conv", last_logits=logits)
    store.check_invariants()
    close(store)

    again = disk_store(tmp_path)  # a restart: nothing in the pool, the manifest on disk
    assert again.list_snapshots() == ["a"]
    snap = again.snapshot("a")
    assert snap.state is None and snap.meta == "conv"
    assert again.restore_snapshot("a") == (0, 3)  # 2 committed pages and the tail, from disk
    assert np.array_equal(again.snapshot("a").last_logits, logits)
    cid2 = again.open_snapshot("a")
    assert again.tokens(cid2) == A
    assert again.state(cid2).num_working_tokens == 2
    check_kv(again, cid2)
    again.check_invariants()
    assert again.stats().disk_pages_loaded == 3


def test_snapshots_sharing_a_prefix_share_files_and_delete_keeps_shared(tmp_path: Path) -> None:
    store = disk_store(tmp_path)
    a, b = store.create_context(), store.create_context()
    write(store, a, A)
    write(store, b, B)
    store.save_snapshot(a, "a")
    store.save_snapshot(b, "b")
    assert len(_files(store)) == 3  # A's 2 pages, shared, and B's third page
    store.delete_snapshot("a")
    assert len(_files(store)) == 3  # every page is still B's
    store.delete_snapshot("b")
    assert _files(store) == []
    assert not list(store.tier.files.snaps_dir.iterdir())
    store.check_invariants()


def test_spill_under_pressure_then_reopen(tmp_path: Path) -> None:
    store = disk_store(tmp_path, num_pages=8)
    saved = []
    for i in range(6):  # 6 snapshots x 3 pages = 18 pages, in an 8-page pool
        cid = store.create_context()
        tokens = [i * 50 + t for t in range(10)]
        write(store, cid, tokens)
        store.save_snapshot(cid, f"s{i}")
        store.release(cid)
        saved.append(tokens)
        store.check_invariants()
    stats = store.stats()
    assert stats.num_snapshots == 6 and stats.num_snapshots_spilled > 0
    for i, tokens in enumerate(saved):
        cid = store.open_snapshot(f"s{i}")
        assert store.tokens(cid) == tokens
        check_kv(store, cid)
        store.release(cid)
        store.check_invariants()


def test_without_disk_tier_snapshots_still_fill_the_pool(tmp_path: Path) -> None:
    from .helpers import make_store
    store = make_store(num_pages=8)
    cid = store.create_context()
    write(store, cid, A)
    store.save_snapshot(cid, "a")
    store.release(cid)
    other = store.create_context()
    assert not store.reserve_working_pages(other, 6)  # the snapshot pins its 3 pages


def test_evicted_cache_pages_come_back_by_prefix_match(tmp_path: Path) -> None:
    store = disk_store(tmp_path, num_pages=4)
    cid = store.create_context()
    write(store, cid, list(range(8)))  # 2 committed pages
    store.release(cid)  # cached now
    hog = store.create_context()
    assert store.reserve_working_pages(hog, 4)  # evicts both: written to disk first
    assert store.stats().num_pages_cached == 0 and store.stats().num_disk_pages == 2
    store.release(hog)
    fresh = store.create_context()
    assert store.attach_prefix(fresh, list(range(8)), list(range(8))) == 2
    assert store.num_pages_loaded == 2
    check_kv(store, fresh)
    store.check_invariants()


def test_disk_cache_is_bounded(tmp_path: Path) -> None:
    store = disk_store(tmp_path, num_pages=4, cache_pages=3)
    for i in range(4):
        cid = store.create_context()
        write(store, cid, [i * 10 + t for t in range(8)])
        store.release(cid)
        hog = store.create_context()
        assert store.reserve_working_pages(hog, 4)
        store.release(hog)
    assert store.stats().num_disk_pages == 3
    store.check_invariants()


def test_restart_sweeps_cache_pages_and_orphans(tmp_path: Path) -> None:
    store = disk_store(tmp_path, num_pages=4)
    cid = store.create_context()
    write(store, cid, list(range(8)))
    store.release(cid)
    hog = store.create_context()
    store.reserve_working_pages(hog, 4)
    assert store.stats().num_disk_pages == 2
    (store.tier.files.tmp_dir / "x.page.1.0").write_bytes(b"half")  # a crash mid-write
    close(store)
    again = disk_store(tmp_path, num_pages=4)
    assert again.stats().num_disk_pages == 0
    assert not list(again.tier.files.tmp_dir.iterdir())
    again.check_invariants()


# ------------------------------------------------------------------------------ faults


@pytest.mark.parametrize("after", [0, 1, 3, 5])
def test_disk_full_during_save_leaves_nothing(tmp_path: Path, after: int) -> None:
    ops = FailingOps()
    store = disk_store(tmp_path, ops=ops)
    keep = store.create_context()
    write(store, keep, A)
    store.save_snapshot(keep, "kept")
    files_before = _files(store)
    cid = store.create_context()
    write(store, cid, B)
    ops.fail_after(after)
    with pytest.raises(StorageError, match="disk is full"):
        store.save_snapshot(cid, "b")
    assert store.list_snapshots() == ["kept"]
    assert _files(store) == files_before  # B's new page is gone again
    assert not list(store.tier.files.tmp_dir.iterdir())
    store.check_invariants()
    ops.heal()
    store.save_snapshot(cid, "b")  # the engine goes on; the same name is free
    close(store)
    again = disk_store(tmp_path)
    assert again.list_snapshots() == ["b", "kept"]


def test_write_error_during_save_is_typed(tmp_path: Path) -> None:
    ops = FailingOps()
    store = disk_store(tmp_path, ops=ops)
    cid = store.create_context()
    write(store, cid, A)
    ops.fail_after(2, errno.EIO)
    with pytest.raises(StorageError, match="cannot write"):
        store.save_snapshot(cid, "a")
    assert store.list_snapshots() == []
    store.check_invariants()


@pytest.mark.parametrize("damage", ["flip", "truncate", "remove"])
def test_damaged_page_file_fails_only_its_snapshot(tmp_path: Path, damage: str) -> None:
    store = disk_store(tmp_path)
    a, b = store.create_context(), store.create_context()
    write(store, a, A)
    write(store, b, [9] * 10)
    store.save_snapshot(a, "a")
    store.save_snapshot(b, "b")
    victim = store.tier.files.page_path(dict(store.context_states())[a].tip.page_hash)
    close(store)
    if damage == "flip":
        data = bytearray(victim.read_bytes())
        data[len(data) // 2] ^= 0x40
        victim.write_bytes(bytes(data))
    elif damage == "truncate":
        victim.write_bytes(victim.read_bytes()[:100])
    else:
        victim.unlink()
    again = disk_store(tmp_path)
    assert again.list_snapshots() == ["a", "b"]
    with pytest.raises(SnapshotCorrupt, match=victim.name):
        again.open_snapshot("a")
    again.check_invariants()
    cid = again.open_snapshot("b")  # every other snapshot still opens
    check_kv(again, cid)


def test_damaged_manifest_is_not_listed(tmp_path: Path) -> None:
    store = disk_store(tmp_path)
    cid = store.create_context()
    write(store, cid, A)
    store.save_snapshot(cid, "a")
    store.save_snapshot(cid, "b")
    path = store.tier.files.manifest_path("default", "a")
    close(store)
    data = bytearray(path.read_bytes())
    data[20] ^= 1
    path.write_bytes(bytes(data))
    again = disk_store(tmp_path)
    assert again.list_snapshots() == ["b"]
    again.check_invariants()


def test_damaged_manifest_blob_fails_open_naming_it(tmp_path: Path) -> None:
    store = disk_store(tmp_path)
    cid = store.create_context()
    write(store, cid, A)
    store.save_snapshot(cid, "a", last_logits=np.ones(8, dtype="<f4"))
    path = store.tier.files.manifest_path("default", "a")
    close(store)
    data = bytearray(path.read_bytes())
    data[-12] ^= 1  # inside the logits
    path.write_bytes(bytes(data))
    again = disk_store(tmp_path)
    with pytest.raises(SnapshotCorrupt, match=path.name):
        again.open_snapshot("a")
    again.check_invariants()


def test_other_model_or_page_size_is_refused_with_reason(tmp_path: Path) -> None:
    store = disk_store(tmp_path, page_size=4)
    cid = store.create_context()
    write(store, cid, A)
    store.save_snapshot(cid, "a")
    close(store)
    other = disk_store(tmp_path, page_size=2)
    assert other.list_snapshots() == []
    with pytest.raises(SnapshotIncompatible, match="page size 4"):
        other.open_snapshot("a")
    with pytest.raises(SnapshotNotFound):
        other.open_snapshot("nope")
    close(other)
    assert disk_store(tmp_path, page_size=4).list_snapshots() == ["a"]


def test_same_name_twice_exactly_one_wins(tmp_path: Path) -> None:
    store = disk_store(tmp_path)
    cid = store.create_context()
    write(store, cid, A)
    job = store.begin_save(cid, "x")
    with pytest.raises(SnapshotExists):  # reserved while the first save is written
        store.begin_save(cid, "x")
    assert store.list_snapshots() == []  # not listed before it is durable
    job.write()
    store.end_save(job)
    assert store.list_snapshots() == ["x"]
    store.check_invariants()


def test_missing_read_only_or_locked_directory_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(StorageError, match="does not exist"):
        PageFiles(tmp_path / "nope", fingerprint())
    ro = tmp_path / "ro"
    ro.mkdir()
    with _read_only(ro):
        with pytest.raises(StorageError, match="not writable"):
            PageFiles(ro, fingerprint())


@contextlib.contextmanager
def _read_only(folder: Path) -> Iterator[None]:
    """Make ``folder`` read-only, even for root (who ignores permission bits): the
    immutable attribute stops everyone."""
    if os.geteuid() != 0:
        folder.chmod(0o500)
        try:
            yield
        finally:
            folder.chmod(0o700)
        return
    if subprocess.run(["chattr", "+i", str(folder)], capture_output=True).returncode != 0:
        pytest.skip("running as root on a file system without chattr +i")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(folder)], check=True)


def test_a_folder_is_used_by_one_engine_at_a_time(tmp_path: Path) -> None:
    first = PageFiles(tmp_path, fingerprint())
    with pytest.raises(StorageError, match="in use"):
        PageFiles(tmp_path, fingerprint())
    first.close()
    PageFiles(tmp_path, fingerprint()).close()


def test_open_more_than_the_pool_holds_is_out_of_pages(tmp_path: Path) -> None:
    store = disk_store(tmp_path, num_pages=8)
    cid = store.create_context()
    write(store, cid, list(range(28)))  # 7 committed pages
    store.save_snapshot(cid, "big")
    close(store)
    small = disk_store(tmp_path, num_pages=4)
    with pytest.raises(OutOfPages):
        small.open_snapshot("big")
    small.check_invariants()
    assert small.stats().num_pages_free == 4 - small.stats().num_pages_cached


def test_fingerprint_key_is_pinned() -> None:
    """Folder names must not move between versions: snapshots would be orphaned."""
    fp = Fingerprint(model="m", weights_digest="ab", weights="fp32", dtype="float32",
                     kv_dtype="fp32", page_size=16, num_layers=2, num_kv_heads=1, head_dim=8)
    assert fp.key == "90649dc7ae69145b"


def _saved_chain(tmp_path: Path, num_pages: int = 6) -> tuple[PageStore, list[PageHash]]:
    """A store with a snapshot "a" of ``num_pages`` committed pages; their hashes."""
    store = disk_store(tmp_path, num_pages=2 * num_pages + 4)
    cid = store.create_context()
    write(store, cid, list(range(200, 200 + 4 * num_pages)))
    store.save_snapshot(cid, "a")
    return store, [node.page_hash for node in chain_nodes(dict(store.context_states())[cid].tip)]


def _damage(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "flip_magic":
        data[0] ^= 1
    elif how == "flip_payload":
        data[len(data) - 12] ^= 0x40
    elif how == "truncate":
        del data[100:]
    elif how == "grow":
        data += b"\0" * 8
    if how == "remove":
        path.unlink()
    else:
        path.write_bytes(bytes(data))


def test_read_pages_reads_every_page_into_the_buffer_as_read_page_does(tmp_path: Path) -> None:
    store, hashes = _saved_chain(tmp_path)
    files, size = store.tier.files, store.tier.page_bytes
    buf = bytearray(len(hashes) * size)
    records = files.read_pages(hashes, size, memoryview(buf), threads=4)
    for i, (h, record) in enumerate(zip(hashes, records, strict=True)):
        one = files.read_page(h, size)
        assert isinstance(record, PageRecord)
        assert (record.page_hash, record.parent, record.tokens, record.positions,
                record.extras) == (one.page_hash, one.parent, one.tokens, one.positions,
                                   one.extras)
        assert bytes(record.payload) == bytes(one.payload) == buf[i * size:(i + 1) * size]
    assert files.read_pages([], size, memoryview(bytearray(0))) == []


@pytest.mark.parametrize("how", ["flip_magic", "flip_payload", "truncate", "grow", "remove"])
def test_read_pages_fails_a_damaged_file_as_read_page_does(tmp_path: Path, how: str) -> None:
    store, hashes = _saved_chain(tmp_path)
    files, size = store.tier.files, store.tier.page_bytes
    for i in (1, 3):
        _damage(files.page_path(hashes[i]), how)
    records = files.read_pages(hashes, size, memoryview(bytearray(len(hashes) * size)))
    for i, (h, record) in enumerate(zip(hashes, records, strict=True)):
        if i in (1, 3):
            with pytest.raises(SnapshotCorrupt) as raised:
                files.read_page(h, size)
            assert isinstance(record, SnapshotCorrupt) and str(record) == str(raised.value)
            assert files.page_path(h).name in str(record)
        else:
            assert isinstance(record, PageRecord)


def test_a_restore_reports_the_first_damaged_page_in_chain_order(tmp_path: Path) -> None:
    store, hashes = _saved_chain(tmp_path)
    close(store)
    for i in (4, 2):
        _damage(store.tier.files.page_path(hashes[i]), "flip_payload")
    again = disk_store(tmp_path, num_pages=16)
    job = again.plan_restore("a")
    assert job is not None
    job.read()  # every page is read (on several threads); the first failure is reported
    assert job.damaged == hashes[2]
    assert isinstance(job.error, SnapshotCorrupt)
    assert again.tier.files.page_path(hashes[2]).name in str(job.error)
    with pytest.raises(SnapshotCorrupt):
        again.restore_snapshot("a", job=job)
    again.check_invariants()
