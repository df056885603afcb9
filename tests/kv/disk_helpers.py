"""Helpers of the disk-tier tests: stores on a snapshot directory, KV bytes that say which
token they belong to, and a FileOps that fails on cue."""

from __future__ import annotations

import dataclasses
import errno
import os
from pathlib import Path
from typing import Any

import torch

from runtime.kv import ContextId, PageStore
from runtime.kv.context import chain_nodes
from runtime.kv.disk import FileOps, PageFiles
from runtime.kv.file_format import Fingerprint

from .helpers import reserve_for

FINGERPRINT = Fingerprint(model="tiny", weights_digest="0" * 32, weights="fp32",
                          dtype="float32", kv_dtype="fp32", page_size=4, num_layers=2,
                          num_kv_heads=1, head_dim=2)


def fingerprint(page_size: int = 4, **kw: Any) -> Fingerprint:
    """The tests' fingerprint, with some fields changed."""
    return dataclasses.replace(FINGERPRINT, page_size=page_size, **kw)


def disk_store(root: Path, num_pages: int = 16, page_size: int = 4, *, ops: FileOps | None = None,
               cache_pages: int = 64, shared: bool = False, **fp: Any) -> PageStore:
    """A tiny store (2 layers, 1 KV head, head_dim 2) on the snapshot directory ``root``
    (``shared``: beside other engines, as in a fleet)."""
    files = PageFiles(root, fingerprint(page_size, **fp), ops, shared=shared)
    return PageStore(num_pages, page_size, num_layers=2, num_kv_heads=1, head_dim=2,
                     files=files, max_disk_cache_pages=cache_pages)


def close(store: PageStore) -> None:
    """What a restart does to the store's folder: the lock goes (the files stay)."""
    store.close()


def kv_of(token: int, position: int) -> torch.Tensor:
    """The K/V a token at a position gets in these tests: [layers, 2, heads, dim]."""
    base = float(token * 1000 + position)
    return torch.arange(4, dtype=torch.float32).view(2, 2, 1, 1).expand(2, 2, 1, 2) + base


def try_write(store: PageStore, cid: ContextId, tokens: list[int]) -> bool:
    """Reserve, write ``tokens`` at the next positions with their K/V, commit full pages;
    False, with nothing changed, when the pool has no room for them."""
    if not reserve_for(store, cid, len(tokens)):
        return False
    start = store.next_position(cid)
    positions = list(range(start, start + len(tokens)))
    slots = store.write_tokens(cid, tokens, positions)
    for (page, slot), tok, pos in zip(slots, tokens, positions, strict=True):
        store.pool.kv[page, slot] = kv_of(tok, pos)
    store.commit_full_pages(cid)
    return True


def write(store: PageStore, cid: ContextId, tokens: list[int]) -> None:
    """``try_write``, which must find room."""
    assert try_write(store, cid, tokens)


def check_kv(store: PageStore, cid: ContextId) -> None:
    """Every token of the context has its own K/V in the page that holds it."""
    state = dict(store.context_states())[cid]
    ps = store.page_size
    for node in chain_nodes(state.tip):
        for slot, (tok, pos) in enumerate(zip(node.tokens, node.positions, strict=True)):
            assert torch.equal(store.pool.kv[node.page_id, slot], kv_of(tok, pos)), (tok, pos)
    for i, (tok, pos) in enumerate(zip(state.tokens, state.positions, strict=True)):
        assert torch.equal(store.pool.kv[state.working[i // ps], i % ps], kv_of(tok, pos))


class FailingOps(FileOps):
    """Real system calls, except that ``fail_after`` successful writes later every write
    fails with ``error`` (ENOSPC by default), until ``heal()``."""

    def __init__(self) -> None:
        self.left: int | None = None
        self.error = errno.ENOSPC
        self.writes = 0

    def fail_after(self, n: int, error: int = errno.ENOSPC) -> None:
        self.left, self.error = n, error

    def heal(self) -> None:
        self.left = None

    def write(self, fd: int, data: memoryview) -> int:
        if self.left is not None:
            if self.left <= 0:
                raise OSError(self.error, os.strerror(self.error))
            self.left -= 1
        self.writes += 1
        # short writes, as a real disk may do: the writer must loop
        return os.write(fd, data[: max(1, len(data) // 2)] if len(data) > 64 else data)
