"""Build an engine from a model reference: load the model, size the pool, wire the runner.

Owns nothing after it returns; the engine owns what it builds. The arrow points one way:
boot imports the engine and ``runtime.distributed``; neither imports boot (docs/design.md).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import xxhash

from pie_ctx.proto import checks
from pie_ctx.proto.errors import InvalidArgument, ModelError
from runtime import DETERMINISTIC
from runtime.distributed.boot import build_rank0
from runtime.engine.engine import Engine
from runtime.engine.step_share import check_decode_share
from runtime.kv.disk import PageFiles
from runtime.kv.file_format import Fingerprint
from runtime.kv.layout import KV_DTYPES, entry_bytes
from runtime.kv.store import PageStore
from runtime.model.config import ModelConfig
from runtime.model.kernel_choice import adopt_kernel_choices, kernel_choices
from runtime.model.loader import (
    gguf_blocks_source,
    gguf_source,
    load_blocks,
    load_model,
    resolve_device,
    resolve_model,
)
from runtime.model.loader.hf import read_config
from runtime.model.numerics import Numerics
from runtime.model.quant import WEIGHT_FORMATS, calibration_tokens
from runtime.model.runner import ModelRunner
from runtime.model.transformers_backend import TransformersRunner, load_transformers_model

log = logging.getLogger("pie_ctx.engine")

BACKENDS = ("native", "transformers", "auto")


def default_weights(kind: str, model: str | None, device: Any, tp: int, *,
                    progress: bool = True) -> str:
    """What ``weights="auto"`` (``run`` and ``serve``'s default) means for this engine:
    ``"gguf"`` for a model pie-ctx read from a GGUF (Llama, Qwen2, Qwen3: whose blocks it
    computes on) on the native backend, on CPU, on one rank (the
    file's own weights, and the fastest on CPU: docs/performance.md), else ``"fp32"``."""
    if kind != "native" or tp != 1 or resolve_device(device).type != "cpu":
        return "fp32"
    _, folder = resolve_model(model, progress=progress)
    return "gguf" if gguf_blocks_source(folder) is not None else "fp32"


def default_kv_dtype(weights: str) -> str:
    """What ``kv_dtype="auto"`` (``run`` and ``serve``'s default) means: ``"bf16"`` pages
    beside the GGUF's own blocks (``weights="gguf"``, CPU only), as llama.cpp keeps an f16
    KV cache beside them: +0.01% perplexity, and an 8-row step at 400 tokens 17.6 against
    27.5-30.6 ms on fp32 pages (docs/performance.md); else ``"fp32"``, whose pages hold
    exactly what the fp32 oracle computes."""
    return "bf16" if weights == "gguf" else "fp32"


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


def fingerprint(name: str, folder: Path, dtype: torch.dtype, shape: Any, page_size: int,
                weights: str, kv_dtype: str, backend: str = "native") -> Fingerprint:
    """What decides this engine's KV bytes: its model files (hashed), formats, shapes and
    the runner (two backends round differently). Snapshots are shared only between
    engines with equal fingerprints.

    Args:
        shape: has ``num_layers``, ``num_kv_heads`` and ``head_dim`` (a model config).
    """
    digest = xxhash.xxh3_128()
    source = gguf_source(Path(folder))  # a GGUF's weights are read from the file itself
    for path in sorted(Path(folder).iterdir()) + ([source] if source is not None else []):
        if path.suffix in (".safetensors", ".gguf", ".bin") or path.name == "config.json":
            digest.update(path.name.encode())
            with open(path, "rb") as f:
                while chunk := f.read(1 << 24):
                    digest.update(chunk)
    return Fingerprint(model=name, weights_digest=digest.hexdigest(), weights=weights,
                       dtype=str(dtype).removeprefix("torch."), kv_dtype=kv_dtype,
                       page_size=page_size, num_layers=shape.num_layers,
                       num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim,
                       backend=backend)


def choose_backend(backend: str, model: str | None, *, progress: bool = True) -> str:
    """``"native"`` or ``"transformers"`` for ``model`` (``backend``: native, transformers
    or auto: native when its runner has the model's architecture and options, else
    transformers; the choice is logged)."""
    if backend not in BACKENDS:
        raise InvalidArgument(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend != "auto":
        return backend
    name, folder = resolve_model(model, progress=progress)
    try:
        ModelConfig.from_hf_config(read_config(folder))
    except ModelError as e:
        log.info("model %s: the transformers backend (the native runner cannot: %s)", name, e)
        return "transformers"
    log.info("model %s: the native backend", name)
    return "native"


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
                owner_share: float | None = None, hold_share: float = 0.25,
                weights: str = "fp32",
                kv_dtype: str = "fp32", snapshot_dir: str | Path | None = None,
                disk_cache_gb: float = 4.0, backend: str = "auto", tp: int = 1,
                shared_snapshots: bool = False, kv_events: str | None = None,
                kv_events_replay: str | None = None, deterministic: bool = DETERMINISTIC,
                **engine_kw: Any) -> Engine:
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
        hold_share: the fraction of the pool one owner's holds (``Context.retain``) may
            cover together, in (0, 1] (docs/pages.md, "Holds").
        weights: ``"fp32"`` (unquantized, in ``dtype``), ``"int8"`` (smoothed int8
            projections, CPU; see docs/models.md) or ``"gguf"`` (CPU: the projections,
            lm_head and embedding on the GGUF's own Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0
            blocks, bit for bit the file's weights; an HF folder gets Q4_1 blocks made at
            load; see
            docs/performance.md); ``"auto"`` (``run`` and ``serve``'s default): ``"gguf"``
            for a model read from a GGUF on CPU, else ``"fp32"`` (:func:`default_weights`).
        kv_dtype: ``"fp32"`` (KV pages unquantized, in ``dtype``), ``"int8"`` (int8 entries
            with a scale per token and KV head: 3.8x the pages in the same memory at head dim
            64), ``"bf16"`` (entries rounded to bfloat16: 2x the pages; see docs/forward.md)
            or ``"auto"`` (``run`` and ``serve``'s default): ``"bf16"`` with ``"gguf"``
            weights, else ``"fp32"`` (:func:`default_kv_dtype`).
        snapshot_dir: a folder for durable snapshots and the disk tier (it must exist; the
            engine uses a subfolder named by its model fingerprint). None: snapshots live
            in the pool, for the engine's life (docs/snapshots.md).
        disk_cache_gb: with ``snapshot_dir``, the disk space evicted cache pages (held by
            no snapshot) may take, so prefix matching can load them back.
        backend: ``"native"`` (pie-ctx's own layers: Llama, Qwen2, Qwen3), ``"transformers"``
            (transformers' model class over the same pages: any causal LM it loads) or
            ``"auto"``: native when it can run the model, else transformers (logged; see
            docs/models.md).
        tp: tensor-parallel ranks: this process is rank 0 and starts the other ``tp - 1``
            (or attaches to ``torchrun``'s); weights and KV pages are sharded by head
            (docs/scale-out.md). 1: one device, nothing else starts.
        shared_snapshots: ``snapshot_dir`` is shared with other engines of the same model
            (a fleet, docs/scale-out.md): no engine deletes page files, and a snapshot
            another engine saved opens here. False: the folder is this engine's alone.
        kv_events: publish the trie's commits and evictions in vLLM's KV-event schema on
            this ZeroMQ address (``tcp://*:5557`` binds; ``runtime.kv.events``); the
            publisher is ``engine.kv_events``. None: no events.
        kv_events_replay: with ``kv_events``, a ROUTER address answering replay requests.
        deterministic: batch-invariant numerics, the default: the same seed gives the same
            tokens whatever else is batched, however the prompt was chunked and whatever
            came from the cache (docs/performance.md "Deterministic numerics"). False:
            the fastest kernels, whose row results may differ in the last bits with the
            batch. Honoured by the native runner on one CPU; ``EngineInfo.deterministic``
            says whether it is in force.
        **engine_kw: more ``Engine`` settings (``stall_timeout``, ``max_reply_bytes``...).

    Raises:
        InvalidArgument: a size is not positive; an unknown backend; int8 weights on the
            transformers backend.
        ModelError: the model cannot be loaded (on the backend asked for).
        StorageError: ``snapshot_dir`` is missing, read-only, or used by another engine.
    """
    checks.positive(page_size, "page_size")
    if num_pages is not None:
        checks.positive(num_pages, "num_pages")
    if not checks.finite(kv_memory_gb, "kv_memory_gb") > 0:
        raise InvalidArgument(f"kv_memory_gb must be > 0, got {kv_memory_gb!r}")
    checks.positive(max_step_tokens, "max_step_tokens")
    if weights not in (*WEIGHT_FORMATS, "auto"):
        raise InvalidArgument(f"weights must be one of {', '.join(WEIGHT_FORMATS)} or auto, "
                              f"got {weights!r}")
    if kv_dtype not in (*KV_DTYPES, "auto"):
        raise InvalidArgument(f"kv_dtype must be one of {', '.join(KV_DTYPES)} or auto, "
                              f"got {kv_dtype!r}")
    if not 0 < checks.finite(hold_share, "hold_share") <= 1:
        raise InvalidArgument(f"hold_share must be in (0, 1], got {hold_share!r}")
    if owner_share is not None and not 0 < checks.finite(owner_share, "owner_share") <= 1:
        raise InvalidArgument(f"owner_share must be in (0, 1], got {owner_share!r}")
    if not checks.finite(disk_cache_gb, "disk_cache_gb") >= 0:
        raise InvalidArgument(f"disk_cache_gb must be >= 0, got {disk_cache_gb!r}")
    if "decode_share" in engine_kw:  # before the model loads, as every size here
        check_decode_share(engine_kw["decode_share"])

    kind = choose_backend(backend, model, progress=progress)
    # One line each, whether chosen or given (`-v` shows what the engine runs on).
    asked_weights, asked_kv = weights, kv_dtype
    if weights == "auto":
        weights = default_weights(kind, model, device, tp, progress=progress)
    if kv_dtype == "auto":
        kv_dtype = default_kv_dtype(weights)
    log.info("weights: %s%s", weights, " (weights='auto')" if asked_weights == "auto" else "")
    log.info("KV pages: %s%s", kv_dtype, " (kv_dtype='auto')" if asked_kv == "auto" else "")
    if kind == "transformers" and weights != "fp32":
        raise InvalidArgument(
            f"weights={weights!r} is a format of the native runner; the transformers backend "
            "runs the checkpoint's weights in dtype: use weights='fp32' (--weights fp32), or "
            "a model the native backend runs (docs/models.md)")

    if tp != 1 and kind == "transformers":
        raise InvalidArgument("tensor parallelism runs on the native backend; use "
                              "backend='native' or tp=1 (docs/scale-out.md)")

    def files_for(m: _Model, runner_kind: str) -> PageFiles | None:
        if snapshot_dir is None:
            return None
        return PageFiles(snapshot_dir, fingerprint(m.name, m.path, m.dtype, m.shape, page_size,
                                                   weights, kv_dtype, runner_kind),
                         shared=shared_snapshots)

    event_log = None  # the trie's listener behind --kv-events, given to the store
    if kv_events is not None:
        from runtime.kv.events import KVEventLog

        event_log = KVEventLog(page_size,
                               "GPU" if resolve_device(device).type == "cuda" else "CPU")
    listeners = () if event_log is None else (event_log,)

    def build() -> tuple[_Model, Any, Any]:
        if tp != 1:  # rank 0 of tp ranks, pages sharded by KV head (runtime.distributed)
            return _build_rank0()
        m, make_runner = _load(kind, model, deterministic, weights, dtype=dtype,
                               device=device, progress=progress)
        pages = num_pages or pool_pages_for(m.shape, page_size, m.dtype, kv_memory_gb, kv_dtype)
        files = files_for(m, kind)
        try:
            page_bytes = page_bytes_for(m.shape, page_size, m.dtype, kv_dtype)
            store = PageStore(pages, page_size, m.shape.num_layers, m.shape.num_kv_heads,
                              m.shape.head_dim, dtype=m.dtype, device=m.device,
                              kv_dtype=kv_dtype, files=files,
                              max_disk_cache_pages=int(disk_cache_gb * 2**30) // page_bytes,
                              listeners=listeners)
            with kernel_choices_kept(files):
                runner = make_runner(store.pool.kv, page_size, weights)
        except BaseException:
            if files is not None:
                files.close()
            raise
        return m, store, runner

    def _build_rank0() -> tuple[_Model, Any, Any]:
        loaded, store, runner = build_rank0(
            tp, model, page_size=page_size, kv_dtype=kv_dtype, weights=weights, dtype=dtype,
            device=device, progress=progress, listeners=listeners,
            files_for=lambda lm: files_for(_Model.native(lm), "native"),
            pages_for=lambda cfg, dt: num_pages or pool_pages_for(cfg, page_size, dt,
                                                                  kv_memory_gb, kv_dtype),
            max_disk_cache_pages_for=lambda cfg, dt: int(disk_cache_gb * 2**30)
            // page_bytes_for(cfg, page_size, dt, kv_dtype), kernels_kept=kernel_choices_kept)
        return _Model.native(loaded), store, runner

    # Load on the thread that will run every model step (see Engine: one OpenMP team).
    # Engines of one process may share theirs (``model_thread=``: the benchmarks do).
    thread = engine_kw.pop("model_thread", None) or ThreadPoolExecutor(
        max_workers=1, thread_name_prefix="pie-ctx-model")
    try:
        m, store, runner = thread.submit(build).result()
    except BaseException:
        thread.shutdown(wait=False)
        raise
    store.holds.max_pages_per_owner = max(1, int(hold_share * store.num_pages_total))
    if owner_share is not None:
        engine_kw["max_pages_per_owner"] = max(1, int(owner_share * store.num_pages_total))
    engine = Engine(store, runner, m.tokenizer, model_name=m.name, vocab_size=m.vocab_size,
                    max_seq_len=m.max_seq_len, hidden_size=m.hidden_size,
                    max_step_tokens=max_step_tokens, model_thread=thread, **engine_kw)
    if event_log is not None:
        from runtime.kv.events import ZmqEventPublisher

        engine.kv_events = ZmqEventPublisher(event_log, kv_events, kv_events_replay)
    return engine


@dataclass(slots=True)
class _Model:
    """A loaded model as boot needs it, from either backend."""

    name: str
    path: Path
    tokenizer: Any
    shape: Any  # num_layers, num_kv_heads, head_dim
    dtype: torch.dtype
    device: torch.device
    vocab_size: int
    hidden_size: int
    max_seq_len: int

    @classmethod
    def native(cls, loaded: Any) -> _Model:
        """The facts of a ``LoadedModel`` (the native loader's)."""
        cfg = loaded.config
        return cls(loaded.name, loaded.path, loaded.tokenizer, cfg, loaded.dtype, loaded.device,
                   cfg.vocab_size, cfg.hidden_size, cfg.max_position_embeddings)


# (pool_kv, page_size, weights) -> the runner
MakeRunner = Callable[[torch.Tensor, int, str], Any]


def _load(kind: str, model: str | None, deterministic: bool, weights: str,
          **load_kw: Any) -> tuple[_Model, MakeRunner]:
    """Load ``model`` for the ``kind`` backend (on the model thread); returns its facts and
    how to build its runner over a pool (``deterministic``, ``weights``: see
    ``boot_engine``). With ``weights="gguf"`` a GGUF's matrices are read in place, as
    block weights on the memory-mapped file (``load_model(blocks=True)``): no float copy
    of them is ever made."""
    if kind == "transformers":
        if deterministic:
            log.info("model %s: the transformers backend runs transformers' kernels; "
                     "its numerics may depend on the batch (EngineInfo.deterministic=False)",
                     model)
        hf = load_transformers_model(model, **load_kw)
        return (_Model(hf.name, hf.path, hf.tokenizer, hf, hf.dtype, hf.device, hf.vocab_size,
                       hf.hidden_size, hf.max_positions),
                lambda pool, page_size, _weights: TransformersRunner(hf, pool, page_size))
    loaded = load_model(model, blocks=weights == "gguf", **load_kw)
    m = _Model.native(loaded)
    in_place = weights == "gguf" and gguf_blocks_source(loaded.path) is not None

    def make_runner(pool: torch.Tensor, page_size: int, weights: str) -> ModelRunner:
        calibration = (calibration_tokens(loaded.tokenizer) if weights in ("int8", "gguf")
                       else None)  # gguf: blocks_q8's outlier channels
        # {}: the weights hold the file's blocks already; None: an HF folder, quantized now
        blocks = ({} if in_place else load_blocks(loaded.path)) if weights == "gguf" else None
        numerics = Numerics.decide(pool.device, m.dtype, deterministic=deterministic,
                                   weight_format=weights)
        return ModelRunner(loaded.config, loaded.weights, pool, page_size,
                           calibration=calibration, blocks=blocks, numerics=numerics)

    return m, make_runner
