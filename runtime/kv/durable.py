"""Durable snapshots: the two slow halves of saving and reopening, as plain jobs.

Owns nothing. ``PageStore`` builds a job on the event loop (``plan_save`` /
``plan_restore``: every table read happens there), runs its I/O half anywhere (``write``
/ ``read``: a worker thread in the engine; they read only files and the bytes of pages
the job's snapshot state holds, which nothing mutates), then finishes it on the event loop
(``PageStore.end_save`` / ``PageStore.restore_snapshot``). An I/O failure is kept in the
job (``error``) and raised by the finishing half, which undoes the first.

Why this order is crash-safe: a save writes (and fsyncs) every page file it needs before
its manifest, and the manifest is renamed into place last; a restart lists only manifests,
and sweeps page files no manifest lists. So a ``kill -9`` at any moment leaves the
snapshot absent (an orphan page or a temp file at most, swept at boot) or complete.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pie_ctx.proto.errors import PieError, SnapshotCorrupt, StorageError
from runtime.kv.context import chain_nodes
from runtime.kv.file_format import FORMAT_VERSION, ManifestHead, PageRecord
from runtime.kv.snapshots import Snapshot
from runtime.kv.tier import DiskTier
from runtime.kv.types import PageHash, PageId

__all__ = ["SaveJob", "RestoreJob", "plan_save", "plan_restore", "parent_hash"]


def parent_hash(node: Any, root: int | None) -> int:
    """The hash a page after ``node`` chains from (the chain root for the first page)."""
    if node is not None:
        return int(node.page_hash)
    return 0 if root is None else int(root)


@dataclass(slots=True)
class SaveJob:
    """One save in flight: its reserved name and state, and what to write."""

    key: tuple[str, str]
    snap: Snapshot
    tier: DiskTier
    head: ManifestHead
    # (hash, parent hash, tokens, positions, extras, page id) of pages not on disk yet
    new_pages: list[tuple[PageHash, int, Sequence[int], Sequence[int], Sequence[int], PageId]]
    known: list[PageHash]  # pages already on disk (referenced from the plan on)
    to_sync: list[PageHash]  # of those, cache pages written without fsync
    tail_pages: list[PageId]
    written: list[PageHash] = field(default_factory=list)
    error: PieError | None = None

    @property
    def new_hashes(self) -> list[PageHash]:
        """The pages this save writes."""
        return [page[0] for page in self.new_pages]

    def write(self) -> None:
        """The I/O half (any thread): page files, then the manifest. Never raises."""
        try:
            self.written = self.tier.write_snapshot_pages(self.new_pages, self.to_sync)
            view = self.tier.view
            tail = b"".join(bytes(view.read(p)) for p in self.tail_pages)
            logits = self.snap.last_logits
            blob = b"" if logits is None else np.asarray(logits, dtype="<f4").tobytes()
            self.tier.files.write_manifest(self.head, tail, blob)
        except StorageError as err:
            self.written = getattr(err, "written", self.written)
            self.error = err


def plan_save(key: tuple[str, str], snap: Snapshot, tier: DiskTier, root: int | None,
              fingerprint: str) -> SaveJob:
    """Build the save of ``snap``, a fresh fork of the context saved (on the event loop)."""
    state = snap.state
    if state is None:
        raise RuntimeError("plan_save: the snapshot has no pages")
    nodes = chain_nodes(state.tip)
    new_pages, known, to_sync = [], [], []
    tokens: list[int] = []
    positions: list[int] = []
    extras: list[int] = []
    parent = parent_hash(None, root)
    for node in nodes:
        on_disk = tier.index.get(node.page_hash)
        if on_disk is not None:
            known.append(node.page_hash)
            if not on_disk.durable:
                to_sync.append(node.page_hash)
        else:
            new_pages.append((node.page_hash, parent, node.tokens, node.positions,
                              node.extras, node.page_id))
        parent = int(node.page_hash)
        tokens.extend(node.tokens)
        positions.extend(node.positions)
        extras.extend(node.extras)
    ps = tier.view.pool.page_size
    num_tail = -(-len(state.tokens) // ps)
    logits = snap.last_logits
    head = ManifestHead(
        version=FORMAT_VERSION, fingerprint=fingerprint, namespace=key[0], name=key[1],
        pages=[int(n.page_hash) for n in nodes], tokens=tokens, positions=positions,
        extras=extras, tail_tokens=list(state.tokens), tail_positions=list(state.positions),
        tail_extras=list(state.extras), tail_pages=num_tail,
        tail_bytes=num_tail * tier.page_bytes,
        logits_bytes=0 if logits is None else 4 * int(np.asarray(logits).size),
        meta=snap.meta, saved_at=time.time(), adapter=state.adapter)
    tail_pages = state.working[:num_tail]
    return SaveJob(key, snap, tier, head, new_pages, known, to_sync, tail_pages)


@dataclass(slots=True)
class RestoreJob:
    """Reading a spilled snapshot back: which page files and its blob."""

    key: tuple[str, str]
    head: ManifestHead
    tier: DiskTier
    to_read: list[PageHash]  # pages not in the pool when planned
    records: dict[PageHash, PageRecord] = field(default_factory=dict)
    tail: bytes = b""
    logits: bytes = b""
    error: PieError | None = None
    damaged: PageHash | None = None  # the page file that failed its checks, if one did

    def read(self) -> None:
        """The I/O half (any thread): read and verify the files, all pages at once on
        several threads (``DiskTier.read_many``). Never raises; the first page in chain
        order that fails its checks is the one reported."""
        try:
            for h, record in zip(self.to_read, self.tier.read_many(self.to_read), strict=True):
                if isinstance(record, SnapshotCorrupt):
                    self.damaged = h
                    raise record
                self.records[h] = record
            self.tail, self.logits = self.tier.files.read_blob(self.head)
        except SnapshotCorrupt as err:
            self.error = self.unreadable(err)

    def read_page(self, h: PageHash) -> PageRecord:
        """One page of the snapshot: read by ``read``, or now (a page that left the pool
        since the plan). Raises ``SnapshotCorrupt`` naming the snapshot and the file, with
        ``damaged`` set."""
        record = self.records.get(h)
        if record is None:
            try:
                record = self.tier.read(h)
            except SnapshotCorrupt as err:
                self.damaged = h
                raise self.unreadable(err) from None
        return record

    def unreadable(self, err: SnapshotCorrupt) -> SnapshotCorrupt:
        return SnapshotCorrupt(
            f"snapshot {self.key[1]!r} (namespace {self.key[0]!r}) cannot be opened: {err}; "
            "delete it and save it again")


def plan_restore(key: tuple[str, str], head: ManifestHead, tier: DiskTier,
                 resident: dict[PageHash, Any]) -> RestoreJob:
    """Build the restore of a spilled snapshot (on the event loop): pages already in the
    pool (``resident``: the trie's hash index) are not read."""
    to_read = [PageHash(h) for h in head.pages if h not in resident]
    return RestoreJob(key, head, tier, to_read)
