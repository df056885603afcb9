"""Starting the ranks: spawn the workers (or attach to ``torchrun``'s), and a worker's loop.

Owner: rank 0's :func:`start_ranks` owns the worker processes it spawns (it kills them when
the group is lost or stopped); under ``torchrun`` the launcher owns them and they exit by
themselves when rank 0 stops or dies (their next collective fails).

Two ways in, one protocol:

* ``boot_engine(tp=N)`` in a plain process starts ranks 1..N-1 as subprocesses
  (``python -m runtime.distributed.worker``: nothing of the caller's main module is
  re-imported) and meets them over a TCP store on 127.0.0.1; a worker that exits before
  it joins fails the boot at once;
* under ``torchrun --nproc-per-node N`` every rank runs ``python -m runtime <pie-ctx
  args>``: rank 0 runs the command line (which boots with ``--tensor-parallel N`` and
  attaches, ``env://``); on the others the command line calls :func:`worker_main`.

Either way rank 0 then broadcasts a :class:`WorkerSpec` (model folder, dtype, pool size),
each worker loads and shards the model, builds its pool slice, and a barrier says every
rank is ready. Backends: gloo on CPU, NCCL on CUDA (rank r on ``cuda:LOCAL_RANK``).
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from pie_ctx.proto.errors import InvalidArgument, ModelError
from runtime.distributed.group import RankGroup, WorkerChannel
from runtime.distributed.pool import apply_copies
from runtime.distributed.runner import ShardedRunner
from runtime.distributed.shard import check_tensor_parallel, shard_config

__all__ = ["WorkerSpec", "ready", "send_spec", "start_ranks", "worker_main", "under_torchrun", "DEFAULT_TIMEOUT"]

log = logging.getLogger("pie_ctx.distributed")

DEFAULT_TIMEOUT = 60.0  # seconds a collective may wait for a rank before the group is lost


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """What a worker needs to build its shard (broadcast by rank 0)."""

    model_path: str  # the resolved model folder (no fetch or conversion on workers)
    model_name: str
    dtype: str  # e.g. "float32"
    page_size: int
    num_pages: int
    kv_dtype: str
    threads: int  # torch threads per rank (CPU: the cores shared out)
    kernel_choices: dict[str, list[Any]]  # rank 0's (runtime.model.matmul): every rank alike


def under_torchrun() -> bool:
    """Whether this process is one of ``torchrun``'s ranks."""
    return "TORCHELASTIC_RUN_ID" in os.environ or (
        "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ)


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def threads_per_rank(tp: int, device: torch.device) -> int:
    """CPU ranks share the machine's cores; a GPU rank needs few."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) // tp) if device.type == "cpu" else 1


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_ranks(tp: int, device: torch.device, timeout: float = DEFAULT_TIMEOUT,
                ) -> RankGroup:
    """Become rank 0 of ``tp`` ranks: spawn the others (or attach to ``torchrun``'s).

    Call :meth:`RankGroup.command`-free setup next: broadcast the spec with
    :func:`send_spec`, build rank 0's shard, then :func:`ready`.

    Raises:
        InvalidArgument: a process group exists already (one tensor-parallel engine per
            process), or ``torchrun`` started a different number of ranks, or this is not
            its rank 0.
    """
    if dist.is_initialized():
        raise InvalidArgument("this process already runs a tensor-parallel engine (one per "
                              "process: torch.distributed has one default group)")
    backend = backend_for(device)
    wait = timedelta(seconds=timeout)
    processes: list[Any] = []
    if under_torchrun():
        world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
        if world != tp or rank != 0:
            raise InvalidArgument(f"torchrun started rank {rank} of {world}; --tensor-parallel "
                                  f"{tp} needs {tp} ranks, and boots on rank 0 only (workers "
                                  "run the worker loop: torchrun ... -m runtime ARGS)")
        dist.init_process_group(backend, init_method="env://", world_size=tp, rank=0,
                                timeout=wait)
    else:
        port = _free_port()
        store = dist.TCPStore("127.0.0.1", port, tp, is_master=True, timeout=wait,
                              wait_for_workers=False)
        for rank in range(1, tp):
            processes.append(subprocess.Popen(
                [sys.executable, "-m", "runtime.distributed.worker", str(rank), str(tp),
                 str(port), device.type, str(timeout)]))
        try:
            _wait_joined(store, processes, timeout)
            dist.init_process_group(backend, store=store, world_size=tp, rank=0, timeout=wait)
        except BaseException:
            for p in processes:
                p.kill()
            raise
    return RankGroup(device, heartbeat=max(1.0, timeout / 4), processes=processes)


def _wait_joined(store: Any, processes: list[Any], timeout: float) -> None:
    """Until every worker has reached the store; a worker that exits first fails the boot.

    Raises:
        ModelError: a worker exited, or none came within ``timeout``.
    """
    deadline = time.monotonic() + timeout
    while store.add("joined", 0) < len(processes):
        for p in processes:
            if p.poll() is not None:
                raise ModelError(f"a tensor-parallel worker exited with code {p.returncode} "
                                 "before it started (its log above says why)")
        if time.monotonic() > deadline:
            raise ModelError(f"tensor-parallel workers did not start within {timeout:.0f} s")
        time.sleep(0.05)


def send_spec(group: RankGroup, spec: WorkerSpec) -> None:
    """Rank 0: tell the workers what to build (before the first command)."""
    dist.broadcast_object_list([spec], src=0,
                               device=group.device if group.device.type == "cuda" else None)


def ready(group: RankGroup) -> None:
    """Rank 0: wait until every worker built its shard.

    Raises:
        ModelError: a worker failed to start (its log says why).
    """
    try:
        dist.barrier()
    except Exception as err:  # noqa: BLE001 - any failure here is a worker that died
        group.lose(f"a worker failed to start: {err}")
        group.close()
        raise ModelError(f"a tensor-parallel worker failed to start ({err}); see its log "
                         "above") from None


def worker_main(rank: int | None = None, tp: int | None = None, port: int | None = None,
                device_type: str = "cpu", timeout: float = DEFAULT_TIMEOUT) -> int:
    """A worker rank: join, build the shard rank 0 describes, serve commands until ``stop``.

    With no arguments it joins the ``torchrun`` ranks (``env://``). Returns the exit code.
    """
    from runtime.model.kernel_choice import adopt_kernel_choices
    from runtime.model.loader import load_model

    logging.basicConfig(level=logging.WARNING, format=f"pie-ctx rank {rank}: %(message)s")
    wait = timedelta(seconds=timeout)
    if rank is None:  # under torchrun
        rank, tp = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    assert tp is not None
    device = torch.device(device_type)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
    if port is None:
        dist.init_process_group(backend_for(device), init_method="env://", world_size=tp,
                                rank=rank, timeout=wait)
    else:
        store = dist.TCPStore("127.0.0.1", port, tp, is_master=False, timeout=wait)
        store.add("joined", 1)
        dist.init_process_group(backend_for(device), store=store, world_size=tp, rank=rank,
                                timeout=wait)
    try:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, device=device if device.type == "cuda" else None)
        spec: WorkerSpec = box[0]
        torch.set_num_threads(spec.threads)
        adopt_kernel_choices(spec.kernel_choices)
        loaded = load_model(spec.model_path, dtype=spec.dtype, device=device, progress=False)
        cfg = loaded.config
        check_tensor_parallel(cfg, tp, spec.model_name)
        local = shard_config(cfg, tp)
        from runtime.kv.pool import PagePool, PoolShape

        pool = PagePool(PoolShape(spec.num_pages, spec.page_size, cfg.num_layers,
                                  local.num_kv_heads, cfg.head_dim,
                                  loaded.weights["model.embed_tokens.weight"].dtype, device,
                                  spec.kv_dtype))
        comm = WorkerChannel(device)
        runner = ShardedRunner(cfg, loaded.weights, pool.kv, spec.page_size, comm,
                               dtype=pool.dtype)
        del loaded
        dist.barrier()
        _serve(runner, pool.kv, comm)
        return 0
    except Exception as err:  # noqa: BLE001 - logged; rank 0 sees the rank go
        log.error("worker failed: %s: %s", type(err).__name__, err)
        return 1
    finally:
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001, S110 - exiting
            pass


def _serve(runner: ShardedRunner, kv: torch.Tensor, comm: WorkerChannel) -> None:
    """Apply rank 0's commands until ``stop`` (a failed collective raises out)."""
    while True:
        kind, copies, payload = comm.receive()
        if copies:
            apply_copies(kv, copies)
        if kind == "step":
            batch, return_hidden = payload
            try:
                runner.forward_shard(batch, return_hidden=return_hidden)
            except InvalidArgument:
                pass  # rank 0 rejected the same batch before any collective
        elif kind == "read":
            comm.gather(kv[payload].contiguous(), None)
        elif kind == "write":
            out = torch.empty_like(kv[payload])
            comm.scatter(out, None)
            kv[payload].copy_(out)
        elif kind == "stop":
            return
        elif kind != "noop":
            raise RuntimeError(f"unknown command {kind!r} from rank 0")
