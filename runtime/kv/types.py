"""Identifier types and plain-data records of the page store.

Owns nothing; it only names things. ``PageId``, ``PageHash`` and ``ContextId`` are
``NewType``s over ``int`` so a type checker stops a page id from being passed where a
context id is expected. ``StoreStats`` is what the store reports: a copy, never a live
view, so holding one cannot observe or cause mutation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NewType

__all__ = ["PageId", "PageHash", "ContextId", "StoreStats"]

PageId = NewType("PageId", int)
"""Index of a physical page in the pool tensor (row of ``pool.kv``)."""

PageHash = NewType("PageHash", int)
"""Chained page hash, an unsigned 64-bit integer (see ``runtime.kv.hashing``)."""

ContextId = NewType("ContextId", int)
"""Handle of one live context inside a ``PageStore``."""


@dataclass(slots=True, frozen=True)
class StoreStats:
    """Engine-wide page accounting and cache counters.

    ``num_pages_free + num_pages_working + num_pages_committed + num_pages_cached``
    always equals ``num_pages_total``. ``num_pages_committed`` counts committed pages on the
    chain of some live context or snapshot; ``num_pages_cached`` counts committed pages no
    holder needs (they stay findable until evicted).
    """

    num_pages_total: int
    num_pages_free: int
    num_pages_working: int
    num_pages_committed: int
    num_pages_cached: int
    num_contexts: int
    num_snapshots: int
    num_commits: int
    num_dedup_hits: int
    num_prefix_hits: int
    num_evictions: int
    num_snapshots_resident: int = 0  # snapshots whose pages are in the pool
    num_holds: int = 0  # live holds (``PageStore.retain``)
    num_pages_held: int = 0  # pages in the pool some live hold covers
    # priority -> held pages whose highest covering hold has it
    pages_held_by_priority: dict[int, int] = field(default_factory=dict)
    # the disk tier (all 0 without a snapshot directory)
    num_disk_pages: int = 0  # page files on disk
    num_disk_bytes: int = 0
    disk_pages_written: int = 0
    disk_bytes_written: int = 0
    disk_pages_loaded: int = 0  # disk hits: pages read back into the pool
    disk_bytes_loaded: int = 0
    num_snapshots_spilled: int = 0  # times a snapshot was dropped from the pool for room
