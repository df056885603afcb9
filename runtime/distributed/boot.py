"""Rank 0's boot: start the ranks, load the model, build the sharded pool and runner.

Owner: nothing after it returns; the runner owns the group (``ShardedRunner.close`` stops
the workers, and the engine calls it when it stops). ``runtime.boot`` calls
:func:`build_rank0` on the engine's model thread when ``tp > 1``; with ``tp == 1`` nothing
here runs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

from pie_ctx.proto.errors import InvalidArgument
from runtime.distributed.launch import (
    DEFAULT_TIMEOUT,
    WorkerSpec,
    ready,
    send_spec,
    start_ranks,
    threads_per_rank,
)
from runtime.distributed.pool import ShardedPagePool
from runtime.distributed.runner import ShardedRunner
from runtime.distributed.shard import check_tensor_parallel, shard_config
from runtime.kv.pool import PoolShape
from runtime.kv.store import PageStore
from runtime.kv.trie import TrieListener
from runtime.model.kernel_choice import kernel_choices
from runtime.model.loader import load_model

__all__ = ["build_rank0"]


def build_rank0(tp: int, model: str | None, *, page_size: int, pages_for: Callable[[Any, torch.dtype], int],
                kv_dtype: str, weights: str, files_for: Callable[[Any], Any],
                max_disk_cache_pages_for: Callable[[Any, torch.dtype], int],
                kernels_kept: Callable[[Any], AbstractContextManager[None]] = nullcontext,
                dtype: Any = None, device: Any = None, progress: bool = True,
                listeners: Sequence[TrieListener] = (),
                timeout: float = DEFAULT_TIMEOUT) -> tuple[Any, PageStore, ShardedRunner]:
    """Load ``model`` as rank 0 of ``tp`` ranks (the workers are started here).

    Args:
        tp: how many ranks (>= 2).
        model, dtype, device, progress: as ``boot_engine``.
        page_size, kv_dtype: as ``boot_engine``.
        pages_for: ``(config, dtype) -> num_pages`` of the pool (every rank's).
        weights: must be ``"fp32"``.
        files_for: ``loaded model -> PageFiles | None`` (the snapshot directory).
        max_disk_cache_pages_for: ``(config, dtype) -> pages`` the disk cache may hold.
        kernels_kept: ``PageFiles | None -> context manager`` around building the runner that
            adopts the kernel choices saved in the snapshot folder and saves the ones made
            (``runtime.boot.kernel_choices_kept``).
        listeners: the page store's trie listeners (``PageStore``'s ``listeners``).
        timeout: seconds a collective waits for a rank before the engine gives up.

    Returns:
        ``(loaded, store, runner)``.

    Raises:
        InvalidArgument: int8 weights; the model cannot be split into ``tp`` ranks (the
            message names the sizes that work).
        ModelError: the model cannot be loaded, or a worker failed to start.
    """
    if weights != "fp32":
        raise InvalidArgument(f"weights={weights!r} is not supported with tensor parallelism; "
                              "use weights='fp32' (--weights fp32)")
    loaded = load_model(model, dtype=dtype, device=device, progress=progress)
    cfg = loaded.config
    check_tensor_parallel(cfg, tp, loaded.name)  # before any process starts
    weight = loaded.weights["model.embed_tokens.weight"]
    dev = weight.device
    threads = threads_per_rank(tp, dev)
    pages = pages_for(cfg, weight.dtype)
    group = start_ranks(tp, dev, timeout)
    group.threads_before = torch.get_num_threads()
    torch.set_num_threads(threads)
    files = None
    try:
        files = files_for(loaded)
        local = shard_config(cfg, tp)
        pool = ShardedPagePool(group, tp, PoolShape(pages, page_size, cfg.num_layers,
                                                    local.num_kv_heads, cfg.head_dim,
                                                    weight.dtype, dev, kv_dtype))
        with kernels_kept(files):  # the choices saved beside the snapshots, if any
            runner = ShardedRunner(cfg, loaded.weights, pool.kv, page_size, group,
                                   dtype=weight.dtype)
        # every rank computes with rank 0's kernel choices: its shards have the same shapes,
        # and a restarted engine (which adopts the saved ones) rounds exactly as before
        send_spec(group, WorkerSpec(str(loaded.path), loaded.name,
                                    str(weight.dtype).removeprefix("torch."), page_size, pages,
                                    kv_dtype, threads, kernel_choices()))
        ready(group)
        store = PageStore(pages, page_size, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim,
                          dtype=weight.dtype, device=dev, kv_dtype=kv_dtype, files=files,
                          max_disk_cache_pages=max_disk_cache_pages_for(cfg, weight.dtype),
                          pool=pool, listeners=listeners)
    except BaseException:
        if files is not None:
            files.close()
        group.close()
        raise
    return loaded, store, runner
