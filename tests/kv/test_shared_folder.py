"""One snapshot folder shared by several engines (``PageFiles(shared=True)``, a fleet).

A hypothesis state machine drives two writers (stores A and B) and a reader (C) on one
folder: saves (one at a time, or both writers saving one name at once with their writes
interleaved either way), opens, deletes, memory pressure and restarts of any of them. The
model is what the folder holds: name -> tokens. The rule for two saves of one name at
once is **the last writer wins** (the manifest renamed last is the snapshot, whole); a save
of a name another engine's save already listed is refused (``SnapshotExists``), as on one
engine. After every step: each store's invariants; the manifests on disk are exactly the
model's names; every page file a manifest lists is there and verifies (never torn); the
temp folder holds only the live engines' own (empty) folders.

Plus direct tests: a snapshot saved by A opens on C with every page read from the folder
(0 from memory, nothing computed), and one engine alone still refuses a shared folder.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from pie_ctx.errors import OutOfPages, SnapshotExists, SnapshotNotFound, StorageError
from runtime.kv import PageStore
from runtime.kv.file_format import read_head

from .disk_helpers import check_kv, close, disk_store, try_write

SLOW = os.environ.get("PIE_CTX_SLOW") == "1"
NAMES = ["a", "b", "c"]
TOKENS = st.lists(st.integers(0, 3), min_size=1, max_size=14)  # small alphabet: pages dedup
STORES = ["A", "B", "C"]
WRITERS = ["A", "B"]


class SharedFolderMachine(RuleBasedStateMachine):
    """Three small stores on one shared snapshot folder, against the folder's contents."""

    def __init__(self) -> None:
        super().__init__()
        self.root = Path(tempfile.mkdtemp(prefix="pie-shared-sm-"))
        self.stores: dict[str, PageStore] = {}
        self.truth: dict[str, list[int]] = {}  # name -> tokens of the manifest on disk
        self.page_size = 2

    def teardown(self) -> None:
        for store in self.stores.values():
            close(store)
        shutil.rmtree(self.root, ignore_errors=True)

    @initialize(page_size=st.integers(2, 4))
    def setup(self, page_size: int) -> None:
        self.page_size = page_size
        for name in STORES:
            self.stores[name] = self._new_store()

    def _new_store(self) -> PageStore:
        return disk_store(self.root, 12, self.page_size, shared=True)

    def _context(self, store: PageStore, tokens: list[int]) -> int | None:
        cid = store.create_context()
        if not try_write(store, cid, tokens):
            store.release(cid)
            return None
        return cid

    # -- rules -------------------------------------------------------------------------

    @rule(writer=st.sampled_from(WRITERS), name=st.sampled_from(NAMES), tokens=TOKENS)
    def save(self, writer: str, name: str, tokens: list[int]) -> None:
        store = self.stores[writer]
        cid = self._context(store, tokens)
        if cid is None:
            return
        try:
            store.save_snapshot(cid, name, meta=str(tokens))
        except SnapshotExists:
            assert name in self.truth  # listed by someone: refused, as on one engine
        except OutOfPages:
            pass
        else:
            assert name not in self.truth
            self.truth[name] = tokens
        finally:
            store.release(cid)

    @rule(name=st.sampled_from(NAMES), a=TOKENS, b=TOKENS, a_last=st.booleans())
    def save_at_once(self, name: str, a: list[int], b: list[int], a_last: bool) -> None:
        """A and B save one name at once: both pass the name check, both write; the
        manifest renamed last is the snapshot."""
        if name in self.truth:
            return
        sa, sb = self.stores["A"], self.stores["B"]
        ca, cb = self._context(sa, a), self._context(sb, b)
        try:
            if ca is None or cb is None:
                return
            try:
                ja = sa.begin_save(ca, name, meta=str(a))
                jb = sb.begin_save(cb, name, meta=str(b))
            except OutOfPages:
                return
            assert ja is not None and jb is not None
            first, last = (jb, ja) if a_last else (ja, jb)
            first.write()
            last.write()
            sa.end_save(ja)
            sb.end_save(jb)
            self.truth[name] = a if a_last else b
        finally:
            for store, cid in ((sa, ca), (sb, cb)):
                if cid is not None:
                    store.release(cid)

    @rule(who=st.sampled_from(STORES), name=st.sampled_from(NAMES))
    def open(self, who: str, name: str) -> None:
        store = self.stores[who]
        try:
            cid = store.open_snapshot(name)
        except SnapshotNotFound:
            assert name not in self.truth
            return
        except OutOfPages:
            return
        try:
            assert name in self.truth
            assert store.tokens(cid) == self.truth[name]
            assert store.snapshot(name).meta == str(self.truth[name])
            check_kv(store, cid)  # every token's K/V, whoever computed it
        finally:
            store.release(cid)

    @rule(who=st.sampled_from(STORES), name=st.sampled_from(NAMES))
    def delete(self, who: str, name: str) -> None:
        try:
            self.stores[who].delete_snapshot(name)
        except SnapshotNotFound:
            assert name not in self.truth
        else:
            del self.truth[name]

    @rule(who=st.sampled_from(STORES), tokens=st.lists(st.integers(4, 9), min_size=20,
                                                         max_size=40))
    def pressure(self, who: str, tokens: list[int]) -> None:
        """Fill the pool: resident snapshots spill and cached pages are evicted."""
        store = self.stores[who]
        cid = self._context(store, tokens)
        if cid is not None:
            store.release(cid)

    @rule(who=st.sampled_from(STORES))
    def restart(self, who: str) -> None:
        close(self.stores[who])
        self.stores[who] = self._new_store()

    # -- invariants --------------------------------------------------------------------

    @invariant()
    def folder_holds_the_truth(self) -> None:
        if not self.stores:
            return
        for store in self.stores.values():
            store.check_invariants()
        files = next(iter(self.stores.values())).tier.files
        heads = {read_head(p).name: read_head(p) for p in files.snaps_dir.glob("*.snap")}
        assert sorted(heads) == sorted(self.truth)
        ps = self.page_size
        for name, head in heads.items():
            tokens = self.truth[name]
            assert head.tokens + head.tail_tokens == tokens
            for i, h in enumerate(head.pages):  # there, whole, and the page it should be
                record = files.read_page(h, files_page_bytes(self.stores))
                assert list(record.tokens) == tokens[i * ps:(i + 1) * ps]
        live = {s.tier.files.tmp_dir for s in self.stores.values()}
        for entry in files.tmp_dir.parent.iterdir():
            if entry.is_dir():
                assert entry in live and not any(entry.iterdir())
            else:
                assert entry.suffix == ".lock" and entry.with_suffix("") in live


