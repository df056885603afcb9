"""The disk tier: which committed pages are on disk, who references them, and moving page
bytes between the pool and the snapshot directory.

Owns: the disk index (``PageHash -> DiskPage``) and the disk cache's LRU; the files
themselves are written through ``runtime.kv.disk.PageFiles``. The page store calls it, and
the trie tells it of each page it evicts (it is a ``TrieListener``: an evicted page is
spilled to the disk cache); it never touches the trie or a context's state.

Two kinds of page files:

* **snapshot pages**, referenced by at least one durable manifest (``refs > 0``). Written
  durably before their manifest; removed when the last manifest referencing them is
  deleted. They survive restarts.
* **cache pages**: committed pages evicted from the pool while no snapshot references them,
  written (not fsynced) so prefix matching can bring them back instead of recomputing them.
  At most ``max_cache_pages`` are kept (LRU); a restart sweeps them. A page evicted while
  a hold covers it (``runtime.kv.holds``) is written whatever that budget, and is *held*
  here (``held``: not counted, never trimmed) until its last hold ends.

Invariant (``check``): the index holds exactly the page files on disk; ``refs`` is the
number of durable manifests listing the page; the cache LRU holds exactly the pages with
``refs == 0``.

A folder shared with other engines (``PageFiles.shared``, a fleet): other engines' files
sit beside this engine's, so the index holds the files this engine knows (a subset of
those on disk), and **no page file is ever deleted**: another engine's manifest may list
a page this one stops using, or one of its saves may be about to (a page file is
content-addressed and immutable, so keeping it is always safe). Evicted cache pages are
not spilled (they would never be removed), boot sweeps nothing, and a manifest another
engine saved is adopted (``adopt_manifest``) when this engine first looks it up.
Unreferenced page files are swept by the next engine that opens the folder alone.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from pie_ctx.proto.errors import SnapshotCorrupt, StorageError
from runtime.kv.disk import PageFiles
from runtime.kv.file_format import ManifestHead, PageRecord, page_parts
from runtime.kv.hashing import chain_root, fold_extras, hash_page
from runtime.kv.pool import PagePool
from runtime.kv.trie import Node, TrieListener
from runtime.kv.types import PageHash, PageId

__all__ = ["DiskTier", "DiskPage", "TierCounters"]

log = logging.getLogger("pie_ctx.snapshots")


@dataclass(slots=True)
class DiskPage:
    """One page file: how many manifests list it, and whether it was fsynced."""

    nbytes: int
    refs: int = 0
    durable: bool = True


@dataclass(slots=True)
class TierCounters:
    """What the disk tier has done since boot."""

    pages_written: int = 0
    bytes_written: int = 0
    pages_loaded: int = 0  # disk hits: pages brought back into the pool
    bytes_loaded: int = 0
    cache_pages_dropped: int = 0  # cache pages removed to stay within the budget
    write_failures: int = 0
    snapshots_spilled: int = 0  # resident snapshots dropped from the pool under pressure


@dataclass(slots=True)
class TierView:
    """The pool's pages as bytes (what page files hold); the pool moves them."""

    pool: PagePool

    @property
    def page_bytes(self) -> int:
        return self.pool.page_bytes

    def read(self, page_id: PageId) -> memoryview:
        return self.pool.read_page(page_id)

    def write(self, page_id: PageId, payload: bytes | memoryview) -> None:
        self.pool.write_page(page_id, payload)


