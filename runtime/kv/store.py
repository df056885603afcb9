"""``PageStore``: the one facade the engine calls for every page operation.

Owns: the pool (physical pages), the trie (committed pages), the live context states
(working pages, ``runtime.kv.states``), the snapshots (``runtime.kv.snapshot_store`` over
the registry) and, with a snapshot directory, the disk tier (``runtime.kv.tier``); nothing
outside this package touches them. This module validates and answers; the page steps live
in the context states, a snapshot's life in the snapshot store.

Contract, for every public method: validate everything first, raising a ``PieError``
subclass with state untouched; only then mutate. Expected back-pressure returns a value
(``reserve_working_pages`` -> ``False``); a broken invariant raises ``RuntimeError``.
Allocation evicts cached pages (LRU first) only when it can then succeed, so a ``False`` or
an error never changes the cache either. With a disk tier, allocation may also *spill*
resident durable snapshots (least recently used first): their pages become cached (and
then evictable), their bytes stay on disk, and opening them brings them back. Evicted
cached pages are written to the disk tier first, so prefix matching can load them back.

The public API is listed in docs/design.md ("runtime/kv"); the snapshot methods below
forward to ``SnapshotStore``, whose docstrings say how each step goes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from pie_ctx.proto.checks import count
from pie_ctx.proto.errors import InvalidArgument
from runtime.kv.compaction import check_keep, compact_state
from runtime.kv.context import PageState
from runtime.kv.disk import PageFiles
from runtime.kv.durable import RestoreJob, SaveJob
from runtime.kv.hashing import adapter_extras
from runtime.kv.holds import HoldTable
from runtime.kv.invariants import check_invariants
from runtime.kv.pool import PagePool, PoolShape
from runtime.kv.queries import ContextQueries
from runtime.kv.snapshot_store import SnapshotStore
from runtime.kv.snapshots import DEFAULT_NAMESPACE, Snapshot, SnapshotRegistry
from runtime.kv.states import ContextStates
from runtime.kv.suspend import Suspended, drop_suspended, resume_state, suspend_state
from runtime.kv.tier import DiskTier
from runtime.kv.trie import Hold, PageTrie, TrieListener
from runtime.kv.types import ContextId, PageId, StoreStats
from runtime.kv.validation import Extra, page_inputs

__all__ = ["PageStore"]


class PageStore(ContextQueries):
    """Pool + trie + contexts + snapshots behind one validated, all-or-nothing API.

    Usage::

        store = PageStore(64, 16, num_layers=2, num_kv_heads=1, head_dim=8)
        cid = store.create_context()
        store.reserve_working_pages(cid, 1)
        slots = store.write_tokens(cid, list(range(16)), list(range(16)))
        # ... the model writes K/V of token j into store.pool.kv[slots[j][0], slots[j][1]]
        store.commit_full_pages(cid)
    """

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        kv_dtype: str = "fp32",
        files: PageFiles | None = None,
        max_disk_cache_pages: int = 0,
        pool: PagePool | None = None,
        listeners: Sequence[TrieListener] = (),
        max_held_pages_per_owner: int = 0,
        clock: Callable[[], float] | None = None,
    ) -> None:
        """Allocate the pool and empty bookkeeping (and list the snapshots on disk).

        Args:
            num_pages: physical pages in the pool.
            page_size: tokens per page.
            num_layers, num_kv_heads, head_dim: KV shape per token (from the model config).
            dtype: the compute dtype K/V are written and read in.
            device: device of the pool tensor.
            kv_dtype: ``"fp32"`` (entries in ``dtype``) or ``"int8"`` (see runtime/kv/layout).
            files: a snapshot directory (its folder for this engine's fingerprint): every
                snapshot is then durable, and the disk tier is on. None: snapshots live in
                the pool only, for the store's life.
            max_disk_cache_pages: evicted cache pages kept on disk at most (with ``files``).
            pool: a pool built by the caller, of these sizes (a tensor-parallel engine's
                holds its rank's KV heads, see ``runtime.distributed``); None: a new one.
            listeners: told of every page the trie registers or evicts (the KV event log,
                ``runtime.kv.events``); the disk tier, when there is one, listens first.
            max_held_pages_per_owner: the most pages one owner's holds may cover (0: a
                quarter of the pool; see ``retain``).
            clock: the holds' clock in seconds (None: ``time.monotonic``).

        Raises:
            ValueError: a size is not a positive int, or an unknown ``kv_dtype``.
        """
        self.pool = pool if pool is not None else PagePool(PoolShape(
            num_pages, page_size, num_layers, num_kv_heads, head_dim, dtype, device, kv_dtype))
        self.page_size = page_size
        self.tier = None if files is None else DiskTier(files, self.pool, max_disk_cache_pages)
        self.trie = PageTrie(self.pool, (*(() if self.tier is None else (self.tier,)),
                                         *listeners))
        self.snapshots = SnapshotRegistry()
        self.holds = HoldTable(self.trie, self.tier, page_size, max_held_pages_per_owner,
                               **({} if clock is None else {"clock": clock}))
        self._states = ContextStates(self.pool, self.trie, page_size,
                                     expire_holds=self.holds.expire)
        self._snaps = SnapshotStore(self.pool, self.trie, self.tier, self._states, self.snapshots)
        self._snaps.list_on_disk()
        self._states.make_room = self._snaps.spill

    # -- capacity ----------------------------------------------------------------------

    @property
    def num_pages_total(self) -> int:
        """Pages in the pool: the most any single request can ever hold."""
        return self.pool.num_pages

    def num_pages_available(self) -> int:
        """Pages an allocation could get right now: free + cached (evictable)."""
        return self._states.num_available()

    def owner_pages(self, owner: Any) -> int:
        """Pages ``owner``'s contexts hold: their working pages plus every distinct committed
        page on their chains (a page shared with another owner counts for both)."""
        return self._states.owner_pages(owner)

    def owners(self) -> list[Any]:
        """Every owner holding at least one page."""
        return self._states.owners()

    # -- lifecycle ---------------------------------------------------------------------

    def create_context(self, owner: Any = None, adapter: int = 0) -> ContextId:
        """Create an empty context (no pages).

        Args:
            owner: whose page share it counts against (see ``owner_pages``); inherited by
                its forks. None counts against nobody.
            adapter: the key of the LoRA adapter its tokens are computed under (0: none);
                inherited by its forks and snapshots, and folded into every extra it
                writes or matches (``runtime.kv.hashing.adapter_extras``).

        Returns:
            Its id; ids are never reused within a store.
        """
        return self._states.register(PageState(owner=owner, adapter=adapter))

    def adapter_of(self, cid: ContextId) -> int:
        """The adapter key of a context (0: none).

        Raises:
            ContextClosed: unknown context.
        """
        return self._states.get(cid).adapter

    def fork(self, cid: ContextId) -> ContextId:
        """New context sharing ``cid``'s committed pages, with a copy of its working pages.

        O(1) in the committed length: one reference on the tip; only the working pages'
        KV bytes are copied.

        Args:
            cid: the context to fork.

        Returns:
            The new context's id.

        Raises:
            ContextClosed: ``cid`` is unknown or released.
            OutOfPages: the working copies cannot be allocated even after eviction.
        """
        state = self._states.get(cid)
        return self._states.register(self._states.fork(state, state.owner))

    def release(self, cid: ContextId) -> None:
        """Drop every reference and free every working page of ``cid``; the id dies.

        Raises:
            ContextClosed: ``cid`` is unknown or already released.
        """
        self._states.get(cid)
        self._states.release(self._states.unregister(cid))

    # -- working pages -----------------------------------------------------------------

    def reserve_working_pages(self, cid: ContextId, n: int, *, suspend: bool = True) -> bool:
        """Append ``n`` empty working pages, evicting cached pages if needed.

        Args:
            cid: the context.
            n: pages to reserve (>= 0).
            suspend: let the room maker (``set_room_maker``) suspend idle contexts for
                them (False: the raw page API's back-pressure).

        Returns:
            True on success; False (nothing changed, nothing evicted) when fewer than ``n``
            pages are free + cached (or can be made so).

        Raises:
            ContextClosed: unknown context. InvalidArgument: ``n`` is not an int >= 0.
        """
        state = self._states.get(cid)
        n = count(n, "reserve_working_pages: n")
        pages = self._states.allocate(n, suspend=suspend)
        if pages is None:
            return False
        state.working.extend(pages)
        self._states.count_working(state, n)
        return True

    def release_working_pages(self, cid: ContextId, n: int) -> None:
        """Give the last ``n`` working pages back to the pool.

        Tokens written into those pages are dropped with them.

        Raises:
            ContextClosed: unknown context.
            InvalidArgument: ``n`` is negative or exceeds the working page count.
        """
        state = self._states.get(cid)
        n = count(n, "release_working_pages: n")
        if n > len(state.working):
            raise InvalidArgument(
                f"release_working_pages: asked for {n} pages but the context has "
                f"{len(state.working)} working pages"
            )
        if n:
            self._states.release_working(state, n)

    def truncate_working_page_tokens(self, cid: ContextId, n: int) -> None:
        """Drop the last ``n`` tokens written into working pages (page count unchanged).

        Raises:
            ContextClosed: unknown context.
            InvalidArgument: ``n`` exceeds the working tokens (committed pages are immutable).
        """
        state = self._states.get(cid)
        n = count(n, "truncate_working_page_tokens: n")
        if n > len(state.tokens):
            raise InvalidArgument(
                f"truncate: asked to drop {n} tokens but only {len(state.tokens)} are in "
                "working pages; committed pages cannot be truncated"
            )
        state.keep_tokens(len(state.tokens) - n)

    def write_tokens(
        self, cid: ContextId, tokens: Sequence[int], positions: Sequence[int], extra: Extra = 0
    ) -> list[tuple[PageId, int]]:
        """Record tokens after the last written one, in already reserved working pages.

        Args:
            cid: the context.
            tokens: token ids (each in ``[0, 2**63)``).
            positions: their positions, one per token.
            extra: per-token u64 ``extra`` (an int for all, or one per token); 0 = causal.

        Returns:
            One ``(page_id, slot)`` per token: where the model must write its K and V.

        Raises:
            ContextClosed: unknown context.
            InvalidArgument: malformed inputs, or not enough reserved room (reserve first).
        """
        state = self._states.get(cid)
        toks, poss, extras = page_inputs(tokens, positions, extra)
        extras = adapter_extras(extras, state.adapter)
        room = len(state.working) * self.page_size - len(state.tokens)
        if len(toks) > room:
            raise InvalidArgument(
                f"write_tokens: {len(toks)} tokens but only {room} reserved slots; "
                "reserve_working_pages first"
            )
        return state.write(toks, poss, extras, self.page_size)

    def commit_working_pages(self, cid: ContextId, k: int) -> None:
        """Commit the first ``k`` working pages (all must be full), deduplicating each.

        A page identical to an existing committed page (same chain, tokens, positions,
        extras) is shared and the working copy goes back to the pool.

        Raises:
            ContextClosed: unknown context.
            InvalidArgument: ``k`` exceeds the working pages or one of them is not full
                (nothing is committed then).
        """
        state = self._states.get(cid)
        k = count(k, "commit_working_pages: k")
        if k > len(state.working):
            raise InvalidArgument(
                f"commit_working_pages: k={k} but the context has {len(state.working)} working pages"
            )
        if k * self.page_size > len(state.tokens):
            raise InvalidArgument(
                f"commit_working_pages: page {len(state.tokens) // self.page_size} of the first "
                f"{k} is not full ({len(state.tokens)} working tokens, page_size {self.page_size})"
            )
        self._states.commit(state, k)

    def commit_full_pages(self, cid: ContextId) -> int:
        """Commit every full working page.

        Returns:
            The number of pages committed.

        Raises:
            ContextClosed: unknown context.
        """
        state = self._states.get(cid)
        k = len(state.tokens) // self.page_size
        self._states.commit(state, k)
        return k

    def compact(self, cid: ContextId, keep: Sequence[int]) -> int:
        """Keep only the tokens at indices ``keep`` (sorted, distinct), anywhere in the
        context; their K/V keep the positions they were computed at
        (``runtime.kv.compaction``). The next position stays after the last kept token.

        Returns:
            How many leading committed pages were shared instead of copied.

        Raises:
            ContextClosed: unknown context.
            InvalidArgument: ``keep`` empty, unsorted, repeated or out of range.
            OutOfPages: the fresh pages cannot be allocated. Nothing changes on any error.
        """
        state = self._states.get(cid)
        keep = check_keep(keep, state.counters(self.page_size).seq_len)
        return compact_state(self._states, state, keep)

    # -- prefix reuse ------------------------------------------------------------------

    def match_prefix(
        self, cid: ContextId, tokens: Sequence[int], positions: Sequence[int], extra: Extra = 0
    ) -> int:
        """How many leading full pages of these tokens ``attach_prefix`` would attach.

        Read-only: touches neither counts nor LRU order. Errors as ``attach_prefix``.
        """
        state, toks, poss, extras = self._prefix_inputs(
            cid, tokens, positions, extra, "match_prefix: the context has working tokens; "
            "commit them first")
        return len(self.trie.match_pages(state.tip, toks, poss, extras, self.page_size))

    def _prefix_inputs(self, cid: ContextId, tokens: Sequence[int], positions: Sequence[int],
                       extra: Extra, refusal: str) -> tuple[PageState, list[int], list[int],
                                                            list[int]]:
        """The checked inputs of a prefix match, with the context's adapter folded into
        the extras; ``InvalidArgument(refusal)`` when the context has working tokens."""
        state = self._states.get(cid)
        toks, poss, extras = page_inputs(tokens, positions, extra)
        extras = adapter_extras(extras, state.adapter)
        if state.tokens:
            raise InvalidArgument(refusal)
        return state, toks, poss, extras

    def attach_prefix(
        self, cid: ContextId, tokens: Sequence[int], positions: Sequence[int], extra: Extra = 0
    ) -> int:
        """Attach the leading full pages of these tokens already in the trie (no compute).

        Live and cached pages both count; hits leave the LRU. The caller then writes only
        ``tokens[n * page_size:]``.

        Args:
            cid: the context; it must have no working tokens (reserved empty pages are fine).
            tokens, positions, extra: as for ``write_tokens``.

        Returns:
            ``n``, the number of pages attached (``n * page_size`` tokens consumed).

        Raises:
            ContextClosed: unknown context.
            InvalidArgument: malformed inputs, or the context has working tokens.
        """
        state, toks, poss, extras = self._prefix_inputs(
            cid, tokens, positions, extra, "attach_prefix: the context has working tokens; "
            "commit or truncate them first")
        hits = self.trie.match_pages(state.tip, toks, poss, extras, self.page_size)
        return self._states.attach(state, hits, self.tier, toks, poss, extras)

    # -- suspend and resume ------------------------------------------------------------

    def suspend(self, cid: ContextId, priority: int = 0) -> Suspended:
        """Take a context's pages out of the pool; the id dies, the returned record brings
        them back (``resume``) without computing anything (``runtime.kv.suspend``).

        Its committed pages become cached, held at ``priority`` (with a disk tier: evicted
        to disk under pressure, kept there until resumed), or copied to host memory (no
        tier); its working pages are copied to host memory and freed.

        Raises:
            ContextClosed: unknown context.
        """
        state = self._states.get(cid)
        suspended = suspend_state(self._states, self.holds, self.tier, state, priority)
        self._states.unregister(cid)
        return suspended

    def resume(self, suspended: Suspended) -> tuple[ContextId, int, int]:
        """Bring a suspended context back under a new id.

        Returns:
            ``(cid, pages_from_memory, pages_from_disk)``: the pages found still in the pool
            or copied back from host memory, and those read from the disk tier.

        Raises:
            OutOfPages: no room for the pages that left the pool. SnapshotCorrupt: the disk
                tier lost one of them. Nothing changes on either: it stays suspended.
        """
        state, from_memory, from_disk = resume_state(self._states, self.holds, self.tier,
                                                     suspended)
        return self._states.register(state), from_memory, from_disk

    def drop_suspended(self, suspended: Suspended) -> None:
        """Forget a suspended context for good (its owner released it)."""
        drop_suspended(self.holds, suspended)

    def set_room_maker(self, make_room: Callable[[int], bool]) -> None:
        """Call ``make_room(n)`` when an allocation of ``n`` pages finds too few free or
        cached even after spilling resident snapshots (every allocation but a raw
        ``reserve_working_pages(..., suspend=False)``): it may free more (the engine
        suspends idle contexts) and returns whether ``n`` are available now."""
        self._states.suspend_idle = make_room

    # -- holds -------------------------------------------------------------------------

    def retain(self, cid: ContextId, ttl: float, priority: int = 0, owner: Any = None,
               num_tokens: int | None = None) -> Hold:
        """Hold the context's committed pages (or those of its first ``num_tokens``
        tokens) for ``ttl`` seconds: after the context is gone they stay cached, evicted
        only after every unheld page, lowest ``priority`` first (``runtime.kv.holds``).

        Raises:
            ContextClosed: unknown context.
            InvalidArgument: ``ttl`` not in ``(0, max_ttl]``, ``priority`` not an int in
                ``[0, 100]``, or ``num_tokens`` negative.
            HoldLimit: ``owner``'s holds would cover more than its limit. Nothing changes
                on any error.
        """
        return self.holds.hold(self._states.get(cid), owner, ttl, priority, num_tokens)

    def release_hold(self, hold_id: int, owner: Any = None) -> None:
        """End ``owner``'s hold now; its pages are the next cached pages to go.

        Raises:
            HoldNotFound: no such live hold of ``owner``.
        """
        self.holds.release(hold_id, owner)

    # -- queries -----------------------------------------------------------------------

    # -- snapshots ---------------------------------------------------------------------

    def save_snapshot(self, cid: ContextId, name: str, namespace: str = DEFAULT_NAMESPACE, *,
                      meta: str = "", last_logits: Any = None) -> None:
        """Save a frozen copy (a fork) of the context under ``name``; the context goes on.

        With a snapshot directory the save is durable when this returns (the engine runs
        the same three steps with the I/O off the event loop: ``begin_save``,
        ``SaveJob.write``, ``end_save``).

        Args:
            cid: the context to save.
            name, namespace: where to save it.
            meta: opaque data returned with the snapshot (the SDK's conversation).
            last_logits: the logits of the context's last token, if known.

        Raises:
            ContextClosed: unknown context. InvalidArgument: bad name.
            SnapshotExists: the name is taken. OutOfPages: working copies do not fit.
            StorageError: the files could not be written (nothing is saved).
        """
        job = self.begin_save(cid, name, namespace, meta=meta, last_logits=last_logits)
        if job is not None:
            job.write()
            self.end_save(job)

    def begin_save(self, cid: ContextId, name: str, namespace: str = DEFAULT_NAMESPACE, *,
                   meta: str = "", last_logits: Any = None) -> SaveJob | None:
        """Fork the context into a snapshot. Without a disk tier that is the whole save
        (returns None); otherwise the name is reserved and the returned job must be
        written (``job.write()``, any thread) and finished (``end_save``).

        Raises: as ``save_snapshot`` (but not ``StorageError``).
        """
        return self._snaps.begin_save(self._states.get(cid), name, namespace, meta=meta,
                                      last_logits=last_logits)

    def end_save(self, job: SaveJob) -> None:
        """Finish a save: list the snapshot, or undo everything (``StorageError``: the
        write failed; no trace of the snapshot is left)."""
        self._snaps.end_save(job)

    def snapshot(self, name: str, namespace: str = DEFAULT_NAMESPACE) -> Snapshot:
        """The snapshot saved under ``name`` (read-only: its meta and last logits; a spilled
        snapshot has neither pages nor logits until ``restore_snapshot``).

        Raises:
            SnapshotNotFound: no such name. InvalidArgument: bad name.
            SnapshotIncompatible: the name belongs to another model's snapshot.
        """
        return self.snapshots.get(name, namespace)

    def plan_restore(self, name: str, namespace: str = DEFAULT_NAMESPACE) -> RestoreJob | None:
        """The reads that bring a spilled snapshot back (None: it is resident). Run
        ``job.read()`` anywhere, then ``restore_snapshot(name, namespace, job)``."""
        return self._snaps.plan_restore(name, namespace)

    def restore_snapshot(self, name: str, namespace: str = DEFAULT_NAMESPACE,
                         job: RestoreJob | None = None) -> tuple[int, int]:
        """Make a snapshot resident: its pages in the pool, its logits in memory.

        Pages still in the pool (cached) are attached; the others are copied from the
        files ``job`` read (read now when ``job`` is None or stale) and verified against
        the manifest.

        Returns:
            ``(pages_from_memory, pages_from_disk)``: its committed pages and working tail
            pages, by where their bytes came from.

        Raises:
            SnapshotNotFound / InvalidArgument: as ``snapshot``.
            SnapshotCorrupt: a file is missing or damaged (named); nothing changed.
            OutOfPages: the pool cannot hold it even after spilling every other snapshot.
        """
        return self._snaps.restore(name, namespace, job)

    def open_snapshot(self, name: str, namespace: str = DEFAULT_NAMESPACE,
                      owner: Any = None) -> ContextId:
        """A new context (of ``owner``) forked from the snapshot; the snapshot is unchanged.
        A spilled snapshot is restored first (``restore_snapshot``).

        Raises:
            SnapshotNotFound: no such name. InvalidArgument: bad name.
            OutOfPages: working copies do not fit. SnapshotCorrupt: as ``restore_snapshot``.
        """
        return self._states.register(self._snaps.open(name, namespace, owner))

    def take_snapshot(self, name: str, namespace: str = DEFAULT_NAMESPACE,
                      owner: Any = None) -> ContextId:
        """Open the snapshot (for ``owner``) and delete it, moving its pages to the new
        context in O(1).

        Raises:
            SnapshotNotFound: no such name. InvalidArgument: bad name.
            SnapshotCorrupt, OutOfPages: as ``restore_snapshot``.
            StorageError: its manifest could not be deleted (nothing changed).
        """
        return self._states.register(self._snaps.take(name, namespace, owner))

    def delete_snapshot(self, name: str, namespace: str = DEFAULT_NAMESPACE) -> None:
        """Delete the snapshot, dropping its references and working pages, and its files
        that no other snapshot uses.

        Raises:
            SnapshotNotFound: no such name. InvalidArgument: bad name.
            StorageError: its manifest could not be deleted (nothing changed).
        """
        self._snaps.delete(name, namespace)

    def list_snapshots(self, namespace: str = DEFAULT_NAMESPACE) -> list[str]:
        """Sorted snapshot names saved in ``namespace``."""
        return self.snapshots.names(namespace)

    # -- accounting --------------------------------------------------------------------

    def cached_page_ids(self) -> list[PageId]:
        """Pages evictable right now, in eviction order (next victim first)."""
        return self.trie.cached_page_ids()

    def stats(self) -> StoreStats:
        """Engine-wide page accounting and hit/eviction counters."""
        trie = self.trie
        num_free = self.pool.num_free
        self.holds.expire()
        held = self.holds.held_pages()
        return StoreStats(
            num_pages_total=self.pool.num_pages,
            num_pages_free=num_free,
            num_pages_working=self.pool.num_pages - num_free - trie.num_nodes,
            num_pages_committed=trie.num_pinned,
            num_pages_cached=trie.num_cached,
            num_contexts=len(self._states),
            num_snapshots=len(self.snapshots),
            num_commits=self._states.num_commits,
            num_dedup_hits=self._states.num_dedup_hits,
            num_prefix_hits=self._states.num_prefix_hits,
            num_evictions=trie.num_evictions,
            num_snapshots_resident=sum(1 for _, snap in self.snapshots if snap.state is not None),
            num_holds=len(self.holds), num_pages_held=sum(held.values()),
            pages_held_by_priority=held,
            **({} if self.tier is None else self.tier.stats_fields()),
        )

    @property
    def num_pages_loaded(self) -> int:
        """Pages brought back from disk since boot (0 without a disk tier)."""
        return 0 if self.tier is None else self.tier.counters.pages_loaded

    def close(self) -> None:
        """Let go of the snapshot directory (its lock; every file stays). Idempotent."""
        if self.tier is not None:
            self.tier.files.close()

    def context_states(self) -> Iterator[tuple[ContextId, PageState]]:
        """Every live context's page state (read-only use: the invariant checker, tests)."""
        return self._states.items()

    @property
    def next_context_id(self) -> int:
        """The id the next context will get (ids are never reused)."""
        return self._states.next_id

    def check_invariants(self) -> None:
        """Recompute every count from scratch and compare (``runtime.kv.invariants``).

        Raises:
            RuntimeError: an invariant is broken (a bug in the store).
        """
        check_invariants(self)
