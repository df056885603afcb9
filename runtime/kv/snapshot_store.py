"""``SnapshotStore``: the whole life of a snapshot's pages, behind ``PageStore``'s methods.

Owns: the snapshot lifecycle over the registry (``runtime.kv.snapshots``): save (a frozen
fork; with a disk tier reserved, written off the loop by a ``SaveJob`` and then listed or
undone), restore (a spilled snapshot's pages back from the pool's cache or from its files,
verified against its manifest), open (a fork out), take (a move out in O(1)), delete, and
spill (resident durable snapshots leave the pool, least recently used first, when an
allocation needs their room). It owns no pages: it forks into and out of the context
states (``runtime.kv.states``) that own them.

The stale-job rule: a ``RestoreJob`` read off the loop is used only if the snapshot's head
is still the one it was planned for; otherwise the reads are planned and run again.
``PageStore`` validates nothing twice: the registry checks names, the states check ids.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from pie_ctx.proto.errors import SnapshotCorrupt
from runtime.kv.context import PageState
from runtime.kv.durable import RestoreJob, SaveJob, parent_hash, plan_restore, plan_save
from runtime.kv.file_format import foreign_manifests, read_head
from runtime.kv.pool import PagePool
from runtime.kv.snapshots import Snapshot, SnapshotRegistry, snapshot_key
from runtime.kv.states import ContextStates
from runtime.kv.tier import DiskTier
from runtime.kv.trie import PageTrie

log = logging.getLogger("pie_ctx.snapshots")

__all__ = ["SnapshotStore"]


class SnapshotStore:
    """Snapshots of one store: the registry, forked into and out of ``states``.

    Args:
        pool, trie: the store's pages.
        tier: the disk tier (None: snapshots live in the pool only).
        states: the live contexts, whose states snapshots fork from and into.
        registry: the table of snapshots (already holding those listed on disk).
    """

    def __init__(self, pool: PagePool, trie: PageTrie, tier: DiskTier | None,
                 states: ContextStates, registry: SnapshotRegistry) -> None:
        self.pool = pool
        self.trie = trie
        self.tier = tier
        self.states = states
        self.registry = registry
        if tier is not None and tier.files.shared:
            registry.sync = self.sync_from_disk

    def list_on_disk(self) -> None:
        """List the snapshots the disk tier found at boot (spilled: pages on disk only),
        and count those saved by another model or page size (unopenable here)."""
        if self.tier is None:
            return
        for head in self.tier.boot():
            self.registry.put((head.namespace, head.name), Snapshot(None, head.meta, None, head))
        self.registry.foreign = foreign_manifests(self.tier.files.root,
                                                  self.tier.files.fingerprint)
        if self.registry.foreign:
            log.warning("%d snapshots in %s were saved by another model or page size; "
                        "this engine cannot open them", len(self.registry.foreign),
                        self.tier.files.root)

    def sync_from_disk(self, key: tuple[str, str]) -> None:
        """A folder shared with other engines (docs/scale-out.md): make the entry under
        ``key`` the manifest on disk. A manifest this engine does not list is listed
        (spilled: its pages are read from the folder on open); one replaced by another
        engine's save (the last writer wins) replaces this engine's entry; one deleted
        elsewhere is forgotten here. Unchanged: one small read."""
        tier, (namespace, name) = self.disk, key
        path = tier.files.manifest_path(namespace, name)
        try:
            head = read_head(path) if path.exists() else None
        except SnapshotCorrupt as err:  # deleted while read, or damaged: not listed
            log.warning("shared snapshot folder: %s", err)
            head = None
        if head is not None and (head.fingerprint != tier.files.fingerprint.key
                                 or (head.namespace, head.name) != (namespace, name)):
            head = None
        snap = self.registry.entry(key)
        if snap is not None and snap.head is not None and snap.head == head:
            return
        if snap is not None:
            if snap.head is None:
                return  # (never with a tier: every listed snapshot has its manifest)
            self.registry.forget(key)
            tier.drop_refs(snap.head.pages)
            if snap.state is not None:
                self.states.release(snap.state)
        if head is not None:
            tier.adopt_manifest(head)
            self.registry.put(key, Snapshot(None, head.meta, None, head))

    @property
    def disk(self) -> DiskTier:
        """The disk tier, in code that runs only with one."""
        if self.tier is None:
            raise RuntimeError("no snapshot directory: this path needs the disk tier")
        return self.tier

    # -- spilling ----------------------------------------------------------------------

    def spill(self, n: int) -> bool:
        """Drop resident durable snapshots from the pool, least recently used first, until
        ``n`` pages are free or cached; True when they are. Their files stay on disk."""
        resident = self.registry.resident
        while resident and self.states.num_available() < n:
            _, snap = resident.popitem(last=False)
            self.states.release(snap.pages)
            snap.state = None
            snap.last_logits = None  # on disk too; read back on open
            self.disk.counters.snapshots_spilled += 1
        return self.states.num_available() >= n

    # -- saving ------------------------------------------------------------------------

    def begin_save(self, state: PageState, name: str, namespace: str, *,
                   meta: str, last_logits: Any) -> SaveJob | None:
        """Fork ``state`` into a snapshot (see ``PageStore.begin_save``)."""
        key = self.registry.check_free(name, namespace)
        snap = Snapshot(self.states.fork(state, None), meta, last_logits)
        if self.tier is None:
            self.registry.put(key, snap)
            return None
        job = plan_save(key, snap, self.tier, self.trie.root_hash, self.tier.files.fingerprint.key)
        self.tier.add_refs(job.known)  # no delete may remove them while the job writes
        self.tier.begin_writes(job.new_hashes)  # nor the files it writes before end_save
        self.registry.reserve(key, job)
        return job

    def end_save(self, job: SaveJob) -> None:
        """List the written snapshot, or undo everything if its write failed (see
        ``PageStore.end_save``)."""
        tier = self.disk
        self.registry.unreserve(job.key)
        if job.error is not None:
            tier.end_writes(job.new_hashes)  # deletes what it wrote that nothing else uses
            tier.drop_refs(job.known)
            self.states.release(job.snap.pages)
            raise job.error
        tier.adopt_written(job.written)
        tier.end_writes(job.new_hashes)
        tier.add_refs(job.written)
        job.snap.head = job.head
        self.registry.put(job.key, job.snap)

    # -- restoring ---------------------------------------------------------------------

    def plan_restore(self, name: str, namespace: str) -> RestoreJob | None:
        """The reads that bring a spilled snapshot back (None: it is resident)."""
        snap = self.registry.get(name, namespace)
        if snap.state is not None:
            return None
        return plan_restore(snapshot_key(name, namespace), snap.head, self.disk,
                            self.trie.by_hash)

    def restore(self, name: str, namespace: str,
                job: RestoreJob | None = None) -> tuple[int, int]:
        """Make a snapshot resident (see ``PageStore.restore_snapshot``)."""
        key = snapshot_key(name, namespace)
        snap = self.registry.get(name, namespace)
        if snap.state is not None:
            self.registry.touch(key, snap)
            return snap.state.num_committed_pages + len(snap.state.working), 0
        if job is None or job.head is not snap.head:  # the stale-job rule
            job = plan_restore(key, snap.head, self.disk, self.trie.by_hash)
            job.read()
        if job.error is not None:
            if job.damaged is not None:
                self.disk.drop_damaged(job.damaged)
            raise job.error
        state, from_memory = self._install(job)
        snap.state = state
        snap.last_logits = np.frombuffer(job.logits, dtype="<f4") if job.logits else None
        self.registry.touch(key, snap)
        return from_memory, state.num_committed_pages + len(state.working) - from_memory

    def _install(self, job: RestoreJob) -> tuple[PageState, int]:
        """Rebuild a spilled snapshot's state from ``job``; returns it and the number of
        pages found in the pool. On any error every page taken goes back."""
        head, ps, tier, states = job.head, self.states.page_size, self.disk, self.states
        state = PageState(adapter=head.adapter)
        from_memory = 0
        what = f"reopen snapshot {job.key[1]!r}"
        try:
            for i, h in enumerate(head.pages):
                lo, hi = i * ps, (i + 1) * ps
                toks = tuple(head.tokens[lo:hi])
                poss, extras = tuple(head.positions[lo:hi]), tuple(head.extras[lo:hi])
                node = self.trie.lookup(state.tip, toks, poss, extras)
                if node is not None:
                    states.set_tip(state, node)
                    from_memory += 1
                    continue
                try:
                    record = job.read_page(h)
                except SnapshotCorrupt:
                    tier.drop_damaged(h)  # no save may reuse it
                    raise
                if (record.parent, record.tokens, record.positions, record.extras) != (
                        parent_hash(state.tip, self.trie.root_hash), toks, poss, extras):
                    raise SnapshotCorrupt(f"page file {tier.files.page_path(h)} does not hold "
                                          f"page {i} of snapshot {job.key[1]!r}")
                page = states.allocate_or_raise(1, what)
                tier.install(page[0], record.payload)
                states.commit_page(state, page[0], toks, poss, extras)
            state.committed_ids = None  # recomputed from the tip on first use
            tail = states.allocate_or_raise(head.tail_pages, what)
            state.working = tail
            for j, page_id in enumerate(tail):
                tier.install(page_id, job.tail[j * tier.page_bytes:(j + 1) * tier.page_bytes])
            state.tokens = list(head.tail_tokens)
            state.positions = list(head.tail_positions)
            state.extras = list(head.tail_extras)
        except BaseException:
            states.release(state)
            raise
        return state, from_memory

    # -- opening, taking, deleting -----------------------------------------------------

    def open(self, name: str, namespace: str, owner: Any) -> PageState:
        """A new state (of ``owner``) forked from the snapshot, restored first if spilled."""
        key = snapshot_key(name, namespace)
        self.restore(name, namespace)
        snap = self.registry.get(name, namespace)
        self.registry.resident.pop(key, None)  # never spilled while it is forked from
        try:
            return self.states.fork(snap.pages, owner)
        finally:
            self.registry.touch(key, snap)

    def take(self, name: str, namespace: str, owner: Any) -> PageState:
        """The snapshot's own state, unlisted and handed to ``owner`` (O(1))."""
        self.restore(name, namespace)
        state = self._forget(name, namespace).pages
        if owner is not None:  # snapshots count against nobody: the new owner takes them on
            self.states.hand_over(state, owner)
        return state

    def delete(self, name: str, namespace: str) -> None:
        """Unlist the snapshot and release its pages and the files no other one uses."""
        snap = self._forget(name, namespace)
        if snap.state is not None:
            self.states.release(snap.state)

    def _forget(self, name: str, namespace: str) -> Snapshot:
        """Unlist a snapshot: its manifest first (durably), then its entry and file
        references. Its page state, if any, is the caller's."""
        snap = self.registry.get(name, namespace)
        if snap.head is not None:
            self.disk.files.remove(self.disk.files.manifest_path(namespace, name))
        self.registry.forget(snapshot_key(name, namespace))
        if snap.head is not None:
            self.disk.drop_refs(snap.head.pages)
        return snap
