"""The page pool: the one tensor holding every page's K and V, and its free list.

Owns: the physical pages. Only the pool allocates and frees them; everything else (the
trie, context states) holds page ids that it must hand back here.

Layout (fixed; the model runner relies on it)::

    kv: Tensor[num_pages, page_size, num_layers, 2, num_kv_heads, head_dim]
                                                 ^ 0 = K, 1 = V

Page-major, so ``kv[page_ids]`` gathers every layer of those pages with one index and a
fork's copy of a working page is one ``kv[dst] = kv[src]``. Within a page, token-major:
one layer's K of a run of consecutive pages ``kv[a:b, :, layer, 0]`` is a single strided
view ``[(b - a) * page_size, KVH, D]`` (uniform token stride), so attention can read a
context whose pages are consecutive in place, without gathering them.

Page bytes: ``read_page`` / ``write_page`` move one whole page as bytes (the disk tier's
format). A tensor-parallel engine's pool (``runtime.distributed.pool``) holds only its
rank's KV heads and overrides them, and ``copy_pages``, so that they act on every rank.

Invariants: the free list holds distinct ids in ``[0, num_pages)``; an id is either on the
free list or owned by exactly one holder (checked by ``runtime.kv.invariants``). Allocation
is deterministic: a fresh pool hands out ``0, 1, 2, ...`` and freed pages are reused
last-freed-first, in the order they were given back.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from runtime.kv import hugepages
from runtime.kv.layout import KV_DTYPES, entry_width, storage_dtype
from runtime.kv.types import PageId

__all__ = ["PagePool", "PoolShape"]

_SERIAL_COPY = 16384  # elements; below torch's parallel grain (32768): runs on one thread


@dataclass(frozen=True)
class PoolShape:
    """The sizes of a page pool: what ``PagePool`` allocates and ``PageStore`` is built for.

    Args:
        num_pages: number of physical pages (>= 1).
        page_size: tokens per page (>= 1).
        num_layers: model layers stored in each page.
        num_kv_heads: key/value heads per layer (a tensor-parallel rank's share, for its pool).
        head_dim: size of one head.
        dtype: the compute dtype: K/V are written and read back in it.
        device: device of the KV tensor.
        kv_dtype: how entries are stored: ``"fp32"`` (unquantized, in ``dtype``) or
            ``"int8"`` (per-entry scales) or ``"bf16"`` (see ``runtime.kv.layout``).

    Raises:
        ValueError: a size is not a positive integer, or an unknown ``kv_dtype``.
    """

    num_pages: int
    page_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.float32
    device: str | torch.device = "cpu"
    kv_dtype: str = "fp32"

    def __post_init__(self) -> None:
        for name in ("num_pages", "page_size", "num_layers", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"PagePool: {name} must be a positive int, got {value!r}")
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"PagePool: kv_dtype must be one of {', '.join(KV_DTYPES)}, "
                             f"got {self.kv_dtype!r}")


class PagePool:
    """Fixed set of physical KV pages on one device with an O(1)-per-page free list.

    Usage::

        pool = PagePool(PoolShape(64, page_size=16, num_layers=2, num_kv_heads=1, head_dim=8))
        ids = pool.allocate(3)      # [0, 1, 2]
        pool.free(ids)

    Capabilities (class attributes a subclass may turn off; callers read them instead of
    guessing from the type):

    * ``copies_slots``: ``copy_slots`` moves single token slots of every layer (compaction
      needs it). False where page contents live on several devices that this pool cannot
      move slot by slot (``runtime.distributed.pool.ShardedPagePool``).
    """

    copies_slots: bool = True

    __slots__ = ("kv", "shape", "num_pages", "page_size", "dtype", "kv_dtype", "_free",
                 "_bytes")

    def __init__(self, shape: PoolShape) -> None:
        """Allocate the pool tensor (zero-filled, of ``shape``) and the free list."""
        self.shape = shape
        self.num_pages = shape.num_pages
        self.page_size = shape.page_size
        self.dtype = shape.dtype
        self.kv_dtype = shape.kv_dtype
        # [num_pages, page_size, num_layers, 2, num_kv_heads, width]; width = head_dim for
        # fp32 and bf16, head_dim + 4 (values, then the scale's bytes) for int8
        # huge pages where THP allows: a decode step streams a context's pages every step
        self.kv = hugepages.zeros(
            (shape.num_pages, shape.page_size, shape.num_layers, 2, shape.num_kv_heads,
             entry_width(shape.kv_dtype, shape.head_dim)),
            dtype=storage_dtype(shape.kv_dtype, shape.dtype),
            device=shape.device,
        )
        # A stack: the end of the list is handed out next.
        self._free: list[PageId] = [PageId(i) for i in range(shape.num_pages - 1, -1, -1)]
        self._bytes: np.ndarray | None = None  # [pages, page_bytes] uint8 view (CPU)

    @property
    def num_free(self) -> int:
        """Number of pages on the free list."""
        return len(self._free)

    def can_allocate(self, n: int) -> bool:
        """True when ``allocate(n)`` would succeed right now."""
        return n <= len(self._free)

    def allocate(self, n: int) -> list[PageId] | None:
        """Take ``n`` pages off the free list.

        Args:
            n: number of pages (>= 0).

        Returns:
            The page ids, or ``None`` (back-pressure) when fewer than ``n`` are free; in
            that case nothing changes.
        """
        free = self._free
        if n > len(free):
            return None
        if n == 1:  # the decode-step common case: skip the slice
            return [free.pop()]
        if n == 0:
            return []
        ids = free[-n:]
        del free[-n:]
        ids.reverse()
        return ids

    def copy_pages(self, dst: Sequence[PageId], src: Sequence[PageId]) -> None:
        """Copy whole pages (every layer): ``kv[dst[i]] = kv[src[i]]``.

        On CPU the copy goes in slices smaller than torch's parallel grain, so the calling
        thread (the event loop) never starts an OpenMP team: a second team beside the
        model thread's makes every model step ~25% slower on 2 cores (measured), for as
        long as the process lives.
        """
        kv = self.kv
        for d, s in zip(dst, src, strict=True):
            if kv.device.type != "cpu":
                kv[d].copy_(kv[s])
                continue
            to, frm = kv[d].view(-1), kv[s].view(-1)  # a page is contiguous
            for start in range(0, to.numel(), _SERIAL_COPY):
                to[start : start + _SERIAL_COPY].copy_(frm[start : start + _SERIAL_COPY])

    def copy_slots(self, dst: Sequence[tuple[PageId, int]],
                   src: Sequence[tuple[PageId, int]]) -> None:
        """Copy single token entries (every layer): ``kv[dst[i]] = kv[src[i]]`` as
        ``(page, slot)`` pairs, in one pass of runs (consecutive slots of one page to
        consecutive slots of one page are one slice copy). Sources and destinations must
        not overlap. Serial on CPU, as ``copy_pages``."""
        kv = self.kv
        i, n = 0, len(src)
        while i < n:
            (sp, ss), (dp, ds) = src[i], dst[i]
            j = i + 1
            while j < n and src[j] == (sp, ss + j - i) and dst[j] == (dp, ds + j - i):
                j += 1
            to, frm = kv[dp, ds:ds + j - i], kv[sp, ss:ss + j - i]  # [run, L, 2, KVH, W]
            if kv.device.type != "cpu":
                to.copy_(frm)
            else:
                to, frm = to.view(-1), frm.reshape(-1)  # a run of slots is contiguous
                for start in range(0, to.numel(), _SERIAL_COPY):
                    to[start : start + _SERIAL_COPY].copy_(frm[start : start + _SERIAL_COPY])
            i = j

    @property
    def page_bytes(self) -> int:
        """Bytes of one whole page, as ``read_page`` returns them."""
        return self.kv[0].numel() * self.kv.element_size()

    def read_page(self, page_id: PageId) -> memoryview:
        """One page's bytes (every layer, K and V, in the pool layout): a view on CPU, a
        copy elsewhere."""
        array = self._byte_array()
        if array is not None:
            return memoryview(array[page_id])
        return memoryview(self.kv[page_id].contiguous().view(torch.uint8).cpu().numpy())

    def write_page(self, page_id: PageId, payload: bytes | memoryview) -> None:
        """Overwrite one page with bytes ``read_page`` returned (here or in another engine
        with the same fingerprint)."""
        src = np.frombuffer(payload, dtype=np.uint8)
        array = self._byte_array()
        if array is not None:
            array[page_id] = src
            return
        dst = self.kv[page_id].view(-1).view(torch.uint8)
        dst.copy_(torch.from_numpy(src.copy()).to(dst.device))

    def _byte_array(self) -> np.ndarray | None:
        if self._bytes is None and self.kv.device.type == "cpu":
            # numpy reads and writes never start a torch thread team
            self._bytes = self.kv.view(torch.uint8).numpy().reshape(self.num_pages, -1)
        return self._bytes

    def free(self, page_ids: Sequence[PageId]) -> None:
        """Give pages back; they are handed out again in the order given.

        Args:
            page_ids: pages previously returned by ``allocate`` and not freed since.

        Raises:
            RuntimeError: more pages would be free than exist (a double free).
        """
        free = self._free
        num = len(page_ids)
        if len(free) + num > self.num_pages:
            raise RuntimeError("PagePool.free: more pages freed than allocated (double free)")
        if num == 1:
            free.append(page_ids[0])
        else:
            free.extend(reversed(page_ids))

    def free_ids(self) -> list[PageId]:
        """The free list in hand-out order (next allocated first); a copy, for tests."""
        return self._free[::-1]
