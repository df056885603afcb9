"""Zero-filled CPU tensors backed by transparent huge pages (2 MiB) where the kernel allows.

Owns: the allocation of the big buffers that a decode step streams end to end (the KV
pool here; the gguf weights' strips, ``runtime.model.gguf_weights.strips_on_huge_pages``).
With THP in ``madvise`` mode (the common default) an ordinary allocation gets 4 KiB
pages, and streaming ~100 MB a step through them costs TLB misses. This maps anonymous
memory, aligns the region to 2 MiB and calls ``madvise(MADV_HUGEPAGE)`` before the first
touch. Where THP is ``never``, the platform has no ``MADV_HUGEPAGE``, the tensor is not on
CPU or is small, it falls back silently to ``torch.zeros``.
"""

from __future__ import annotations

import math
import mmap

import torch

HUGE = 2 << 20  # bytes in one x86-64 transparent huge page
_MIN_BYTES = 4 * HUGE  # below this the TLB gain is nil: plain torch.zeros


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu"
          ) -> torch.Tensor:
    """A zero-filled contiguous tensor; on CPU and large, backed by huge pages if possible."""
    dev = torch.device(device)
    nbytes = math.prod(shape) * dtype.itemsize
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if dev.type != "cpu" or nbytes < _MIN_BYTES or advice is None:
        return torch.zeros(shape, dtype=dtype, device=dev)
    length = -(-nbytes // HUGE) * HUGE + HUGE  # room to start on a 2 MiB boundary
    try:
        region = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except (OSError, ValueError):
        return torch.zeros(shape, dtype=dtype, device=dev)
    raw = torch.frombuffer(region, dtype=torch.uint8)  # keeps ``region`` alive
    offset = (-raw.data_ptr()) % HUGE
    try:  # before any page is touched; refused (EINVAL) where THP is off: keep 4 KiB pages
        region.madvise(advice, offset, length - offset - ((length - offset) % HUGE))
    except OSError:
        pass
    # anonymous memory reads as zeros: no fill, so pages fault in on first real write
    return raw[offset : offset + nbytes].view(dtype).view(shape)
