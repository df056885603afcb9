"""Build an engine from a model reference: load the model, size the pool, wire the runner.

Owns nothing after it returns; the engine owns what it builds. The arrow points one way:
boot imports the engine, the engine never imports boot (``Engine.boot`` forwards here).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import xxhash

from pie_ctx.proto import checks
from pie_ctx.proto.errors import InvalidArgument
from runtime.engine.engine import Engine
from runtime.kv.disk import Fingerprint, PageFiles
from runtime.kv.layout import KV_DTYPES, entry_bytes
from runtime.kv.store import PageStore
from runtime.model.loader import load_model
from runtime.model.matmul import adopt_kernel_choices, kernel_choices
from runtime.model.quant import WEIGHT_FORMATS, calibration_tokens
from runtime.model.runner import ModelRunner

log = logging.getLogger("pie_ctx.engine")


def page_bytes_for(config: Any, page_size: int, dtype: torch.dtype,
                   kv_dtype: str = "fp32") -> int:
    """The bytes of one page of this model (``dtype``: the compute dtype; ``kv_dtype``: how
    entries are stored, see runtime/kv/layout)."""
    entry = entry_bytes(kv_dtype, config.head_dim, dtype)
    return config.num_layers * 2 * page_size * config.num_kv_heads * entry


def pool_pages_for(config: Any, page_size: int, dtype: torch.dtype, kv_memory_gb: float,
                   kv_dtype: str = "fp32") -> int:
    """How many pages of this model fit in ``kv_memory_gb`` GiB."""
    page_bytes = page_bytes_for(config, page_size, dtype, kv_dtype)
    return max(1, int(kv_memory_gb * 2**30) // page_bytes)


def fingerprint(loaded: Any, page_size: int, weights: str, kv_dtype: str) -> Fingerprint:
    """What decides this engine's KV bytes: its model files (hashed), formats and shapes.
    Snapshots are shared only between engines with equal fingerprints."""
    digest = xxhash.xxh3_128()
    for path in sorted(Path(loaded.path).iterdir()):
        if path.suffix in (".safetensors", ".gguf", ".bin") or path.name == "config.json":
            digest.update(path.name.encode())
            with open(path, "rb") as f:
                while chunk := f.read(1 << 24):
                    digest.update(chunk)
    cfg = loaded.config
    dtype = str(loaded.weights["model.embed_tokens.weight"].dtype).removeprefix("torch.")
    return Fingerprint(model=loaded.name, weights_digest=digest.hexdigest(), weights=weights,
                       dtype=dtype, kv_dtype=kv_dtype, page_size=page_size,
                       num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads,
                       head_dim=cfg.head_dim)


@contextmanager
def kernel_choices_kept(files: PageFiles | None) -> Iterator[None]:
    """Around building a runner: reuse the kernel choices saved in the snapshot folder, and
    save the ones made. Kernels are chosen by timing, and two kernels round differently: a
    restarted engine must continue a snapshot exactly as the engine that saved it would."""
    path = None if files is None else files.folder / "kernels.json"
    if path is not None and path.exists():
        try:
            adopt_kernel_choices(json.loads(path.read_text()))
        except (ValueError, TypeError, OSError) as e:
            log.warning("ignoring %s (%s): kernels are timed again", path, e)
    yield
    if path is not None and files is not None:
        choices = json.dumps(kernel_choices(), indent=1, sort_keys=True).encode()
        if not path.exists() or path.read_bytes() != choices:
            files.write_atomic(path, [choices])


def boot_engine(model: str | None = None, *, page_size: int = 16, num_pages: int | None = None,
                kv_memory_gb: float = 2.0, dtype: Any = None, device: Any = None,
                max_step_tokens: int = 1024, progress: bool = True,
                owner_share: float | None = None, weights: str = "fp32",
                kv_dtype: str = "fp32", snapshot_dir: str | Path | None = None,
                disk_cache_gb: float = 4.0, **engine_kw: Any) -> Engine:
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
        snapshot_dir: a folder for durable snapshots and the disk tier (it must exist; the
            engine uses a subfolder named by its model fingerprint). None: snapshots live
            in the pool, for the engine's life (docs/snapshots.md).
        disk_cache_gb: with ``snapshot_dir``, the disk space evicted cache pages (held by
            no snapshot) may take, so prefix matching can load them back.
        **engine_kw: more ``Engine`` settings (``stall_timeout``, ``max_reply_bytes``...).

    Raises:
        InvalidArgument: a size is not positive.
        ModelError: the model cannot be loaded.
        StorageError: ``snapshot_dir`` is missing, read-only, or used by another engine.
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
    if not checks.finite(disk_cache_gb, "disk_cache_gb") >= 0:
        raise InvalidArgument(f"disk_cache_gb must be >= 0, got {disk_cache_gb!r}")

    def build() -> tuple[Any, Any, Any]:
        loaded = load_model(model, dtype=dtype, device=device, progress=progress)
        cfg = loaded.config
        weight = loaded.weights["model.embed_tokens.weight"]
        pages = num_pages or pool_pages_for(cfg, page_size, weight.dtype, kv_memory_gb, kv_dtype)
        files = None
        if snapshot_dir is not None:
            files = PageFiles(snapshot_dir, fingerprint(loaded, page_size, weights, kv_dtype))
        try:
            page_bytes = page_bytes_for(cfg, page_size, weight.dtype, kv_dtype)
            store = PageStore(pages, page_size, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim,
                              dtype=weight.dtype, device=weight.device, kv_dtype=kv_dtype,
                              files=files,
                              max_disk_cache_pages=int(disk_cache_gb * 2**30) // page_bytes)
            calibration = calibration_tokens(loaded.tokenizer) if weights == "int8" else None
            with kernel_choices_kept(files):
                runner = ModelRunner(cfg, loaded.weights, store.pool.kv, page_size,
                                     weight_format=weights, calibration=calibration,
                                     dtype=weight.dtype)
        except BaseException:
            if files is not None:
                files.close()
            raise
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
