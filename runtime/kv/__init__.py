"""runtime.kv: the page store (pool, chained-hash trie, context states, snapshots).

Import ``PageStore`` and the id types from here; the submodules are internals with one
owner each (see their docstrings and docs/pages.md).
"""

from __future__ import annotations

from runtime.kv.hashing import fold_extras, hash_page
from runtime.kv.pool import PagePool, PoolShape
from runtime.kv.store import PageStore
from runtime.kv.types import ContextId, PageHash, PageId, StoreStats

__all__ = [
    "PageStore",
    "PagePool",
    "PoolShape",
    "hash_page",
    "fold_extras",
    "PageId",
    "PageHash",
    "ContextId",
    "StoreStats",
]