def files_page_bytes(stores: dict[str, PageStore]) -> int:
    return next(iter(stores.values())).tier.page_bytes


TestSharedFolder = SharedFolderMachine.TestCase
TestSharedFolder.settings = settings(
    max_examples=1000 if SLOW else 60, stateful_step_count=30, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


def test_a_snapshot_saved_on_one_engine_opens_on_another_from_the_folder(tmp_path) -> None:
    a = disk_store(tmp_path, 16, 4, shared=True)
    c = disk_store(tmp_path, 16, 4, shared=True)
    cid = a.create_context()
    try_write(a, cid, list(range(10)))  # 2 committed pages + 2 working tokens
    a.save_snapshot(cid, "s")
    assert c.list_snapshots() == []  # (listing shows what this engine has looked up)
    assert c.restore_snapshot("s") == (0, 3)  # every page from the folder, none in memory
    opened = c.open_snapshot("s")
    assert c.tokens(opened) == list(range(10))
    check_kv(c, opened)
    assert c.list_snapshots() == ["s"]
    # A deletes it: C forgets it at its next look, and the page files stay (C's copy, and
    # any other engine's save, may still use them).
    pages = set(a.tier.files.page_files())
    a.delete_snapshot("s")
    with pytest.raises(SnapshotNotFound):
        c.snapshot("s")
    assert set(a.tier.files.page_files()) == pages
    c.release(opened)
    for s in (a, c):
        s.check_invariants()
        close(s)
    # An engine alone sweeps what no manifest lists.
    alone = disk_store(tmp_path, 16, 4)
    assert alone.tier.files.page_files() == {}
    close(alone)


def test_an_engine_alone_and_sharing_engines_never_meet(tmp_path) -> None:
    shared = disk_store(tmp_path, 8, 4, shared=True)
    with pytest.raises(StorageError, match="--shared-snapshots"):
        disk_store(tmp_path, 8, 4)
    close(shared)
    alone = disk_store(tmp_path, 8, 4)
    with pytest.raises(StorageError, match="does not share it"):
        disk_store(tmp_path, 8, 4, shared=True)
    close(alone)


def test_the_temp_folder_of_a_dead_engine_is_swept(tmp_path) -> None:
    # An engine that dies (os._exit: no close) with a half-written file in its temp folder.
    code = ("import os, sys; from tests.kv.disk_helpers import disk_store; "
            "s = disk_store(sys.argv[1], 8, 4, shared=True); "
            "(s.tier.files.tmp_dir / 'half.page.1').write_bytes(b'x'); "
            "print(s.tier.files.tmp_dir, flush=True); os._exit(0)")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True,
                         text=True, check=True, timeout=120, cwd=Path(__file__).parents[2])
    dead = Path(out.stdout.strip())
    assert (dead / "half.page.1").exists()
    b = disk_store(tmp_path, 8, 4, shared=True)
    assert not dead.exists() and not Path(f"{dead}.lock").exists()
    assert b.tier.files.tmp_dir.exists()
    close(b)