class DiskTier(TrieListener):
    """Page files on disk for one page store (see the module docstring).

    Args:
        files: the engine's folder in the snapshot directory.
        pool: the page pool whose bytes pages are read from and written into.
        max_cache_pages: cache pages kept on disk at most (0: evicted pages are lost).
    """

    def __init__(self, files: PageFiles, pool: PagePool, max_cache_pages: int) -> None:
        self.files = files
        self.view = TierView(pool)
        self.root_hash = chain_root(pool.kv_dtype)  # what a chain's first page chains from
        self.shared = files.shared
        self.max_cache_pages = 0 if files.shared else max_cache_pages
        self.index: dict[PageHash, DiskPage] = {}
        self.cache: OrderedDict[PageHash, None] = OrderedDict()  # refs == 0, LRU first
        # Pages manifests list whose file is gone (found at boot) or was found damaged (and
        # removed): hash -> how many manifests list it. Writing the page again restores it.
        self.missing: dict[PageHash, int] = {}
        # Pages saves in flight are writing (hash -> how many saves): their files may exist
        # before they are indexed (``adopt_written``), and nothing may delete them meanwhile.
        self.pending: dict[PageHash, int] = {}
        # Cache pages kept for holds (hash -> how many live holds list it): never trimmed.
        self.held: dict[PageHash, int] = {}
        self.counters = TierCounters()

    @property
    def page_bytes(self) -> int:
        return self.view.page_bytes

    # ------------------------------------------------------------------------- boot

    def boot(self) -> list[ManifestHead]:
        """Read every manifest's head, count references, and sweep: page files no
        manifest lists are deleted. Unreadable manifests are logged and left out.

        Returns:
            The readable manifests (each is a snapshot to list).
        """
        heads: list[ManifestHead] = []
        for _path, head in self.files.manifests():
            if isinstance(head, SnapshotCorrupt):
                log.warning("snapshot manifest skipped: %s", head)
                continue
            heads.append(head)
        on_disk = self.files.page_files()
        for head in heads:
            for h in head.pages:
                page = self.index.get(PageHash(h))
                if page is None:
                    # A missing file fails the snapshot's open (naming it), not the boot.
                    page = self.index[PageHash(h)] = DiskPage(on_disk.get(PageHash(h), 0))
                page.refs += 1
        swept = 0
        for h in on_disk.keys() - self.index.keys():
            if self.shared:
                break  # another engine's save may be writing them (see the docstring)
            self.files.remove(self.files.page_path(h), durable=False)
            swept += 1
        for h in [h for h in self.index if h not in on_disk]:
            # referenced but missing: opening its snapshot says so, until a save writes it
            self.missing[h] = self.index.pop(h).refs
            log.warning("snapshot directory %s: page file %s is missing",
                        self.files.folder, self.files.page_path(h))
        if swept:
            log.info("snapshot directory %s: swept %d unreferenced page files",
                     self.files.folder, swept)
        return heads

    # ----------------------------------------------------------------------- writing

    def evicting(self, node: Node) -> None:
        """The trie evicts ``node``: keep its page in the disk cache (see ``spill``)."""
        if node.parent is not None:
            parent = int(node.parent.page_hash)
        else:  # a chain's first page: the root (0 where the format has none)
            parent = 0 if self.root_hash is None else int(self.root_hash)
        held = len(node.holds or ())
        self.spill(node.page_hash, parent, node.tokens, node.positions, node.extras,
                   node.page_id, held)
        if held and node.page_hash in self.held:  # kept until these holds end
            for hold in node.holds or ():
                hold.on_disk.append(node.page_hash)

    def release_held(self, hashes: Iterable[PageHash]) -> None:
        """A hold that kept these cache pages ended: they count against the budget again."""
        for h in hashes:
            n = self.held.get(h, 0) - 1
            if n > 0:
                self.held[h] = n
            elif n == 0:
                del self.held[h]
        self._trim()

    def spill(self, page_hash: PageHash, parent: int, tokens: Sequence[int],
              positions: Sequence[int], extras: Sequence[int], page_id: PageId,
              held: int = 0) -> None:
        """A cached page is leaving the pool: keep it on disk (best effort: a failed
        write only loses the cache entry). A page ``held`` by that many holds is written
        whatever the cache budget, and kept until they end (``release_held``)."""
        if page_hash in self.index:
            if page_hash in self.cache:
                self.cache.move_to_end(page_hash)
                self._hold(page_hash, held)
            return
        if (self.max_cache_pages <= 0 and not held) or self.shared \
                or page_hash in self.missing:
            return  # (a missing snapshot page is written back only by a durable save)
        try:
            n = self.files.write_page(page_hash, parent, tokens, positions, extras,
                                      self.view.read(page_id), durable=False)
        except StorageError as err:
            self.counters.write_failures += 1
            log.warning("a cached page was not written to disk: %s", err)
            return
        self._count_write(n)
        self.index[page_hash] = DiskPage(n, refs=0, durable=False)
        self.cache[page_hash] = None
        self._hold(page_hash, held)
        self._trim()

    def _hold(self, page_hash: PageHash, held: int) -> None:
        if held:
            self.held[page_hash] = self.held.get(page_hash, 0) + held

    def write_snapshot_pages(
        self,
        pages: Iterable[tuple[PageHash, int, Sequence[int], Sequence[int], Sequence[int], PageId]],
        to_sync: Iterable[PageHash],
    ) -> list[PageHash]:
        """Write (durably) pages not on disk yet, and fsync cache pages a snapshot now uses.

        Runs off the event loop: it reads only files and the bytes of pages the caller's
        snapshot state holds (immutable), and touches no table. Returns the hashes it
        wrote, for ``adopt_written``.

        Raises:
            StorageError: a write failed; the pages written so far are on the error's
                ``written`` attribute, so the caller can remove them.
        """
        files = self.files
        pages = list(pages)
        try:
            files.write_many(
                [(files.page_path(h), page_parts(h, parent, tokens, positions, extras,
                                                 self.view.read(page_id)))
                 for h, parent, tokens, positions, extras, page_id in pages],
                synced=[files.page_path(h) for h in to_sync])
        except StorageError as err:
            done = set(getattr(err, "written", ()))
            err.written = [h for h, *_ in pages if files.page_path(h) in done]  # type: ignore[attr-defined]
            raise
        return [h for h, *_ in pages]

    def adopt_written(self, written: Sequence[PageHash]) -> None:
        """Index pages ``write_snapshot_pages`` wrote (on the event loop)."""
        for h in written:
            if h not in self.index:
                # a page that went missing is whole again: the manifests listing it count
                self.index[h] = DiskPage(self.page_bytes, refs=self.missing.pop(h, 0))
                self._count_write(self.page_bytes)

    def adopt_manifest(self, head: ManifestHead) -> None:
        """A shared folder: list the pages of a manifest another engine saved (as ``boot``
        does for every manifest): each counts one more reference, and a file that is not
        there makes the snapshot's open fail, naming it."""
        for h in map(PageHash, head.pages):
            page = self.index.get(h)
            if page is None and h not in self.missing:
                path = self.files.page_path(h)
                if path.exists():
                    page = self.index[h] = DiskPage(path.stat().st_size)
            if page is None:
                self.missing[h] = self.missing.get(h, 0) + 1
                continue
            page.refs += 1
            page.durable = True
            self.cache.pop(h, None)

    def add_refs(self, hashes: Iterable[int]) -> None:
        """A durable manifest now lists these pages (all on disk)."""
        for h in hashes:
            page = self.index[PageHash(h)]
            page.refs += 1
            page.durable = True
            self.cache.pop(PageHash(h), None)
            self.held.pop(PageHash(h), None)

    def drop_refs(self, hashes: Iterable[int]) -> None:
        """A manifest listing these pages is gone: delete the files nothing else lists."""
        for h in hashes:
            page = self.index.get(PageHash(h))
            if page is None:
                if self.missing.get(PageHash(h), 0) > 1:
                    self.missing[PageHash(h)] -= 1
                else:
                    self.missing.pop(PageHash(h), None)
                continue
            page.refs -= 1
            if page.refs <= 0:
                self.remove_page(PageHash(h))

    def begin_writes(self, hashes: Iterable[PageHash]) -> None:
        """A save will write these pages (``end_writes`` when it is finished or failed)."""
        for h in hashes:
            self.pending[h] = self.pending.get(h, 0) + 1

    def end_writes(self, hashes: Iterable[PageHash]) -> None:
        """A save that called ``begin_writes`` ended (after ``adopt_written`` if it
        succeeded). A page no other save is writing and nothing indexed is an orphan of a
        failed save: its file, if any, is deleted now."""
        for h in hashes:
            if self.pending.get(h, 0) > 1:
                self.pending[h] -= 1
                continue
            self.pending.pop(h, None)
            if h not in self.index:
                self.remove_page(h)

    def remove_page(self, h: PageHash) -> None:
        """Delete one page file (an orphan left by a failure is swept at the next boot).
        A file a save in flight is writing stays until that save ends (``end_writes``)."""
        self.index.pop(h, None)
        self.cache.pop(h, None)
        self.held.pop(h, None)
        if h in self.pending or self.shared:
            return  # (shared: another engine may use the file; see the docstring)
        try:
            self.files.remove(self.files.page_path(h), durable=False)
        except StorageError as err:
            log.warning("%s (swept at the next start)", err)

    def _count_write(self, nbytes: int) -> None:
        self.counters.pages_written += 1
        self.counters.bytes_written += nbytes

    def _trim(self) -> None:
        """Drop the least recently used unheld cache pages over the budget."""
        unheld = [h for h in self.cache if h not in self.held]
        for h in unheld[:max(0, len(unheld) - self.max_cache_pages)]:
            del self.cache[h]
            self.counters.cache_pages_dropped += 1
            self.remove_page(h)

    # ----------------------------------------------------------------------- reading

    def find(self, parent: int, tokens: Sequence[int], positions: Sequence[int],
             extras: Sequence[int]) -> PageRecord | None:
        """The page continuing ``parent`` with these contents, read from disk and
        verified, or None (not on disk, or its file is damaged: then it is dropped)."""
        h = hash_page(parent, tokens, positions, fold_extras(extras))
        if h not in self.index:
            return None
        try:
            record = self.read(h)
        except SnapshotCorrupt as err:
            log.warning("%s; computing the page instead", err)
            self.drop_damaged(h)
            return None
        if (record.parent, record.tokens, record.positions, record.extras) != (
                parent, tuple(tokens), tuple(positions), tuple(extras)):
            return None  # a 64-bit hash collision: not this page
        if h in self.cache:
            self.cache.move_to_end(h)
        return record

    def read(self, h: PageHash) -> PageRecord:
        """Read and verify one page file (any thread).

        Raises:
            SnapshotCorrupt: the file is missing or damaged (the message names it).
        """
        if h not in self.index:
            raise SnapshotCorrupt(f"page file {self.files.page_path(h)} is missing")
        return self.files.read_page(h, self.page_bytes)

    def read_many(self, hashes: Sequence[PageHash]) -> list[PageRecord | SnapshotCorrupt]:
        """Read and verify several page files at once (any thread; ``PageFiles.read_pages``:
        several threads), their KV bytes into one new buffer the records' payloads view.

        Returns:
            For each hash, in order, its record or the ``SnapshotCorrupt`` raised by
            ``read`` (the file is missing or damaged).
        """
        indexed = [h in self.index for h in hashes]  # (once: the loop may change the index)
        present = [h for h, ok in zip(hashes, indexed, strict=True) if ok]
        # [pages, page_bytes] (numpy: a large allocation is backed by huge pages on Linux)
        staging = np.empty((len(present), self.page_bytes), dtype=np.uint8)
        read = iter(self.files.read_pages(present, self.page_bytes, memoryview(staging)))
        return [next(read) if ok else
                SnapshotCorrupt(f"page file {self.files.page_path(h)} is missing")
                for h, ok in zip(hashes, indexed, strict=True)]

    def drop_damaged(self, h: PageHash) -> None:
        """A page file failed its checks: delete it, so no save reuses it. The manifests
        listing it keep their count (``missing``); a save that computes the page again
        writes it afresh, which heals them too."""
        page = self.index.get(h)
        if page is None:
            return
        try:  # written afresh since it failed (a stale restore job)? then it is fine
            self.files.read_page(h, self.page_bytes)
            return
        except SnapshotCorrupt:
            pass
        if page.refs:
            self.missing[h] = page.refs
        self.remove_page(h)

    def install(self, page_id: PageId, payload: bytes | memoryview) -> None:
        """Copy a page's bytes read from disk into the pool (on the event loop: numpy's
        copy of one page, which starts no torch thread team)."""
        self.view.write(page_id, payload)
        self.counters.pages_loaded += 1
        self.counters.bytes_loaded += memoryview(payload).nbytes

    # ------------------------------------------------------------------------ checks

    @property
    def num_pages(self) -> int:
        return len(self.index)

    @property
    def num_bytes(self) -> int:
        return sum(p.nbytes for p in self.index.values())

    def stats_fields(self) -> dict[str, int]:
        """The disk tier's part of ``StoreStats``: files on disk and bytes moved."""
        c = self.counters
        return {"num_disk_pages": self.num_pages, "num_disk_bytes": self.num_bytes,
                "disk_pages_written": c.pages_written, "disk_bytes_written": c.bytes_written,
                "disk_pages_loaded": c.pages_loaded, "disk_bytes_loaded": c.bytes_loaded,
                "num_snapshots_spilled": c.snapshots_spilled}

    def check(self, refs: dict[PageHash, int]) -> None:
        """Compare the index with the files on disk and ``refs`` (hash -> manifests that
        list it, recomputed by the caller).

        Raises:
            RuntimeError: a page file is lost or orphaned, or a count is off.
        """
        on_disk = self.files.page_files()
        lost = set(self.index) - set(on_disk)
        orphans = set() if self.shared else (  # (shared: other engines' files are there)
            set(on_disk) - set(self.index) - set(self.pending))  # (pending: being saved)
        if lost or orphans:
            raise RuntimeError(f"disk tier: index != files (lost {sorted(lost)[:3]}, "
                               f"orphans {sorted(orphans)[:3]})")
        for h, page in self.index.items():
            if page.refs != refs.get(h, 0):
                raise RuntimeError(f"disk tier: page {h:016x} has refs {page.refs}, "
                                   f"manifests list it {refs.get(h, 0)} times")
            if (page.refs == 0) != (h in self.cache):
                raise RuntimeError(f"disk tier: page {h:016x} cache membership is wrong")
        if stray := set(self.held) - set(self.cache):
            raise RuntimeError(f"disk tier: held pages outside the cache: {sorted(stray)[:3]}")
        if lost := set(refs) - set(self.index) - set(self.missing):
            raise RuntimeError(f"disk tier: manifests list pages not on disk: {sorted(lost)[:3]}")
        for h, n in self.missing.items():
            if h in self.index or n != refs.get(h, 0):
                raise RuntimeError(f"disk tier: missing page {h:016x} counts {n} manifests, "
                                   f"they list it {refs.get(h, 0)} times")
