"""TransformersRunner: any transformers causal LM, one batched forward over the page pool.

Owner: the engine calls :meth:`TransformersRunner.forward` once per step, exactly as it
calls the native ``ModelRunner``: same :class:`SeqInput` contract, same validation
(``runtime.model.flatten``), same pool layout and attention backend. The model is
transformers' own class, loaded from the HF folder with ``attn_implementation`` set to
pie-ctx's registered attention (``.attention``); everything else in the layer (fused
or separate projections, norms, RoPE variants, learned absolute positions, logit
soft-capping) is transformers' code.

What the architecture cannot do is refused with a typed error before anything is
written: a position outside a learned position table, LoRA adapters (native only).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pie_ctx.proto.errors import InvalidArgument, ModelError
from pie_ctx.proto.tokenizer import Tokenizer
from runtime.model.attention import AttentionBackend, select_backend
from runtime.model.batch import SeqInput
from runtime.model.flatten import FlatBatch, check_pool, flatten
from runtime.model.loader import resolve_device, resolve_dtype, resolve_model
from runtime.model.loader.hf import load_tokenizer, read_config
from runtime.model.transformers_backend.attention import ATTN_NAME, PagedStep, ShapeProbe, register

__all__ = ["TransformersModel", "TransformersRunner", "load_transformers_model"]


@dataclass(slots=True)
class TransformersModel:
    """A transformers causal LM loaded for the page pool, with the facts the engine needs."""

    name: str
    path: Path
    module: Any  # the transformers PreTrainedModel (eval mode)
    tokenizer: Tokenizer
    architecture: str  # e.g. "GPT2LMHeadModel"
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int  # rows of the logits
    hidden_size: int  # width of the final hidden state
    max_positions: int  # the model's context length (its config)
    position_table: int | None  # learned absolute positions: the table's size; None = relative

    @property
    def dtype(self) -> torch.dtype:
        return next(self.module.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.module.parameters()).device


def load_transformers_model(ref: str | Path | None = None, *, dtype: Any = None,
                            device: Any = None, progress: bool = True) -> TransformersModel:
    """Load ``ref`` with transformers' own model class, attention routed to the pages.

    Args:
        ref: a model reference (see ``runtime.model.loader.resolve_model``).
        dtype, device: as ``runtime.model.loader.load_model``.
        progress: progress bars while fetching/converting.

    Raises:
        InvalidArgument: bad dtype or device.
        ModelError: transformers cannot load the folder as a causal LM, or the model's
            attention cannot run over pages (the message says why).
    """
    try:
        import transformers
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging
    except ImportError:
        raise ModelError("the transformers backend needs transformers 5: pip install "
                         "'pie-ctx[transformers]'") from None
    if int(transformers.__version__.split(".")[0]) < 5:
        raise ModelError(f"the transformers backend needs transformers 5, found "
                         f"{transformers.__version__}: pip install 'pie-ctx[transformers]'")

    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    name, folder = resolve_model(ref, progress=progress, dense=True)  # safetensors
    config_dict = read_config(folder)
    register()
    bars = hf_logging.is_progress_bar_enabled()
    if not progress or not sys.stderr.isatty():  # a long load's bar is for a terminal only
        hf_logging.disable_progress_bar()
    try:
        module = AutoModelForCausalLM.from_pretrained(folder, dtype=dt,
                                                      attn_implementation=ATTN_NAME)
    except (ValueError, OSError, KeyError, TypeError) as e:
        raise ModelError(f"transformers cannot load {folder} as a causal LM: {e}") from None
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    module = module.to(dev).eval()
    tokenizer = load_tokenizer(folder, config_dict)
    text = module.config.get_text_config()
    arch = type(module).__name__
    probe = ShapeProbe(name)
    with torch.inference_mode():
        module(input_ids=torch.zeros((1, 2), dtype=torch.int64, device=dev),
               position_ids=torch.arange(2, device=dev)[None], use_cache=False,
               logits_to_keep=1, pie_ctx=probe)
    calls = probe.calls
    layers = sorted(c.layer for c in calls)
    if not calls or layers != list(range(len(calls))):
        raise ModelError(f"model {name} ({arch}): its attention layers report indices "
                         f"{layers}; pie-ctx needs one attention call per layer, numbered "
                         "from 0")
    shapes = {(c.num_heads, c.num_kv_heads, c.head_dim) for c in calls}
    if len(shapes) != 1:
        raise ModelError(f"model {name} ({arch}): its layers differ in head counts or head "
                         f"dims {sorted(shapes)}; one page pool holds one shape")
    (h, kvh, d), = shapes
    if h % kvh:
        raise ModelError(f"model {name} ({arch}): {h} query heads do not group over {kvh} "
                         "KV heads")
    max_positions = int(getattr(text, "max_position_embeddings", 0) or 0) or 1 << 20
    return TransformersModel(
        name=name, path=folder, module=module, tokenizer=tokenizer, architecture=arch,
        num_layers=len(calls), num_heads=h, num_kv_heads=kvh, head_dim=d,
        vocab_size=int(module.get_output_embeddings().weight.shape[0]),
        hidden_size=int(text.hidden_size), max_positions=max_positions,
        position_table=_position_table(module, max_positions))


def _position_table(module: Any, max_positions: int) -> int | None:
    """The size of a learned absolute position table (GPT-2's ``wpe``), else None."""
    embed = module.get_input_embeddings()
    for sub in module.modules():
        if (isinstance(sub, torch.nn.Embedding) and sub is not embed
                and sub.num_embeddings == max_positions):
            return max_positions
    return None


class TransformersRunner:
    """Runs a :class:`TransformersModel` over batches of :class:`SeqInput` (see the
    native ``runtime.model.runner.ModelRunner`` for the contract it shares).

    Args:
        model: the loaded model.
        pool_kv: the pool tensor (``runtime.kv.layout``) shaped for ``model``.
        page_size: tokens per page.
        backend: attention backend for plain layers; default as the native runner's.

    Raises:
        InvalidArgument: the pool does not fit the model.
        ModelError: the model's outputs depend on how contexts are batched (checked once,
            here, on a scratch pool): it would give wrong answers on pages.
    """

    kind = "transformers"  # EngineInfo.backend
    weight_format = "fp32"  # unquantized, in the compute dtype
    deterministic = False  # transformers' kernels: a row's bits may depend on its batch

    def __init__(self, model: TransformersModel, pool_kv: torch.Tensor, page_size: int,
                 backend: AttentionBackend | None = None) -> None:
        kv_dtype = check_pool(pool_kv, page_size, model.num_layers, model.num_kv_heads,
                              model.head_dim, model.dtype)
        self.model = model
        self.pool_kv = pool_kv
        self.page_size = page_size
        self.num_pages = int(pool_kv.shape[0])
        self.device = pool_kv.device
        self.dtype = model.dtype
        self.backend = backend or select_backend(self.device, self.dtype, page_size,
                                                 model.head_dim, kv_dtype,
                                                 heads=(model.num_heads, model.num_kv_heads))
        self.adapters: dict[str, Any] = {}  # LoRA runs on the native backend only
        self._check_batching()

    @property
    def weight_bytes(self) -> int:
        """Bytes of the model's parameters (what a decode step reads, roughly)."""
        return sum(p.numel() * p.element_size() for p in self.model.module.parameters())

    def has_adapter_key(self, key: int) -> bool:
        """Only the base model (key 0): adapters are native-only."""
        return key == 0

    def load_adapter(self, name: str, path: str, model_name: str = "") -> Any:
        """Refused: LoRA adapters need the native backend."""
        raise InvalidArgument(
            f"LoRA adapters run on the native backend only; {self.model.name} "
            f"({self.model.architecture}) runs on the transformers backend")

    def unload_adapter(self, name: str) -> Any:
        """Nothing is ever loaded (see :meth:`load_adapter`)."""
        raise InvalidArgument(f"no adapter named {name!r} is loaded")

    def forward(self, batch: list[SeqInput], *,
                return_hidden: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Write the batch's K/V into the pool and return the requested logits (float32,
        rows in batch then ``logit_indices`` order; with ``return_hidden`` also the
        final-norm hidden states of the same rows).

        Raises:
            InvalidArgument: a malformed entry, or a position the model cannot take;
                nothing is written.
        """
        with torch.inference_mode():
            flat = flatten(batch, page_size=self.page_size, vocab_size=self.model.vocab_size,
                           num_pages=self.num_pages, device=self.device,
                           has_adapter=self.has_adapter_key)
            return self._run(flat, self.pool_kv, return_hidden)

    def _run(self, flat: FlatBatch, pool_kv: torch.Tensor,
             return_hidden: bool) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        meta = flat.meta
        table = self.model.position_table
        if table is not None and meta.positions.numel():
            lo, hi = int(meta.positions.min()), int(meta.positions.max())
            if lo < 0 or hi >= table:
                raise InvalidArgument(
                    f"model {self.model.name} ({self.model.architecture}) has learned absolute "
                    f"positions 0..{table - 1}; position {lo if lo < 0 else hi} is outside its "
                    "table (a context of this model holds at most "
                    f"{table} tokens, and positions cannot be moved past it)")
        self.backend.prepare(meta, pool_kv)
        step = PagedStep(pool_kv, meta, self.backend)
        out = self.model.module(
            input_ids=flat.tokens[None], position_ids=meta.positions[None], use_cache=False,
            logits_to_keep=flat.rows, output_hidden_states=return_hidden, pie_ctx=step)
        logits = out.logits[0].float()  # [N, vocab]
        if return_hidden:
            return logits, out.hidden_states[-1][0].index_select(0, flat.rows)
        return logits

    def _check_batching(self) -> None:
        """A context's logits must not depend on what else is in the model call: run one
        three-token context alone, then after another context in the same call, on a
        scratch pool, and compare. A model that derives positions from its input's layout
        (not ``position_ids``) or attends outside the registered function fails here."""
        m, s = self.model, self.page_size
        per_seq = -(-3 // s)
        pool = torch.zeros((2 * per_seq, *self.pool_kv.shape[1:]), dtype=self.pool_kv.dtype,
                           device=self.device)
        ids = [i % m.vocab_size for i in (5, 7, 11, 13, 17)]

        def seq(tokens: list[int], first_page: int) -> SeqInput:
            n = len(tokens)
            return SeqInput(tokens, list(range(n)), list(range(first_page, first_page + per_seq)),
                            0, list(range(n)))

        def run(batch: list[SeqInput]) -> torch.Tensor:
            flat = flatten(batch, page_size=s, vocab_size=m.vocab_size, num_pages=len(pool),
                           device=self.device, has_adapter=self.has_adapter_key)
            logits = self._run(flat, pool, False)
            assert isinstance(logits, torch.Tensor)
            return logits

        with torch.inference_mode():
            alone = run([seq(ids[:3], 0)])
            together = run([seq(ids[3:], per_seq), seq(ids[:3], 0)])[2:]
        tol = 1e-3 + 1e-2 * float(alone.abs().max())
        if not bool(torch.allclose(alone, together, rtol=0, atol=tol)):
            diff = float((alone - together).abs().max())
            raise ModelError(
                f"model {m.name} ({m.architecture}): a context's logits change by {diff:.3g} "
                "when another context shares the model call; this model's code does not "
                "take its positions from position_ids or attends outside transformers' "
                "AttentionInterface, so it cannot run over pie-ctx's pages")
