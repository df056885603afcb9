"""ModelRunner: one batched forward over the paged KV pool.

Owner: the engine calls :meth:`ModelRunner.forward` once per scheduler step. The runner
owns the fused weights and the attention backend; it does NOT own the pool tensor or the
page tables (runtime/kv does): it only writes K/V of the new tokens into the slots their
page tables name, for every layer.

Contract (docs/design.md, runtime/model): new token ``j`` of a sequence is written at KV
index ``num_cached + j`` = page ``page_table[idx // page_size]``, slot
``idx % page_size``; logits come back for ``logit_indices`` only, in batch order then
``logit_indices`` order, as float32. Every input is validated before any slot is written,
so a rejected batch leaves the pool untouched.
"""

from __future__ import annotations

import logging

import torch

from pie_ctx.proto.errors import InvalidArgument
from runtime.model.adapters import FusedAdapter, LoraAdapter, LoraBatch, fuse, load_peft
from runtime.model.adapters.delta import StackedAdapters, stack
from runtime.model.attention import AttentionBackend, select_backend
from runtime.model.batch import SeqInput
from runtime.model.blocks import BlockWeight
from runtime.model.config import ModelConfig
from runtime.model.cuda_graphs import DecodeGraphs
from runtime.model.cuda_graphs import wanted as graphs_wanted
from runtime.model.flatten import FlatBatch, check_pool, flatten
from runtime.model.fused_step import FusedStep, why_not
from runtime.model.fused_step import enabled as step_enabled
from runtime.model.model import Transformer
from runtime.model.numerics import Numerics, finish_weights
from runtime.model.scores import Scoring

__all__ = ["SeqInput", "ModelRunner"]

log = logging.getLogger(__name__)

# A batch of several adapters with at most this many rows runs them side by side (one
# matmul pair for all, ``LoraBatch``); more rows (prefill chunks) run adapter by adapter.
_STACK_MAX_ROWS = 64
_STACK_CACHE = 2  # sets of adapters kept side by side (a decode batch keeps its set)


