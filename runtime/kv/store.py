"""``PageStore``: the one facade the engine calls for every page operation.

Owns: the pool (physical pages), the trie (committed pages), the live context states
(working pages), the snapshot registry and, with a snapshot directory, the disk tier
(``runtime.kv.tier``); nothing outside this package touches them.

Contract, for every public method: validate everything first, raising a ``PieError``
subclass with state untouched; only then mutate. Expected back-pressure returns a value
(``reserve_working_pages`` -> ``False``); a broken invariant raises ``RuntimeError``.
Allocation evicts cached pages (LRU first) only when it can then succeed, so a ``False`` or
an error never changes the cache either. With a disk tier, allocation may also *spill*
resident durable snapshots (least recently used first): their pages become cached (and
then evictable), their bytes stay on disk, and opening them brings them back. Evicted
cached pages are written to the disk tier first, so prefix matching can load them back.

Public API (see docs/design.md, "runtime/kv")::

    store = PageStore(num_pages, page_size, num_layers, num_kv_heads, head_dim, dtype, device)
    cid = store.create_context(); store.fork(cid); store.release(cid)
    store.reserve_working_pages(cid, n) -> bool
    store.write_tokens(cid, tokens, positions, extra=0) -> [(page_id, slot), ...]
    store.commit_full_pages(cid) -> int; store.commit_working_pages(cid, k)
    store.release_working_pages(cid, n); store.truncate_working_page_tokens(cid, n)
    store.attach_prefix(cid, tokens, positions, extra=0) -> int
    store.page_table(cid); store.state(cid); store.tokens(cid); store.next_position(cid)
    store.save_snapshot(cid, name, ns, meta=, last_logits=); store.snapshot(name, ns)
    store.begin_save(...) -> job; job.write(); store.end_save(job)   # I/O off the loop
    store.plan_restore(name, ns) -> job; job.read(); store.restore_snapshot(name, ns, job)
    store.open_snapshot(name, ns); store.take_snapshot(name, ns)
    store.delete_snapshot(name, ns); store.list_snapshots(ns)
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from pie_ctx.proto.checks import count
from pie_ctx.proto.errors import ContextClosed, InvalidArgument, OutOfPages, SnapshotCorrupt
from pie_ctx.proto.messages import ContextState
from runtime.kv.context import PageState, chain_nodes
from runtime.kv.disk import PageFiles, foreign_manifests
from runtime.kv.durable import RestoreJob, SaveJob, parent_hash, plan_restore, plan_save
from runtime.kv.hashing import adapter_extras
from runtime.kv.invariants import check_invariants
from runtime.kv.pool import PagePool
from runtime.kv.snapshots import DEFAULT_NAMESPACE, Snapshot, SnapshotRegistry, snapshot_key
from runtime.kv.tier import DiskTier
from runtime.kv.trie import Node, PageTrie
from runtime.kv.types import ContextId, PageId, StoreStats
from runtime.kv.validation import Extra, page_inputs

log = logging.getLogger("pie_ctx.snapshots")

__all__ = ["PageStore"]


class PageStore:
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

        Raises:
            ValueError: a size is not a positive int, or an unknown ``kv_dtype``.
        """
        self.pool = pool if pool is not None else PagePool(
            num_pages, page_size, num_layers, num_kv_heads, head_dim, dtype, device, kv_dtype
        )
        self.page_size = page_size
        self.tier = None if files is None else DiskTier(files, self.pool, max_disk_cache_pages)
        self.trie = PageTrie(self.pool, on_evict=None if files is None else self._spill_page)
        self.snapshots = SnapshotRegistry()
        if self.tier is not None:
            for head in self.tier.boot():
                self.snapshots.put((head.namespace, head.name), Snapshot(None, head.meta, None, head))
            self.snapshots.foreign = foreign_manifests(self.tier.files.root,
                                                       self.tier.files.fingerprint)
            if self.snapshots.foreign:
                log.warning("%d snapshots in %s were saved by another model or page size; "
                            "this engine cannot open them", len(self.snapshots.foreign),
                            self.tier.files.root)
        self._contexts: dict[ContextId, PageState] = {}
        self._working_of: dict[Any, int] = {}  # owner -> working pages of its states
        self._next_id = 1
        self._num_commits = 0
        self._num_dedup_hits = 0
        self._num_prefix_hits = 0

    # -- capacity ----------------------------------------------------------------------

    @property
    def _disk(self) -> DiskTier:
        """The disk tier, in code that runs only with one."""
        if self.tier is None:
            raise RuntimeError("no snapshot directory: this path needs the disk tier")
        return self.tier

    @property
    def num_pages_total(self) -> int:
        """Pages in the pool: the most any single request can ever hold."""
        return self.pool.num_pages

    def num_pages_available(self) -> int:
        """Pages an allocation could get right now: free + cached (evictable)."""
        return self.pool.num_free + self.trie.num_cached

    def _allocate(self, n: int) -> list[PageId] | None:
        """Allocate ``n`` pages, evicting cached pages only if that makes it succeed (and
        first spilling resident durable snapshots if the cache is not enough)."""
        if n - self.pool.num_free > self.trie.num_cached and not self._spill_snapshots(n):
            return None
        short = n - self.pool.num_free
        if short > 0:
            self.trie.evict(short)
        return self.pool.allocate(n)

    def _spill_snapshots(self, n: int) -> bool:
        """Drop resident durable snapshots from the pool, least recently used first, until
        ``n`` pages are free or cached; True when they are. Their files stay on disk."""
        resident = self.snapshots.resident
        while resident and self.pool.num_free + self.trie.num_cached < n:
            _, snap = resident.popitem(last=False)
            self._release_state(snap.pages)
            snap.state = None
            snap.last_logits = None  # on disk too; read back on open
            self._disk.counters.snapshots_spilled += 1
        return self.pool.num_free + self.trie.num_cached >= n

    def _spill_page(self, node: Node) -> None:
        """The trie evicts ``node``: keep its page on disk (the disk tier decides)."""
        self._disk.spill(node.page_hash, parent_hash(node.parent, self.trie.root_hash),
                        node.tokens, node.positions, node.extras, node.page_id)

    def owner_pages(self, owner: Any) -> int:
        """Pages ``owner``'s contexts hold: their working pages plus every distinct committed
        page on their chains (a page shared with another owner counts for both)."""
        return self._working_of.get(owner, 0) + self.trie.pages_of.get(owner, 0)

    def owners(self) -> list[Any]:
        """Every owner holding at least one page."""
        return list({*self._working_of, *self.trie.pages_of})

    def _count_working(self, state: PageState, n: int) -> None:
        """``n`` working pages joined (or, negative, left) ``state``: keep its owner's count."""
        if state.owner is None or n == 0:
            return
        left = self._working_of.get(state.owner, 0) + n
        if left:
            self._working_of[state.owner] = left
        else:
            del self._working_of[state.owner]

    def _ctx(self, cid: ContextId) -> PageState:
        try:
            state = self._contexts.get(cid)
        except TypeError:  # unhashable: certainly not an id we issued
            raise InvalidArgument(f"context id must be an int, got {cid!r}") from None
        if state is None:
            raise ContextClosed(
                f"context {cid!r} is unknown or released; create, fork or open a new one"
            )
        return state

    def _register(self, state: PageState) -> ContextId:
        cid = ContextId(self._next_id)
        self._next_id += 1
        self._contexts[cid] = state
        return cid

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
        return self._register(PageState(owner=owner, adapter=adapter))

    def adapter_of(self, cid: ContextId) -> int:
        """The adapter key of a context (0: none).

        Raises:
            ContextClosed: unknown context.
        """
        return self._ctx(cid).adapter

    def _fork_state(self, state: PageState, owner: Any) -> PageState:
        """Copy of ``state`` owned by ``owner``, sharing its chain (one reference), with
        fresh working pages.

        Raises:
            OutOfPages: the working copies cannot be allocated even after eviction.
        """
        n = len(state.working)
        new_pages = self._allocate(n)
        if new_pages is None:
            raise OutOfPages(
                f"fork needs {n} free pages to copy the working pages but only "
                f"{self.num_pages_available()} are available; commit or release working "
                "pages first, or release other contexts"
            )
        child = state.share_bookkeeping()
        child.working = new_pages
        child.owner = owner
        self._count_working(child, n)
        if child.tip is not None:
            self.trie.add_holder(child.tip, owner)
        num_used = -(-len(state.tokens) // self.page_size)
        self.pool.copy_pages(new_pages[:num_used], state.working[:num_used])
        return child

    def _release_state(self, state: PageState) -> None:
        if state.tip is not None:
            self.trie.drop_holder(state.tip, state.owner)
            state.tip = None
        self._count_working(state, -len(state.working))
        self.pool.free(state.working)
        state.working = []
        state.tokens.clear()
        state.positions.clear()
        state.extras.clear()
        state.committed_ids = []
        state.ids_shared = False

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
        state = self._ctx(cid)
        return self._register(self._fork_state(state, state.owner))

    def release(self, cid: ContextId) -> None:
        """Drop every reference and free every working page of ``cid``; the id dies.

        Raises:
            ContextClosed: ``cid`` is unknown or already released.
        """
        state = self._ctx(cid)
        del self._contexts[cid]
        self._release_state(state)

    # -- working pages -----------------------------------------------------------------

    def reserve_working_pages(self, cid: ContextId, n: int) -> bool:
        """Append ``n`` empty working pages, evicting cached pages if needed.

        Args:
            cid: the context.
            n: pages to reserve (>= 0).

        Returns:
            True on success; False (nothing changed, nothing evicted) when fewer than ``n``
            pages are free + cached.

        Raises:
            ContextClosed: unknown context. InvalidArgument: ``n`` is not an int >= 0.
        """
        state = self._ctx(cid)
        n = count(n, "reserve_working_pages: n")
        pages = self._allocate(n)
        if pages is None:
            return False
        state.working.extend(pages)
        self._count_working(state, n)
        return True

    def release_working_pages(self, cid: ContextId, n: int) -> None:
        """Give the last ``n`` working pages back to the pool.

        Tokens written into those pages are dropped with them.

        Raises:
            ContextClosed: unknown context.
            InvalidArgument: ``n`` is negative or exceeds the working page count.
        """
        state = self._ctx(cid)
        n = count(n, "release_working_pages: n")
        if n > len(state.working):
            raise InvalidArgument(
                f"release_working_pages: asked for {n} pages but the context has "
                f"{len(state.working)} working pages"
            )
        if n == 0:
            return
        keep = len(state.working) - n
        capacity = keep * self.page_size
        if len(state.tokens) > capacity:
            del state.tokens[capacity:], state.positions[capacity:], state.extras[capacity:]
        released = state.working[keep:]
        del state.working[keep:]
        self._count_working(state, -n)
        self.pool.free(released)

    def truncate_working_page_tokens(self, cid: ContextId, n: int) -> None:
        """Drop the last ``n`` tokens written into working pages (page count unchanged).

        Raises:
            ContextClosed: unknown context.
            InvalidArgument: ``n`` exceeds the working tokens (committed pages are immutable).
        """
        state = self._ctx(cid)
        n = count(n, "truncate_working_page_tokens: n")
        if n > len(state.tokens):
            raise InvalidArgument(
                f"truncate: asked to drop {n} tokens but only {len(state.tokens)} are in "
                "working pages; committed pages cannot be truncated"
            )
        if n:
            del state.tokens[-n:], state.positions[-n:], state.extras[-n:]

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
        state = self._ctx(cid)
        toks, poss, extras = page_inputs(tokens, positions, extra)
        extras = adapter_extras(extras, state.adapter)
        start = len(state.tokens)
        room = len(state.working) * self.page_size - start
        if len(toks) > room:
            raise InvalidArgument(
                f"write_tokens: {len(toks)} tokens but only {room} reserved slots; "
                "reserve_working_pages first"
            )
        state.tokens.extend(toks)
        state.positions.extend(poss)
        state.extras.extend(extras)
        ps, working = self.page_size, state.working
        return [(working[i // ps], i % ps) for i in range(start, start + len(toks))]

    def commit_working_pages(self, cid: ContextId, k: int) -> None:
        """Commit the first ``k`` working pages (all must be full), deduplicating each.

        A page identical to an existing committed page (same chain, tokens, positions,
        extras) is shared and the working copy goes back to the pool.

        Raises:
            ContextClosed: unknown context.
            InvalidArgument: ``k`` exceeds the working pages or one of them is not full
                (nothing is committed then).
        """
        state = self._ctx(cid)
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
        self._commit(state, k)

    def _commit(self, state: PageState, k: int) -> None:
        if k == 0:
            return
        ps = self.page_size
        tip, new_ids, duplicates = self.trie.advance_pages(
            state.tip, state.working[:k], state.tokens, state.positions, state.extras, ps,
            state.owner,
        )
        self._count_working(state, -k)  # committed now: counted through the trie
        state.tip = tip
        state.extend_committed_ids(new_ids)
        del state.working[:k], state.tokens[: k * ps], state.positions[: k * ps]
        del state.extras[: k * ps]
        self.pool.free(duplicates)
        self._num_commits += k
        self._num_dedup_hits += len(duplicates)

    def commit_full_pages(self, cid: ContextId) -> int:
        """Commit every full working page.

        Returns:
            The number of pages committed.

        Raises:
            ContextClosed: unknown context.
        """
        state = self._ctx(cid)
        k = len(state.tokens) // self.page_size
        self._commit(state, k)
        return k

    # -- prefix reuse ------------------------------------------------------------------

    def match_prefix(
        self, cid: ContextId, tokens: Sequence[int], positions: Sequence[int], extra: Extra = 0
    ) -> int:
        """How many leading full pages of these tokens ``attach_prefix`` would attach.

        Read-only: touches neither counts nor LRU order. Errors as ``attach_prefix``.
        """
        state = self._ctx(cid)
        toks, poss, extras = page_inputs(tokens, positions, extra)
        extras = adapter_extras(extras, state.adapter)
        if state.tokens:
            raise InvalidArgument("match_prefix: the context has working tokens; commit them first")
        return len(self.trie.match_pages(state.tip, toks, poss, extras, self.page_size))

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
        state = self._ctx(cid)
        toks, poss, extras = page_inputs(tokens, positions, extra)
        extras = adapter_extras(extras, state.adapter)
        if state.tokens:
            raise InvalidArgument(
                "attach_prefix: the context has working tokens; commit or truncate them first"
            )
        hits = self.trie.match_pages(state.tip, toks, poss, extras, self.page_size)
        if hits:
            self.trie.add_holder(hits[-1], state.owner)
            if state.tip is not None:
                self.trie.drop_holder(state.tip, state.owner)
            state.tip = hits[-1]
            state.extend_committed_ids([node.page_id for node in hits])
        num = len(hits)
        if self.tier is not None:
            num += self._attach_from_disk(state, toks, poss, extras, num)
        self._num_prefix_hits += num
        return num

    def _attach_from_disk(self, state: PageState, toks: list[int], poss: list[int],
                          extras: list[int], start: int) -> int:
        """Continue ``state``'s chain with full pages from ``start`` on that the disk tier
        holds: each is read, verified, copied into a new page and committed. Stops at the
        first page not on disk (or when the pool has no room). Returns the pages attached."""
        ps, tier = self.page_size, self._disk
        num = 0
        for i in range(start, len(toks) // ps):
            lo, hi = i * ps, (i + 1) * ps
            record = tier.find(parent_hash(state.tip, self.trie.root_hash),
                               toks[lo:hi], poss[lo:hi], extras[lo:hi])
            if record is None:
                break
            pages = self._allocate(1)  # state's chain is held: never evicted for this
            if pages is None:
                break
            tier.install(pages[0], record.payload)
            self._commit_page(state, pages[0], record.tokens, record.positions, record.extras)
            num += 1
        return num

    def _commit_page(self, state: PageState, page_id: PageId, tokens: tuple[int, ...],
                     positions: tuple[int, ...], extras: tuple[int, ...]) -> None:
        """Append one full page (its KV already in ``page_id``) to ``state``'s chain."""
        tip, deduped = self.trie.advance(state.tip, page_id, tokens, positions, extras,
                                         state.owner)
        if deduped:
            self.pool.free([page_id])
        state.tip = tip
        state.extend_committed_ids([tip.page_id])

    # -- queries -----------------------------------------------------------------------

    def page_table(self, cid: ContextId) -> list[PageId]:
        """Every page of the context in KV order: committed (root..tip), then working.

        Raises:
            ContextClosed: unknown context.
        """
        state = self._ctx(cid)
        return state.committed_page_ids() + state.working

    def state(self, cid: ContextId) -> ContextState:
        """The context's page counters (the same record the SDK receives).

        ``seq_len == num_committed_pages * page_size + num_working_tokens``.

        Raises:
            ContextClosed: unknown context.
        """
        s = self._ctx(cid)
        num_committed = s.num_committed_pages
        return ContextState(
            seq_len=num_committed * self.page_size + len(s.tokens),
            page_size=self.page_size,
            num_committed_pages=num_committed,
            num_working_pages=len(s.working),
            num_working_tokens=len(s.tokens),
            next_position=self._next_position(s),
        )

    def tokens(self, cid: ContextId) -> list[int]:
        """All token ids of the context, committed then working. O(seq_len).

        Raises:
            ContextClosed: unknown context.
        """
        state = self._ctx(cid)
        out: list[int] = []
        for node in chain_nodes(state.tip):
            out.extend(node.tokens)
        out.extend(state.tokens)
        return out

    def working_tokens(self, cid: ContextId) -> list[int]:
        """Token ids written into working pages (a copy).

        Raises:
            ContextClosed: unknown context.
        """
        return self._ctx(cid).tokens.copy()

    def next_position(self, cid: ContextId) -> int:
        """Position after the last written token (equals ``seq_len`` with default positions).

        Raises:
            ContextClosed: unknown context.
        """
        return self._next_position(self._ctx(cid))

    @staticmethod
    def _next_position(state: PageState) -> int:
        if state.positions:
            return state.positions[-1] + 1
        if state.tip is not None:
            return state.tip.positions[-1] + 1
        return 0

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
        state = self._ctx(cid)
        key = self.snapshots.check_free(name, namespace)
        snap = Snapshot(self._fork_state(state, None), meta, last_logits)
        if self.tier is None:
            self.snapshots.put(key, snap)
            return None
        job = plan_save(key, snap, self.tier, self.trie.root_hash, self.tier.files.fingerprint.key)
        self.tier.add_refs(job.known)  # no delete may remove them while the job writes
        self.tier.begin_writes(job.new_hashes)  # nor the files it writes before end_save
        self.snapshots.reserve(key, job)
        return job

    def end_save(self, job: SaveJob) -> None:
        """Finish a save: list the snapshot, or undo everything if its write failed.

        Raises:
            StorageError: the write failed; no trace of the snapshot is left.
        """
        tier = self._disk
        self.snapshots.unreserve(job.key)
        if job.error is not None:
            tier.end_writes(job.new_hashes)  # deletes what it wrote that nothing else uses
            tier.drop_refs(job.known)
            self._release_state(job.snap.pages)
            raise job.error
        tier.adopt_written(job.written)
        tier.end_writes(job.new_hashes)
        tier.add_refs(job.written)
        job.snap.head = job.head
        self.snapshots.put(job.key, job.snap)

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
        ``job.read()`` anywhere, then ``restore_snapshot(name, namespace, job)``.

        Raises: as ``snapshot``.
        """
        snap = self.snapshots.get(name, namespace)
        if snap.state is not None:
            return None
        return plan_restore(snapshot_key(name, namespace), snap.head, self._disk,
                            self.trie.by_hash)

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
        key = snapshot_key(name, namespace)
        snap = self.snapshots.get(name, namespace)
        if snap.state is not None:
            self.snapshots.touch(key, snap)
            return snap.state.num_committed_pages + len(snap.state.working), 0
        if job is None or job.head is not snap.head:
            job = plan_restore(key, snap.head, self._disk, self.trie.by_hash)
            job.read()
        if job.error is not None:
            if job.damaged is not None:
                self._disk.drop_damaged(job.damaged)
            raise job.error
        state, from_memory = self._install(job)
        snap.state = state
        snap.last_logits = np.frombuffer(job.logits, dtype="<f4") if job.logits else None
        self.snapshots.touch(key, snap)
        return from_memory, state.num_committed_pages + len(state.working) - from_memory

    def _install(self, job: RestoreJob) -> tuple[PageState, int]:
        """Rebuild a spilled snapshot's state from ``job``; returns it and the number of
        pages found in the pool. On any error every page taken goes back."""
        head, ps, tier = job.head, self.page_size, self._disk
        state = PageState(adapter=head.adapter)
        from_memory = 0
        try:
            for i, h in enumerate(head.pages):
                lo, hi = i * ps, (i + 1) * ps
                toks = tuple(head.tokens[lo:hi])
                poss, extras = tuple(head.positions[lo:hi]), tuple(head.extras[lo:hi])
                node = self.trie.lookup(state.tip, toks, poss, extras)
                if node is not None:
                    self.trie.add_holder(node)
                    if state.tip is not None:
                        self.trie.drop_holder(state.tip)
                    state.tip = node
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
                page = self._allocate_or_raise(1, f"reopen snapshot {job.key[1]!r}")
                tier.install(page[0], record.payload)
                self._commit_page(state, page[0], toks, poss, extras)
            state.committed_ids = None  # recomputed from the tip on first use
            tail = self._allocate_or_raise(head.tail_pages, f"reopen snapshot {job.key[1]!r}")
            state.working = tail
            for j, page_id in enumerate(tail):
                tier.install(page_id, job.tail[j * tier.page_bytes:(j + 1) * tier.page_bytes])
            state.tokens = list(head.tail_tokens)
            state.positions = list(head.tail_positions)
            state.extras = list(head.tail_extras)
        except BaseException:
            self._release_state(state)
            raise
        return state, from_memory

    def _allocate_or_raise(self, n: int, what: str) -> list[PageId]:
        pages = self._allocate(n)
        if pages is None:
            raise OutOfPages(f"{what}: it needs {n} more pages but only "
                             f"{self.num_pages_available()} can be freed; release contexts "
                             "or delete snapshots")
        return pages

    def open_snapshot(self, name: str, namespace: str = DEFAULT_NAMESPACE,
                      owner: Any = None) -> ContextId:
        """A new context (of ``owner``) forked from the snapshot; the snapshot is unchanged.
        A spilled snapshot is restored first (``restore_snapshot``).

        Raises:
            SnapshotNotFound: no such name. InvalidArgument: bad name.
            OutOfPages: working copies do not fit. SnapshotCorrupt: as ``restore_snapshot``.
        """
        key = snapshot_key(name, namespace)
        self.restore_snapshot(name, namespace)
        snap = self.snapshots.get(name, namespace)
        self.snapshots.resident.pop(key, None)  # never spilled while it is forked from
        try:
            return self._register(self._fork_state(snap.pages, owner))
        finally:
            self.snapshots.touch(key, snap)

    def take_snapshot(self, name: str, namespace: str = DEFAULT_NAMESPACE,
                      owner: Any = None) -> ContextId:
        """Open the snapshot (for ``owner``) and delete it, moving its pages to the new
        context in O(1).

        Raises:
            SnapshotNotFound: no such name. InvalidArgument: bad name.
            SnapshotCorrupt, OutOfPages: as ``restore_snapshot``.
            StorageError: its manifest could not be deleted (nothing changed).
        """
        self.restore_snapshot(name, namespace)
        state = self._forget(name, namespace).pages
        if owner is not None:  # snapshots count against nobody: the new owner takes them on
            if state.tip is not None:
                self.trie.add_holder(state.tip, owner)
                self.trie.drop_holder(state.tip)
            state.owner = owner
            self._count_working(state, len(state.working))
        return self._register(state)

    def delete_snapshot(self, name: str, namespace: str = DEFAULT_NAMESPACE) -> None:
        """Delete the snapshot, dropping its references and working pages, and its files
        that no other snapshot uses.

        Raises:
            SnapshotNotFound: no such name. InvalidArgument: bad name.
            StorageError: its manifest could not be deleted (nothing changed).
        """
        snap = self._forget(name, namespace)
        if snap.state is not None:
            self._release_state(snap.state)

    def _forget(self, name: str, namespace: str) -> Snapshot:
        """Unlist a snapshot: its manifest first (durably), then its entry and file
        references. Its page state, if any, is the caller's."""
        snap = self.snapshots.get(name, namespace)
        if snap.head is not None:
            self._disk.files.remove(self._disk.files.manifest_path(namespace, name))
        self.snapshots.pop(name, namespace)
        if snap.head is not None:
            self._disk.drop_refs(snap.head.pages)
        return snap

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
        return StoreStats(
            num_pages_total=self.pool.num_pages,
            num_pages_free=num_free,
            num_pages_working=self.pool.num_pages - num_free - trie.num_nodes,
            num_pages_committed=trie.num_pinned,
            num_pages_cached=trie.num_cached,
            num_contexts=len(self._contexts),
            num_snapshots=len(self.snapshots),
            num_commits=self._num_commits,
            num_dedup_hits=self._num_dedup_hits,
            num_prefix_hits=self._num_prefix_hits,
            num_evictions=trie.num_evictions,
            num_snapshots_resident=sum(1 for _, snap in self.snapshots if snap.state is not None),
            **self._disk_stats(),
        )

    def _disk_stats(self) -> dict[str, int]:
        tier = self.tier
        if tier is None:
            return {}
        c = tier.counters
        return {"num_disk_pages": tier.num_pages, "num_disk_bytes": tier.num_bytes,
                "disk_pages_written": c.pages_written, "disk_bytes_written": c.bytes_written,
                "disk_pages_loaded": c.pages_loaded, "disk_bytes_loaded": c.bytes_loaded,
                "num_snapshots_spilled": c.snapshots_spilled}

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
        return iter(list(self._contexts.items()))

    @property
    def next_context_id(self) -> int:
        """The id the next context will get (ids are never reused)."""
        return self._next_id

    def check_invariants(self) -> None:
        """Recompute every count from scratch and compare (``runtime.kv.invariants``).

        Raises:
            RuntimeError: an invariant is broken (a bug in the store).
        """
        check_invariants(self)
