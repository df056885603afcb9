"""Rank 0's page pool when pages are sharded by KV head.

Owner: like ``runtime.kv.pool.PagePool`` (which it is), the physical pages and their free
list; its tensor holds rank 0's KV heads only: ``[num_pages, page_size, num_layers, 2,
num_kv_heads / N, width]``. Every rank's pool has the same page ids; only rank 0 keeps the
free list and the bookkeeping around it, the workers' pools are plain tensors.

What rank 0 does to page *contents* outside a step happens on every rank:

* ``copy_pages`` (a fork's working tail) copies here at once and queues the copy for the
  workers, who apply it before the next command (``runtime.distributed.group``);
* ``read_page`` / ``write_page`` (the disk tier, durable snapshots) gather the page's
  slices from every rank into the unsharded layout, or scatter them, so page files are
  the same bytes as a single-device engine's (same fingerprint, interchangeable).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from runtime.distributed.group import RankGroup
from runtime.kv.pool import PagePool, PoolShape
from runtime.kv.types import PageId

__all__ = ["ShardedPagePool", "apply_copies"]

_KV_HEADS = -2  # the KV-head dim of a page [page_size, num_layers, 2, KVH, width]


def apply_copies(kv: torch.Tensor, copies: Sequence[tuple[int, int]]) -> None:
    """A worker's share of forks: ``kv[dst] = kv[src]`` in order."""
    for dst, src in copies:
        kv[dst].copy_(kv[src])


class ShardedPagePool(PagePool):
    """A :class:`PagePool` over rank 0's KV heads whose page contents move on every rank.

    Args:
        group: the ranks (rank 0's side).
        tp: how many ranks share each page.
        shape: as ``PagePool``, with ``num_kv_heads`` the heads of ONE rank.
    """

    __slots__ = ("group", "tp")
    copies_slots = False  # copy_slots would act on rank 0 only: compaction is refused

    def __init__(self, group: RankGroup, tp: int, shape: PoolShape) -> None:
        super().__init__(shape)
        self.group = group
        self.tp = tp

    def copy_pages(self, dst: Sequence[PageId], src: Sequence[PageId]) -> None:
        super().copy_pages(dst, src)
        self.group.queue_copies(dst, src)

    @property
    def page_bytes(self) -> int:
        """Bytes of a whole page: every rank's heads."""
        return super().page_bytes * self.tp

    def read_page(self, page_id: PageId) -> memoryview:
        """The whole page (every rank's heads, in the unsharded layout), gathered."""
        with self.group.command("read", int(page_id)):
            local = self.kv[page_id].contiguous()  # [S, L, 2, KVH/N, W]
            parts = [torch.empty_like(local) for _ in range(self.tp)]
            self.group.gather(local, parts)
        whole = torch.cat(parts, dim=_KV_HEADS)  # [S, L, 2, KVH, W]
        return memoryview(whole.view(torch.uint8).cpu().numpy().reshape(-1))

    def write_page(self, page_id: PageId, payload: bytes | memoryview) -> None:
        """Scatter a whole page's bytes: each rank keeps its heads."""
        shape = list(self.kv.shape[1:])
        shape[_KV_HEADS] *= self.tp
        src = torch.from_numpy(np.frombuffer(payload, dtype=np.uint8).copy())
        whole = src.view(self.kv.dtype).view(shape).to(self.kv.device)
        parts = [p.contiguous() for p in whole.chunk(self.tp, dim=_KV_HEADS)]
        with self.group.command("write", int(page_id)):
            out = torch.empty_like(parts[0])
            self.group.scatter(out, parts)
            self.kv[page_id].copy_(out)