class ModelRunner:
    """Runs the model over batches of :class:`SeqInput` against a paged pool.

    Args:
        config: the model config.
        weights: HF-named tensors (``LoadedModel.weights``).
        pool_kv: Tensor[num_pages, page_size, num_layers, 2, num_kv_heads, width] (see
            ``runtime.kv.layout``): unquantized (width = head_dim) in the model's dtype, or
            int8 (width = head_dim + 4); on the model's device.
        page_size: tokens per page.
        backend: attention backend; default: ``select_backend``'s choice (``PIE_CTX_ATTENTION``).
        weight_format: ``"fp32"`` (unquantized, in the compute dtype), ``"int8"`` (see
            ``runtime.model.quant``; needs ``calibration``) or ``"gguf"`` (a GGUF's own
            blocks, see ``runtime.model.gguf_weights``; ``blocks``).
        calibration: token ids int8 measures activation ranges on (with ``"gguf"``: where
            ``blocks_q8`` is on, the pass that picks its outlier channels).
        blocks: with ``"gguf"``, the block weights of the model's GGUF
            (``runtime.model.loader.load_blocks``); None: Q4_1 blocks made at load.
        dtype: the compute dtype; default: the pool's, or float32 for an int8 pool.
        deterministic: batch-invariant numerics (docs/performance.md): projection kernels
            and an attention path whose row results do not depend on the batch, the
            chunking or the cache. Honoured on CPU with pie-ctx's kernels built; elsewhere
            it is logged and :attr:`deterministic` says False.
        numerics: the numerics decided already (``boot_engine``:
            ``runtime.model.numerics.Numerics.decide``); then ``weight_format``, ``dtype``
            and ``deterministic`` are not read. Default: decided here from them.

    Raises:
        InvalidArgument: the pool's shape or dtype does not fit the model; an unknown
            ``weight_format``; int8 off CPU or without calibration tokens.
        ModelError: a weight is missing or mis-shaped.
    """

    kind = "native"  # EngineInfo.backend

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor],
                 pool_kv: torch.Tensor, page_size: int,
                 backend: AttentionBackend | None = None, *, weight_format: str = "fp32",
                 calibration: list[int] | None = None,
                 dtype: torch.dtype | None = None,
                 blocks: dict[str, BlockWeight] | None = None,
                 deterministic: bool = False, numerics: Numerics | None = None) -> None:
        c: ModelConfig = config
        if numerics is not None:
            dtype = numerics.dtype
        kv_dtype = check_pool(pool_kv, page_size, c.num_layers, c.num_kv_heads, c.head_dim,
                              dtype)
        self.device = pool_kv.device
        if numerics is None:
            numerics = Numerics.decide(
                self.device, pool_kv.dtype if kv_dtype == "fp32" else (dtype or torch.float32),
                deterministic=deterministic, weight_format=weight_format)
        self.numerics = numerics
        self.config = c
        self.pool_kv = pool_kv
        self.kv_dtype = kv_dtype
        self.page_size = page_size
        self.num_pages = int(pool_kv.shape[0])
        self.dtype = numerics.dtype
        self.model = Transformer(c, weights, self.device, self.dtype)
        finish_weights(self.model, numerics, calibration=calibration, blocks=blocks,
                       head=self._final_head)
        self.score_layers = c.num_layers  # attention_scores() can read every layer
        self.score_heads = c.num_heads
        self.backend = backend or select_backend(self.device, self.dtype, page_size, c.head_dim,
                                                 kv_dtype, heads=(c.num_heads, c.num_kv_heads),
                                                 choice=numerics.attention,
                                                 deterministic=numerics.deterministic)
        # decode steps through CUDA graphs (PIE_CTX_CUDA_GRAPHS=1, flex on CUDA)
        self.graphs = DecodeGraphs(self) if graphs_wanted(self.device, self.backend) else None
        self.adapters: dict[str, LoraAdapter] = {}  # by name
        self._fused: dict[int, FusedAdapter] = {}  # by key: what SeqInput.adapter names
        # the last few sets of adapters decoded together, side by side (LoraBatch)
        self._stacks: dict[tuple[int, ...], StackedAdapters] = {}
        # the decode step in one C++ call (runtime.model.fused_step), built at first use;
        # False: this model cannot use it (logged once)
        self._step: FusedStep | bool | None = None

    def load_adapter(self, name: str, path: str, model_name: str = "") -> LoraAdapter:
        """Read a PEFT LoRA folder and make it usable as ``SeqInput.adapter = key``.

        Raises:
            InvalidArgument: ``name`` is already loaded.
            ModelError: the folder is not a supported LoRA of this model.
        """
        if name in self.adapters:
            raise InvalidArgument(f"an adapter named {name!r} is already loaded; unload it "
                                  "first or pick another name")
        adapter = load_peft(name, path, self.config, model_name)
        if adapter.key not in self._fused:  # the same weights under two names: one copy
            self._fused[adapter.key] = fuse(adapter, self.model)
            if isinstance(self._step, FusedStep):  # its bf16 copies now, not in a step
                self._step.register(self._fused[adapter.key])
        self.adapters[name] = adapter
        return adapter

    def unload_adapter(self, name: str) -> LoraAdapter:
        """Forget an adapter (the caller made sure no row uses it). Returns it."""
        adapter = self.adapters.pop(name)
        if all(a.key != adapter.key for a in self.adapters.values()):
            del self._fused[adapter.key]
            if isinstance(self._step, FusedStep):
                self._step.drop(adapter.key)
            self._stacks = {k: v for k, v in self._stacks.items() if adapter.key not in k}
        return adapter

    def has_adapter_key(self, key: int) -> bool:
        """Whether an adapter with this key is loaded (0, the base model, always is)."""
        return key == 0 or key in self._fused

    def _final_head(self, model: Transformer) -> None:
        """Replace ``model``'s lm_head before its kernels are chosen (tensor parallelism's
        vocab-parallel head, ``runtime.distributed``); this runner keeps the model's."""

    @property
    def weight_format(self) -> str:
        """``"fp32"``, ``"int8"`` or ``"gguf"`` (see ``runtime.model.quant``)."""
        return self.model.weight_format

    @property
    def deterministic(self) -> bool:
        """Whether batch-invariant numerics run (``EngineInfo.deterministic``)."""
        return self.numerics.deterministic

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights the forward reads per step."""
        return self.model.weight_bytes()

    def forward(self, batch: list[SeqInput], *,
                return_hidden: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Write the batch's K/V into the pool and return the requested logits.

        Args:
            batch: one entry per context; each needs at least one new token.
            return_hidden: also return the final-norm hidden states of the same rows.

        Returns:
            Tensor[num_logit_rows, vocab] float32, rows in batch then ``logit_indices`` order
            (and Tensor[num_logit_rows, hidden] with ``return_hidden``).

        Raises:
            InvalidArgument: a malformed entry (lengths, page table too short, page id or
                token out of range, bad mask); nothing is written.
        """
        with torch.inference_mode():
            flat = flatten(batch, page_size=self.page_size, vocab_size=self.config.vocab_size,
                           num_pages=self.num_pages, device=self.device,
                           has_adapter=self.has_adapter_key)
            meta, tokens, rows = flat.meta, flat.tokens, flat.rows
            if self.graphs is not None and self.graphs.eligible(batch, return_hidden):
                return self.graphs.run(flat)
            step = self._fused_step(batch, flat)
            if step is not None:
                x = step.run(self.model, tokens, meta, self.pool_kv, self._fused, batch)
                return self.model.finish(x, rows, return_hidden)
            lora = self._lora_batch(batch)
            scoring = Scoring(batch, meta) if any(s.scores for s in batch) else None
            if scoring is not None:  # the paged kernel scores the sequences it attends
                meta.scores = scoring.capture
            self.backend.prepare(meta, self.pool_kv)
            pool, backend = self.pool_kv, self.backend

            def attend(layer: int, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
                out = backend.forward(layer, q, kv, pool, meta)
                if scoring is not None:  # the queries of the rows that ask (scores.py)
                    scoring.collect(layer, q)
                return out

            result = self.model.forward(tokens, meta.positions, attend, rows,
                                        return_hidden=return_hidden, lora=lora)
            if scoring is not None:
                scoring.finish(pool)
            return result

    def _fused_step(self, batch: list[SeqInput], flat: FlatBatch) -> FusedStep | None:
        """The fused decode step if it takes this batch (``runtime.model.fused_step``)."""
        if self._step is False or not step_enabled() \
                or not FusedStep.serves(self.pool_kv, self.backend):
            return None
        if self._step is None:
            reason = why_not(self.model)
            if reason is not None:
                log.info("decode steps run eagerly: %s", reason)
                self._step = False
                return None
            self._step = FusedStep(self.model)
            for fused in self._fused.values():
                self._step.register(fused)
        step: FusedStep = self._step  # type: ignore[assignment]
        return step if step.takes(batch, flat.meta, self.pool_kv, self.backend) else None

    def _lora_batch(self, batch: list[SeqInput]) -> LoraBatch | None:
        """The rows of each adapter in the flat batch: a slice when they are contiguous
        (one context, or contexts the scheduler placed together), else an index."""
        rows: dict[int, list[tuple[int, int]]] = {}
        start = 0
        for seq in batch:
            n = len(seq.tokens)
            if seq.adapter:
                runs = rows.setdefault(seq.adapter, [])
                if runs and runs[-1][1] == start:
                    runs[-1] = (runs[-1][0], start + n)
                else:
                    runs.append((start, start + n))
            start += n
        if not rows:
            return None
        segments: list[tuple[slice | torch.Tensor, FusedAdapter]] = []
        for key, runs in rows.items():
            if len(runs) == 1:
                sel: slice | torch.Tensor = slice(*runs[0])
            else:
                sel = torch.cat([torch.arange(a, b) for a, b in runs]).to(self.device)
            segments.append((sel, self._fused[key]))
        if len(segments) < 2 or start > _STACK_MAX_ROWS:
            return LoraBatch(segments)
        # the set, not the batch's order, names a stack: the scheduler reorders rows
        segments.sort(key=lambda seg: seg[1].key)
        keys = tuple(f.key for _, f in segments)
        stacked = self._stacks.get(keys)
        if stacked is None:
            if len(self._stacks) >= _STACK_CACHE:
                self._stacks.pop(next(iter(self._stacks)))
            stacked = self._stacks[keys] = stack([f for _, f in segments])
        return LoraBatch(segments, stacked, start, self.device)
