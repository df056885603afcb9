"""Context records: the public context handles and who owns each.

Owns: the table ``handle -> ContextRecord``. A handle is what clients name a context by;
its record says which store context it is *now* (a finished job swaps its shadow in), who
owns it, the lock that runs its requests one at a time, and the logits of its last token.
The table releases a record's store context when the record is released, when its owner
goes away, or when the SDK object behind it was garbage collected.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio

from pie_ctx.proto.errors import ContextClosed

if TYPE_CHECKING:
    from runtime.kv.store import PageStore

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

    @property
    def is_busy(self) -> bool:
        """True while a request holds the context."""
        return self.lock.value == 0


class ContextTable:
    """Every live context handle of one engine.

    Args:
        store: the page store (records own one store context each).
        on_release: called after a release returned pages (the engine wakes its loop, since
            a job waiting for pages may run now).
    """

    def __init__(self, store: PageStore, on_release: Callable[[], None]) -> None:
        self._store = store
        self._on_release = on_release
        self._records: dict[int, ContextRecord] = {}
        self._next_handle = 1
        self._gc_queue: deque[int] = deque()  # handles whose SDK object was collected

    def __len__(self) -> int:
        return len(self._records)

    def get(self, handle: Any, owner: Any) -> ContextRecord:
        """The record of ``handle`` if ``owner`` owns it.

        Raises:
            ContextClosed: no such handle, or another owner's.
        """
        record = self._records.get(handle) if isinstance(handle, int) else None
        if record is None or record.owner != owner:
            raise ContextClosed(
                f"context {handle!r} is unknown or released; create, fork or open a new one")
        return record

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
