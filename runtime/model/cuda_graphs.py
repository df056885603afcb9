"""CUDA graphs for decode steps: a decode batch replays one captured graph per bucket.

Owner: the model runner, when ``PIE_CTX_CUDA_GRAPHS=1`` and its attention backend is flex
on CUDA (flex's decode call reads fixed-shape block-mask tensors that a step refills in
place; the torch backend's shapes follow each step's context lengths, and flash-attn's
gather path allocates per call, so neither can replay). Off by default.

A step qualifies when every sequence decodes one token causally, with logits for it, on
the base model, and there are at most ``BUCKETS[-1]`` of them. Its rows are padded to the
next bucket (1, 2, 4, ... 64) by repeating row 0: the copies compute exactly row 0's
K/V and write them to row 0's own slot, so the pool ends as without them. Per bucket the
runner keeps static inputs (tokens, positions, write slots) and a ``StaticDecodes``
block mask; a step copies its values in, replays, and returns the first rows of the
static logits. The first step of a bucket warms up (compiles flex) and captures; graphs
share one memory pool.

``capture=False`` runs the very same static path without a graph (how CPU tests check
the padding and refilling against the plain forward).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from runtime.kv.layout import is_quantized
from runtime.model.attention.base import AttentionMetadata
from runtime.model.batch import SeqInput
from runtime.model.flatten import FlatBatch

__all__ = ["BUCKETS", "ENV", "DecodeGraphs", "wanted"]

ENV = "PIE_CTX_CUDA_GRAPHS"
BUCKETS = (1, 2, 4, 8, 16, 32, 64)


def wanted(device: torch.device, backend: Any) -> bool:
    """Whether a runner on ``device`` with ``backend`` should replay decode graphs."""
    from runtime.model.attention.flex_backend import FlexAttention

    on = os.environ.get(ENV, "0").strip().lower() in ("1", "true", "yes", "on")
    return on and device.type == "cuda" and isinstance(backend, FlexAttention)


@dataclass
class _Slot:
    """One bucket's static inputs, block mask, graph and output."""

    tokens: torch.Tensor  # [Bb] int64
    positions: torch.Tensor  # [Bb] int64
    write_pages: torch.Tensor  # [Bb] int64
    write_slots: torch.Tensor  # [Bb] int64
    static: Any  # StaticDecodes
    meta: AttentionMetadata
    run: Callable[[], torch.Tensor]
    graph: Any = None  # torch.cuda.CUDAGraph once captured
    out: torch.Tensor | None = None  # [Bb, vocab] the graph's logits


class DecodeGraphs:
    """Decode steps of one runner through static buffers (and CUDA graphs)."""

    def __init__(self, runner: Any, *, capture: bool | None = None) -> None:
        """Args:
            runner: the ``ModelRunner`` whose decode steps these are (its pool, backend,
                model; this module cannot import the runner, which imports it).
            capture: record and replay CUDA graphs; default: on CUDA.
        """
        self.runner = runner
        self.capture = runner.device.type == "cuda" if capture is None else capture
        self._slots: dict[int, _Slot] = {}
        self._pool: Any = None
        self.replays = 0  # steps served (tests and the benchmark's report)

    def eligible(self, batch: list[SeqInput], return_hidden: bool) -> bool:
        """Whether this step can run through a bucket's static path."""
        return (not return_hidden and 0 < len(batch) <= BUCKETS[-1]
                and not is_quantized(self.runner.pool_kv)
                and all(len(s.tokens) == 1 and s.mask is None and not s.adapter
                        and list(s.logit_indices) == [0] for s in batch))

    def run(self, flat: FlatBatch) -> torch.Tensor:
        """Logits ``[B, vocab]`` of an eligible step (already validated by ``flatten``)."""
        meta = flat.meta
        b = len(meta.query_lens)
        bucket = next(n for n in BUCKETS if n >= b)
        slot = self._slots.get(bucket) or self._build(bucket)
        pad = bucket - b
        slot.static.fill(meta.page_tables + [meta.page_tables[0]] * pad,
                         meta.kv_lens + [meta.kv_lens[0]] * pad,
                         meta.num_cached + [meta.num_cached[0]] * pad)
        for dst, src in ((slot.tokens, flat.tokens), (slot.positions, meta.positions),
                         (slot.write_pages, meta.write_pages),
                         (slot.write_slots, meta.write_slots)):
            dst[:b].copy_(src, non_blocking=True)
            dst[b:].copy_(src[:1].expand(pad), non_blocking=True)
        self.replays += 1
        if not self.capture:
            return slot.run()[:b]
        if slot.graph is None:
            self._capture(slot)
        slot.graph.replay()
        assert slot.out is not None
        return slot.out[:b].clone()

    def _build(self, bucket: int) -> _Slot:
        r = self.runner
        dev = r.device

        def zeros() -> torch.Tensor:
            return torch.zeros(bucket, dtype=torch.int64, device=dev)

        tokens, positions, pages, slots = zeros(), zeros(), zeros(), zeros()
        static = r.backend.static_decodes(bucket, r.num_pages, dev)
        meta = AttentionMetadata(r.page_size, [1] * bucket, [0] * bucket, [1] * bucket,
                                 [[0]] * bucket, positions, pages, slots, [None] * bucket,
                                 backend_state=static.plan())
        pool, backend, model = r.pool_kv, r.backend, r.model

        def attend(layer: int, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
            return backend.forward(layer, q, kv, pool, meta)

        def run() -> torch.Tensor:
            with torch.inference_mode():
                return model.forward(tokens, positions, attend, None)

        slot = _Slot(tokens, positions, pages, slots, static, meta, run)
        self._slots[bucket] = slot
        return slot

    def _capture(self, slot: _Slot) -> None:
        """Warm up on a side stream (compiles flex, settles the allocator), then capture."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                slot.run()
        torch.cuda.current_stream().wait_stream(stream)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            slot.out = slot.run()
        slot.graph = graph
