"""Context records: the public context handles and who owns each.

Owns: the table ``handle -> ContextRecord``. A handle is what clients name a context by;
its record says which store context it is *now* (a finished job swaps its shadow in), who
owns it, the lock that runs its requests one at a time, and the logits of its last token.
The table releases a record's store context when the record is released, when its owner
goes away, or when the SDK object behind it was garbage collected.

It also suspends and resumes them (docs/pages.md, "Suspend and resume"): a suspended
record has no store context, only the ``Suspended`` record that brings its pages back;
``get`` resumes it, so every request finds its context in the pool. ``idle`` lists the
records the engine may suspend when it needs room: not busy, not pinned by a request
being dispatched, holding pages; the furthest from its expected return first, then the
least recently used.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio
import msgspec

from pie_ctx.proto import messages as P
from pie_ctx.proto.errors import ContextClosed

if TYPE_CHECKING:
    from runtime.kv.store import PageStore
    from runtime.kv.suspend import Suspended

__all__ = ["ContextRecord", "ContextTable"]


@dataclass(slots=True, eq=False)
class ContextRecord:
    """A public context handle: which store context it is now, who owns it, its lock."""

    handle: int
    cid: Any  # store ContextId; replaced when a job's shadow is swapped in
    owner: Any
    # A semaphore, not a lock: a generation takes it in the caller's task and the engine
    # loop gives it back when the job ends.
    lock: anyio.Semaphore = field(default_factory=lambda: anyio.Semaphore(1))
    # float32 [vocab] logits of the last token written, so generate() can start right
    # after a flush; None when unknown (generate then recomputes them).
    last_logits: Any = None
    priority: int = 0  # higher: admitted first, preempted and suspended last
    suspended: Suspended | None = None  # its pages out of the pool (cid is None then)
    back_at: float | None = None  # when its program expects to use it again (clock time)
    last_used: float = 0.0  # when a request last named it (clock time)
    pins: int = 0  # requests being dispatched to it: never suspended under them
    # pages its last resume brought back, for the report of its next pass
    resumed: P.PassReport | None = None

    @property
    def is_busy(self) -> bool:
        """True while a request holds the context."""
        return self.lock.value == 0

    def take_resumed(self, report: P.PassReport) -> P.PassReport:
        """``report`` with the pages of the resume before it (once)."""
        resumed, self.resumed = self.resumed, None
        if resumed is None:
            return report
        return msgspec.structs.replace(
            report, pages_resumed=report.pages_resumed + resumed.pages_resumed,
            pages_resumed_from_disk=report.pages_resumed_from_disk
            + resumed.pages_resumed_from_disk)


@dataclass(slots=True)
class SuspendCounters:
    """What suspending and resuming have done since boot (``EngineStats``)."""

    suspends: int = 0  # contexts suspended, on request or under pressure
    auto_suspends: int = 0  # of them, chosen by the engine to make room
    resumes: int = 0
    pages_suspended: int = 0  # pages the suspended contexts held in the pool
    pages_resumed_from_memory: int = 0  # still in the pool, or copied from host memory
    pages_resumed_from_disk: int = 0


class ContextTable:
    """Every live context handle of one engine.

    Args:
        store: the page store (records own one store context each).
        on_release: called after a release returned pages (the engine wakes its loop, since
            a job waiting for pages may run now).
        clock: seconds, monotonic (``back_at``, ``last_used``).
    """

    def __init__(self, store: PageStore, on_release: Callable[[], None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._store = store
        self._on_release = on_release
        self._clock = clock
        self._records: dict[int, ContextRecord] = {}
        self._next_handle = 1
        self._gc_queue: deque[int] = deque()  # handles whose SDK object was collected
        self.counters = SuspendCounters()

    def __len__(self) -> int:
        return len(self._records)

    def __iter__(self) -> Iterator[ContextRecord]:
        """Every live record (a copy of the table, safe to change under)."""
        return iter(list(self._records.values()))

    def get(self, handle: Any, owner: Any, *, resume: bool = True) -> ContextRecord:
        """The record of ``handle`` if ``owner`` owns it, resumed if it was suspended
        (unless ``resume`` is False).

        Raises:
            ContextClosed: no such handle, or another owner's.
        """
        record = self.find(handle, owner)
        if record is None:
            raise ContextClosed(
                f"context {handle!r} is unknown or released; create, fork or open a new one")
        record.last_used = self._clock()
        if resume and record.suspended is not None:
            self.resume(record)
        return record

    @asynccontextmanager
    async def locked(self, handle: Any, owner: Any) -> AsyncIterator[ContextRecord]:
        """``get``, then hold the record's lock: the context is in the pool (resumed if it
        was suspended while this request waited for the lock) until the block ends."""
        record = self.get(handle, owner)
        async with record.lock:
            await self.acquired(record)
            yield record

    async def acquired(self, record: ContextRecord) -> None:
        """Call with ``record``'s lock just taken: resume it if a suspend ran while the
        caller waited for the lock (``OutOfPages``: no room for it now)."""
        if record.suspended is not None:
            self.resume(record)

    def find(self, handle: Any, owner: Any) -> ContextRecord | None:
        """The record of ``handle`` if ``owner`` owns it, as it is (suspended or not)."""
        record = self._records.get(handle) if isinstance(handle, int) else None
        return None if record is None or record.owner != owner else record

    def now(self) -> float:
        """The table's clock (``back_at`` and ``last_used`` are on it)."""
        return self._clock()

    @contextmanager
    def pinned(self, handle: Any, owner: Any) -> Iterator[ContextRecord | None]:
        """While a request is dispatched to ``handle``: its record is never suspended to
        make room (between its resume and its lock)."""
        record = self.find(handle, owner)
        if record is None:
            yield None
            return
        record.pins += 1
        try:
            yield record
        finally:
            record.pins -= 1

    # -------------------------------------------------------------- suspend and resume

    def suspend(self, record: ContextRecord, *, auto: bool = False) -> int:
        """Take a record's pages out of the pool; returns how many it held. Nothing may be
        using its store context: it is not busy, or busy only with a job still waiting
        for admission (which resumes it). A suspended record stays as it is."""
        if record.suspended is not None:
            return 0
        record.suspended = self._store.suspend(record.cid, record.priority)
        record.cid = None
        c = self.counters
        c.suspends += 1
        c.auto_suspends += auto
        c.pages_suspended += record.suspended.num_pages
        return record.suspended.num_pages

    def resume(self, record: ContextRecord) -> P.PassReport:
        """Bring a suspended record's pages back (nothing computed); the report says from
        where, and is added to its next pass's.

        Raises:
            OutOfPages: no room for them now. SnapshotCorrupt: the disk tier lost one.
                It stays suspended on either.
        """
        assert record.suspended is not None
        record.cid, from_memory, from_disk = self._store.resume(record.suspended)
        record.suspended = None
        record.back_at = None
        c = self.counters
        c.resumes += 1
        c.pages_resumed_from_memory += from_memory
        c.pages_resumed_from_disk += from_disk
        report = P.PassReport(pages_resumed=from_memory + from_disk,
                              pages_resumed_from_disk=from_disk)
        record.resumed = record.take_resumed(report)
        return report

    def idle(self) -> list[ContextRecord]:
        """The records the engine may suspend for room, the first to go first: the lowest
        priority, then those whose program expects them back furthest off (an estimate
        that has passed no longer counts), then the least recently used."""
        now = self._clock()

        def order(r: ContextRecord) -> tuple[int, float, float]:
            back = r.back_at if r.back_at is not None and r.back_at > now else None
            return (r.priority, math.inf if back is None else -back, r.last_used)
        candidates = [r for r in self._records.values()
                      if not r.is_busy and not r.pins and self.holds_pages(r)]
        return sorted(candidates, key=order)

    def holds_pages(self, record: ContextRecord) -> bool:
        """Whether a record's context is in the pool with pages (not suspended, not
        empty): what suspending it could free."""
        if record.suspended is not None:
            return False
        state = self._store.state(record.cid)
        return state.seq_len > 0 or state.num_working_pages > 0

    @property
    def num_suspended(self) -> int:
        """Records suspended now."""
        return sum(r.suspended is not None for r in self._records.values())

    def add(self, cid: Any, owner: Any, last_logits: Any = None) -> ContextRecord:
        """A new handle for store context ``cid``."""
        record = ContextRecord(self._next_handle, cid, owner, last_logits=last_logits)
        self._next_handle += 1
        self._records[record.handle] = record
        return record

    def owned_by(self, owner: Any) -> list[ContextRecord]:
        """Every record of one owner."""
        return [r for r in self._records.values() if r.owner == owner]

    def release(self, record: ContextRecord) -> None:
        """Release a record's store context now (it must not be busy)."""
        if self._records.get(record.handle) is not record:
            return  # already released
        del self._records[record.handle]
        if record.suspended is not None:
            self._store.drop_suspended(record.suspended)
            record.suspended = None
        else:
            self._store.release(record.cid)
        self._on_release()

    def release_soon(self, handle: int) -> None:
        """Release a handle from any thread (used when an SDK object is garbage collected)."""
        self._gc_queue.append(handle)

    def collect_garbage(self) -> None:
        """Release collected handles; a busy one waits for its running request to end."""
        busy: list[int] = []
        while self._gc_queue:
            handle = self._gc_queue.popleft()
            record = self._records.get(handle)
            if record is None:
                continue
            if record.is_busy:
                busy.append(handle)
            else:
                self.release(record)
        self._gc_queue.extend(busy)

    def release_owner(self, owner: Any) -> int:
        """Release every context of one owner (a disconnected client, an exited inferlet).

        A context with a request still running is released as soon as it ends.

        Returns:
            How many contexts the owner had.
        """
        records = self.owned_by(owner)
        for record in records:
            if record.is_busy:
                self.release_soon(record.handle)
            else:
                self.release(record)
        return len(records)
