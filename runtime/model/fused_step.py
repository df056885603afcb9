"""The decode step as one C++ call: when it runs, and what it is given once.

Owner: the model runner. A decode step of the eager forward (``runtime.model.model``) is
~28 operations a layer, each a Python call into torch (5-10 us of dispatch each on a CPU:
4-8 ms of an ~11 ms int8 step of SmolLM2). ``decode_step.cpp``'s ``DecodeStep`` runs every
layer of the step in one call instead: the same kernels (pie-ctx's norms, RoPE, K/V write,
paged attention and SiLU, and each projection's kernel as ``choose_kernels`` picked it for
the batch's row bucket), called from C++. The embedding lookup, the rotary tables, the
final norm and the lm_head stay in Python (a handful of ops a step, not a layer).

:class:`FusedStep` is built once per model, at the first step that could use it: it hands
the C++ object every layer's norms and projection kernels (their weights in the layouts
the chosen kernels read). LoRA adapters are registered on first use as bf16 copies of
their fused pairs (``runtime.model.adapters.delta``), each target's B as its own dense
block (no block-diagonal zeros, transposed), and their deltas run as one grouped kernel per projection
for every adapter in the batch.

When it runs (:meth:`FusedStep.takes`; everything else runs the eager forward, which stays
the oracle of tests/model/test_fused_step.py):

* ``PIE_CTX_DECODE_STEP`` is not ``0`` (read at import), and pie-ctx's CPU kernels built;
* a CPU model in fp32 compute (fp32, int8, int4 or GGUF block weights) with fp32, int8 or
  bf16 KV pages (:func:`_pages_readable`), head dim a multiple of 16, no q/k norms (Qwen3),
  one rank (no tensor parallelism);
* every projection's chosen kernel, for the 1-row and the batch bucket, has a C++ form:
  ``mkl``, ``mm``, ``onednn``, ``f32_strips``, ``int_mm``, ``int_mm_kn``, ``int8_strips``,
  ``fbgemm``, ``int4pack``,
  ``blocks``, ``blocks_q8``, ``kquant``, ``kquant_q8``, each also as a deterministic
  choice's padded ``name@p``
  (the C++ step pads a call of fewer rows with zero rows, as ``Projection`` does);
* the attention backend is the torch one with its kernels on;
* the batch has at most :data:`MAX_ROWS` new tokens, each sequence at most 16 of them
  (decodes, drafts, short chunks), no attention scores asked for, and no custom mask
  other than one that equals causal attention (a mask the paged kernel cannot express
  runs eagerly); adapters of any mix. Under deterministic numerics the eager forward
  sends every causal row, a prefill chunk's too, through the same paged kernel, so there
  the step takes any number of them: a step that mixes a prefill chunk with decodes and
  drafts (an agent's new turn beside the others' tokens) skips ~28 Python calls a layer
  too, when every projection's chunk-bucket kernel (64 rows and up) has a C++ form;
  rows with an adapter only in steps of at most :data:`MAX_ROWS` rows, and at most 16 of
  that sequence (the grouped LoRA kernel is made for a few rows: a prefill chunk with an
  adapter runs eagerly on the fp32 deltas, as it did before chunks were fused);
* forks whose shared pages the eager cascade would read once, where the fused step reads
  them once per fork, share at most :data:`MAX_SHARED_PAGES` extra page reads (best-of-8
  over a long prompt stays on the cascade).

Numerics: the projections, norms, RoPE and K/V writes are the eager ops' bits (bf16 and
int8 pages: the same C++ ``write_kv`` and ``paged_attention`` as the eager backend, which
store ``runtime.kv.layout.encode``'s bytes). Attention
is the paged kernel for every sequence, where the eager forward attends forks through the
cascade (a shared prefix as one GEMM), so forked rows differ in the last bits. Under
deterministic numerics (docs/performance.md) the eager forward has no cascade and sends
every causal row through the same paged kernel, and the projections are one class of
row-count-invariant kernels, so a row's logits and K/V are the same bits whether its step
ran here (<= 32 rows), eagerly (more rows, a prefill chunk) or in another batch
(tests/model/test_fused_step.py checks it). LoRA
deltas use bf16 adapter weights with fp32 accumulation: within bf16 rounding of the fp32
eager deltas (tests state the bounds).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from runtime.model import kernels
from runtime.model.adapters.delta import FusedAdapter
from runtime.model.attention.base import AttentionBackend, AttentionMetadata
from runtime.model.attention.cascade import shared_prefix_clusters
from runtime.model.attention.torch_backend import KERNEL_MAX_QUERIES, KernelGroup
from runtime.model.batch import SeqInput
from runtime.model.blocks import BlockWeight, Int4Weight, StripBlocks
from runtime.model.kernel_choice import step_kinds
from runtime.model.kquants import KQuantWeight
from runtime.model.matmul import CHUNK_ROWS, Int8Weight, Projection

__all__ = ["ENABLED", "MAX_ROWS", "FusedStep", "enabled"]

log = logging.getLogger(__name__)

# Read once; tests flip it with monkeypatch.setattr.
ENABLED = os.environ.get("PIE_CTX_DECODE_STEP", "1").lower() not in ("0", "false", "no", "off")
# New tokens of a step it takes: matmul's 1-row bucket, then its batch bucket (2-63 rows
# eagerly too, so the same kernels either way). 8 decode rows with prompt-lookup drafts
# (16-32 tokens, SmolLM2 gguf, 400-token contexts) ran ~5-15% faster here than eagerly
# (a noisy A/B on the engine's model thread).
MAX_ROWS = 32
# Forks' pages read again by the paged kernel (one per fork beyond the first, per shared
# page) beyond which the eager cascade runs the step: each costs ~0.07 ms a step on
# SmolLM2 (16 tokens x 30 layers x 1.5 KB at ~10 GB/s) against ~4-8 ms of dispatch saved.
MAX_SHARED_PAGES = 16

_PROJECTIONS = ("qkv", "o", "gate_up", "down")
_NONE = torch.empty(0)


def enabled() -> bool:
    """False when ``PIE_CTX_DECODE_STEP=0`` (read at import) asks for the eager forward."""
    return ENABLED


def _spec(p: Projection, name: str) -> tuple | None:
    """What ``DecodeStep`` needs to run kernel ``name`` of ``p``; None: no C++ form.
    ``base@p`` (a deterministic choice, ``runtime.model.matmul``): ``base``'s, on calls
    padded with zero rows to ``p`` rows in C++ as ``Projection`` pads them in Python."""
    base, _, pad = name.partition("@")
    spec = _base_spec(p, base)
    if spec is None:
        return None
    # (kind, w, scale, bias, packed, group, rows, pad, *blocks_q8's outlier idx and side)
    rows = spec[6] if len(spec) > 6 else 0  # output rows where strips pad them to 16s
    return (*spec[:6], rows, int(pad or 1), *spec[7:])


def _base_spec(p: Projection, name: str) -> tuple | None:
    w, bias = p.weight, p.bias
    kind = step_kinds().get(name)
    if kind is None:
        return None
    if name in ("mkl", "mm") and isinstance(w, torch.Tensor):
        return (kind, w, _NONE, bias, None, 0)
    layout = p.layout(name)  # the weight as the kernel reads it, where it has a copy
    if name == "onednn" and layout is not None:
        return (kind, layout, _NONE, bias, None, 0)
    if name == "f32_strips" and layout is not None:  # [N/16, K, 16]
        return (kind, layout, _NONE, bias, None, 0, w.shape[0])  # type: ignore[union-attr]
    if isinstance(w, Int8Weight):
        b = None if bias is None else bias.float()
        if name == "int_mm":
            return (kind, w.q.t(), w.scale, b, None, 0)
        if name == "int_mm_kn" and layout is not None:
            return (kind, layout, w.scale, b, None, 0)
        if name == "fbgemm" and layout is not None:  # bias inside the prepacked weight
            return (kind, _NONE, _NONE, None, layout, 0)
        if name == "int8_strips" and layout is not None:  # (packed strips, row sums)
            packed, sums = layout  # type: ignore[misc]
            return (kind, packed, w.scale, b, sums, 0, w.q.shape[0])
    if isinstance(w, KQuantWeight) and kernels.kquant_ops() is not None:  # its op registered
        return (kind, _NONE, w.codes, bias, [p.raw for p in w.parts], int(name == "kquant_q8"))
    if isinstance(w, BlockWeight):
        if name == "blocks" and kernels.block_ops() is not None:  # its op registered
            return (kind, w.qs, w.d, bias, w.m, w.bits)
        if name == "blocks_q8" and isinstance(layout, StripBlocks):
            return (kind, layout.qs, layout.d, bias, layout.m, layout.code,
                    layout.out_features, layout.outliers, layout.side)
        if name == "int4pack" and isinstance(layout, Int4Weight):
            return (kind, layout.packed, layout.scales_and_zeros, bias, None, layout.group_size)
    return None


def why_not(model: Any) -> str | None:
    """Why ``model`` (a ``Transformer``) cannot run the fused step; None if it can."""
    c = model.config
    if kernels.ops() is None:
        return "pie-ctx's CPU kernels are off or did not build"
    if model.device.type != "cpu" or model.dtype != torch.float32:
        return "not an fp32-compute CPU model"
    if c.head_dim % 16:
        return f"head dim {c.head_dim} is not a multiple of 16"
    if model.reduce is not None:
        return "tensor parallel"
    for i, lw in enumerate(model.layers):
        if lw.q_norm is not None:
            return "q/k norms (Qwen3)"
        for attr in _PROJECTIONS:
            proj = getattr(lw, "o_proj" if attr == "o" else attr)
            for name in proj.kernel_names[:2]:
                if _spec(proj, name) is None:
                    return f"layer {i} {attr}: kernel {name!r} has no C++ form"
    return None


def _pages_readable(pool_kv: torch.Tensor, backend: AttentionBackend) -> bool:
    """Whether the step reads and writes ``pool_kv``'s pages as the eager torch backend
    does (the same C++ ``write_kv`` and ``paged_attention``): fp32, int8 (entries with
    their scales), or bf16 where the backend's kernel reads bf16 pages of an fp32 model."""
    if pool_kv.dtype in (torch.float32, torch.int8):
        return True
    return pool_kv.dtype == torch.bfloat16 and backend.bf16_pool


