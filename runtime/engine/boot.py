"""Build an engine from a model reference: load the model, size the pool, wire the runner.

Owns nothing after it returns; the engine owns what it builds. The arrow points one way:
boot imports the engine, the engine never imports boot (``Engine.boot`` forwards here).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from pie_ctx.proto import checks
from pie_ctx.proto.errors import InvalidArgument
from runtime.engine.engine import Engine
from runtime.kv.layout import KV_DTYPES, entry_bytes
from runtime.kv.store import PageStore
from runtime.model.loader import load_model
from runtime.model.quant import WEIGHT_FORMATS, calibration_tokens
from runtime.model.runner import ModelRunner


def pool_pages_for(config: Any, page_size: int, dtype: torch.dtype, kv_memory_gb: float,
                   kv_dtype: str = "fp32") -> int:
    """How many pages of this model fit in ``kv_memory_gb`` GiB (``dtype``: the compute
    dtype; ``kv_dtype``: how entries are stored, see runtime/kv/layout)."""
    entry = entry_bytes(kv_dtype, config.head_dim, dtype)
    page_bytes = config.num_layers * 2 * page_size * config.num_kv_heads * entry
    return max(1, int(kv_memory_gb * 2**30) // page_bytes)


def boot_engine(model: str | None = None, *, page_size: int = 16, num_pages: int | None = None,
                kv_memory_gb: float = 2.0, dtype: Any = None, device: Any = None,
                max_step_tokens: int = 1024, progress: bool = True,
                owner_share: float | None = None, weights: str = "fp32",
                kv_dtype: str = "fp32", **engine_kw: Any) -> Engine:
    """Load ``model`` (None = the default SmolLM2-135M-Instruct) and return an ``Engine``.

    Args:
        model: a model reference (see ``runtime.model.loader.resolve_model``).
        page_size: tokens per page (engine-wide, fixed for the engine's life).
        num_pages: pool size; default: as many as ``kv_memory_gb`` holds.
        kv_memory_gb: KV pool budget used when ``num_pages`` is None.
        dtype, device: model/pool dtype and device (defaults: fp32 on CPU, bf16 on CUDA).
        max_step_tokens: token budget of one model call.
        progress: progress bars while fetching/converting.
        owner_share: the fraction of the pool one owner (client) may hold, in (0, 1];
            None = no limit (see docs/scheduling.md).
        weights: ``"fp32"`` (unquantized, in ``dtype``) or ``"int8"`` (smoothed int8
            projections, CPU; see docs/models.md).
        kv_dtype: ``"fp32"`` (KV pages unquantized, in ``dtype``) or ``"int8"`` (int8 entries
            with a scale per token and KV head: 3.8x the pages in the same memory at head dim
            64; see docs/forward.md).
        **engine_kw: more ``Engine`` settings (``stall_timeout``, ``max_reply_bytes``...).

    Raises:
        InvalidArgument: a size is not positive.
        ModelError: the model cannot be loaded.
    """
    checks.positive(page_size, "page_size")
    if num_pages is not None:
        checks.positive(num_pages, "num_pages")
    checks.positive(max_step_tokens, "max_step_tokens")
    if weights not in WEIGHT_FORMATS:
        raise InvalidArgument(f"weights must be one of {', '.join(WEIGHT_FORMATS)}, got {weights!r}")
    if kv_dtype not in KV_DTYPES:
        raise InvalidArgument(f"kv_dtype must be one of {', '.join(KV_DTYPES)}, got {kv_dtype!r}")
    if owner_share is not None and not 0 < checks.finite(owner_share, "owner_share") <= 1:
        raise InvalidArgument(f"owner_share must be in (0, 1], got {owner_share!r}")

    def build() -> tuple[Any, Any, Any]:
        loaded = load_model(model, dtype=dtype, device=device, progress=progress)
        cfg = loaded.config
        weight = loaded.weights["model.embed_tokens.weight"]
        pages = num_pages or pool_pages_for(cfg, page_size, weight.dtype, kv_memory_gb, kv_dtype)
        store = PageStore(pages, page_size, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim,
                          dtype=weight.dtype, device=weight.device, kv_dtype=kv_dtype)
        calibration = calibration_tokens(loaded.tokenizer) if weights == "int8" else None
        runner = ModelRunner(cfg, loaded.weights, store.pool.kv, page_size,
                             weight_format=weights, calibration=calibration, dtype=weight.dtype)
        return loaded, store, runner

    # Load on the thread that will run every model step (see Engine: one OpenMP team).
    thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pie-ctx-model")
    try:
        loaded, store, runner = thread.submit(build).result()
    except BaseException:
        thread.shutdown(wait=False)
        raise
    cfg = loaded.config
    if owner_share is not None:
        engine_kw["max_pages_per_owner"] = max(1, int(owner_share * store.num_pages_total))
    return Engine(store, runner, loaded.tokenizer, model_name=loaded.name,
                  vocab_size=cfg.vocab_size, max_seq_len=cfg.max_position_embeddings,
                  hidden_size=cfg.hidden_size,
                  max_step_tokens=max_step_tokens, model_thread=thread, **engine_kw)