def _causal(mask: torch.Tensor, cached: int) -> bool:
    """Whether a custom mask [q, kv] is plain causal attention (row j sees ``cached + j``
    entries and no others)."""
    q, kv = mask.shape
    if kv != cached + q:
        return False
    want = torch.ones(q, kv, dtype=torch.bool, device=mask.device).tril(cached)
    return bool(torch.equal(mask.bool(), want))


class FusedStep:
    """``DecodeStep`` prepared for one model; see the module docstring.

    Args:
        model: a ``runtime.model.model.Transformer`` that :func:`why_not` accepts.
    """

    def __init__(self, model: Any) -> None:
        c = model.config
        ops = kernels.ops()
        self.ops = ops
        self.steps = 0  # steps run (tests and benchmarks check it ran)
        # each layer's projections' kernels, one per matmul bucket (1 row, a batch, a chunk)
        specs = [[[_spec(p, n) for n in p.kernel_names[:3]]
                  for p in (lw.qkv, lw.o_proj, lw.gate_up, lw.down)] for lw in model.layers]
        # whether every projection's chunk bucket (CHUNK_ROWS rows and up) has a C++ form
        # too: then a deterministic step of any size can run here (``takes``)
        self.chunks = all(len(k) > 2 and k[2] is not None for layer in specs for k in layer)
        # adapter key (a 64-bit digest) -> the small id the C++ step knows it by (1, 2, ...)
        self._ids: dict[int, int] = {}
        self._next_id = 1
        self.step = ops.DecodeStep(c.num_heads, c.num_kv_heads, c.head_dim, c.rms_norm_eps,
                                   CHUNK_ROWS)
        buckets = 3 if self.chunks else 2
        for lw, layer in zip(model.layers, specs, strict=True):
            self.step.add_layer(lw.input_norm, lw.post_norm, [k[:buckets] for k in layer])

    def register(self, adapter: FusedAdapter) -> None:
        """Hand the C++ step bf16 copies of ``adapter``'s fused pairs (once per key)."""
        if adapter.key in self._ids:
            return
        layers = []
        for pairs, blocks in zip(adapter.layers, adapter.blocks, strict=True):
            entries: list[Any] = []
            for name in _PROJECTIONS:
                pair = pairs.get(name)
                if pair is None:
                    entries.append(None)
                    continue
                a, b = pair
                # each block transposed, [rank, out]: the kernel runs 16 outputs at once
                parts = [(lo, hi, c0, c1, b[lo:hi, c0:c1].t().to(torch.bfloat16).contiguous())
                         for lo, hi, c0, c1 in blocks[name] if c1 > c0]
                entries.append((a.to(torch.bfloat16).contiguous(), parts))
            layers.append(entries)
        self._ids[adapter.key] = self._next_id
        self.step.add_adapter(self._next_id, layers)
        self._next_id += 1

    def has(self, key: int) -> bool:
        """Whether the step holds copies of adapter ``key``."""
        return key in self._ids

    def drop(self, key: int) -> None:
        """Forget an unloaded adapter's copies."""
        slot = self._ids.pop(key, None)
        if slot is not None:
            self.step.drop_adapter(slot)

    @staticmethod
    def serves(pool_kv: torch.Tensor, backend: AttentionBackend) -> bool:
        """Whether the step can run any batch over ``pool_kv`` with ``backend`` (the
        torch backend with its kernels, pages it reads as the eager backend does)."""
        return _pages_readable(pool_kv, backend) and pool_kv.device.type == "cpu" \
            and backend.name == "torch" and backend.kernels

    def takes(self, batch: list[SeqInput], meta: AttentionMetadata, pool_kv: torch.Tensor,
              backend: AttentionBackend) -> bool:
        """Whether this step's batch is one the fused step runs (module docstring)."""
        # deterministic: every causal row goes to the paged kernel eagerly too
        whole = self.chunks and backend.deterministic
        if (meta.num_tokens > MAX_ROWS and not whole) or not self.serves(pool_kv, backend):
            return False
        big = meta.num_tokens > MAX_ROWS  # (only when ``whole``)
        for seq, mask, cached in zip(batch, meta.masks, meta.num_cached, strict=True):
            if seq.scores or (len(seq.tokens) > KERNEL_MAX_QUERIES and not whole):
                return False
            if seq.adapter and (big or len(seq.tokens) > KERNEL_MAX_QUERIES):
                return False  # the grouped LoRA kernel is made for a few rows
            if mask is not None and not _causal(mask, cached):
                return False
        if len(batch) > 1 and backend.cascade:
            # forks: the paged kernel reads a shared prefix once per fork, the eager
            # cascade once for all of them; past MAX_SHARED_PAGES extra page reads the
            # cascade saves more than the step's dispatch
            decodes = [i for i, n in enumerate(meta.query_lens)
                       if n == 1 and meta.masks[i] is None]
            clusters, _ = shared_prefix_clusters(meta, decodes)
            if sum((len(seqs) - 1) * shared for seqs, shared in clusters) > MAX_SHARED_PAGES:
                return False
        return True

    def run(self, model: Any, tokens: torch.Tensor, meta: AttentionMetadata,
            pool_kv: torch.Tensor, adapters: dict[int, FusedAdapter],
            batch: list[SeqInput]) -> torch.Tensor:
        """Every layer of the step: Tensor[T, hidden], the last layer's output (its K/V
        written into ``pool_kv``). ``adapters``: the runner's fused adapters by key."""
        self.steps += 1
        row_keys = [seq.adapter for seq in batch for _ in seq.tokens]
        if any(row_keys):
            for key in set(row_keys) - {0}:
                self.register(adapters[key])
            rows = torch.tensor([self._ids[k] if k else 0 for k in row_keys],
                                dtype=torch.int64)
        else:
            rows = _NONE
        group = KernelGroup.build(self.ops, meta, list(range(len(batch))))
        cos, sin = model.rotary.cos_sin(meta.positions, torch.float32)  # [T, 1, D]
        x = model.embed_tokens(tokens)  # [T, hidden]
        return self.step.run(x, cos[:, 0], sin[:, 0], pool_kv, meta.write_pages,
                             meta.write_slots, group.page_tables, group.seq_start,
                             group.num_cached, rows)
