"""The ranks of one tensor-parallel engine: the per-step broadcast and the collectives.

Owner: rank 0's :class:`RankGroup` is the one sender of commands; each worker's
:class:`WorkerChannel` receives them in order. Both use the default ``torch.distributed``
process group (gloo on CPU, NCCL on CUDA), so one process hosts at most one
tensor-parallel engine.

Protocol: every command is ONE broadcast of a fixed-size byte buffer from rank 0 (a
command larger than the buffer, a long prefill, takes a second broadcast of the rest). A
command carries the page copies queued since the previous one (forks copy working pages
on rank 0 at once and on the workers before the next command, so every rank sees the
same page contents by the time anything reads them) and one of:

* ``step``: a batch (``list[SeqInput]``); then the layers' all-reduces and the lm_head's
  gather, issued alike by every rank;
* ``read`` / ``write``: a page's bytes for the disk tier, gathered to / scattered from
  rank 0 (one collective per page: the tier is rare and off the step path);
* ``noop``: a heartbeat while the engine is idle, so a worker's wait never reaches the
  collective timeout; ``stop``: the workers exit.

Invariants: commands are issued under one lock, so all ranks see them in the same order
whichever rank-0 thread issues them (the model thread steps, the event loop forks and
spills, I/O threads save). Any failure after a command's broadcast (a rank died, timed
out, or raised) desynchronises the ranks: the group is then *lost* for good and every
later call raises :class:`RunnerLost`. The one exception is a batch every rank rejects
alike (``InvalidArgument`` before any collective), which leaves the ranks in step.
"""

from __future__ import annotations

import logging
import pickle
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from pie_ctx.proto.errors import InvalidArgument
from runtime.model.failures import RunnerLost

__all__ = ["CommStats", "RankGroup", "WorkerChannel", "BUFFER_BYTES"]

log = logging.getLogger("pie_ctx.distributed")

BUFFER_BYTES = 16384  # one broadcast carries a decode batch of ~100 contexts
_HEAD = 8  # the payload's length, little-endian


@dataclass(slots=True)
class CommStats:
    """Seconds and bytes rank 0 spent in each kind of collective since boot."""

    seconds: dict[str, float] = field(default_factory=dict)
    nbytes: dict[str, int] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)

    def add(self, kind: str, seconds: float, nbytes: int) -> None:
        self.seconds[kind] = self.seconds.get(kind, 0.0) + seconds
        self.nbytes[kind] = self.nbytes.get(kind, 0) + nbytes
        self.calls[kind] = self.calls.get(kind, 0) + 1

    def total_seconds(self) -> float:
        return sum(self.seconds.values())


class _Buffer:
    """The fixed-size broadcast buffer, on the collective's device."""

    def __init__(self, device: torch.device, nbytes: int = BUFFER_BYTES) -> None:
        self.device = device
        self.tensor = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        self.host = torch.zeros(nbytes, dtype=torch.uint8) if device.type != "cpu" else self.tensor

    def pack(self, data: bytes) -> bytes:
        """Fill the buffer with ``data``'s length and head; returns the rest (may be b"")."""
        n = len(data)
        room = self.host.numel() - _HEAD
        view = self.host.numpy()
        view[:_HEAD] = memoryview(n.to_bytes(_HEAD, "little"))
        first = min(n, room)
        view[_HEAD: _HEAD + first] = memoryview(data)[:first]
        if self.host is not self.tensor:
            self.tensor.copy_(self.host)
        return data[first:]

    def unpack(self) -> tuple[bytes, int]:
        """The head of the payload in the buffer, and how many bytes follow it."""
        if self.host is not self.tensor:
            self.host.copy_(self.tensor)
        raw = self.host.numpy()
        n = int.from_bytes(raw[:_HEAD].tobytes(), "little")
        first = min(n, raw.size - _HEAD)
        return raw[_HEAD: _HEAD + first].tobytes(), n - first


class _Collectives:
    """Timed collectives shared by both sides (stats are kept on rank 0 only)."""

    def __init__(self, device: torch.device, stats: CommStats | None) -> None:
        self.device = device
        self.stats = stats
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.count = 0  # collectives issued (rank 0 tells a clean rejection from a loss)

    def _timed(self, kind: str, nbytes: int, fn: Callable[[], Any]) -> None:
        self.count += 1
        if self.stats is None:
            fn()
            return
        t0 = time.perf_counter()
        fn()
        self.stats.add(kind, time.perf_counter() - t0, nbytes)

    def all_reduce(self, t: torch.Tensor) -> None:
        """Sum ``t`` over the ranks, in place (after o_proj and down)."""
        self._timed("all_reduce", t.numel() * t.element_size(), lambda: dist.all_reduce(t))

    def gather(self, t: torch.Tensor, parts: list[torch.Tensor] | None) -> None:
        """Every rank's ``t`` into rank 0's ``parts`` (rank order)."""
        self._timed("gather", t.numel() * t.element_size() * self.world,
                    lambda: dist.gather(t, parts if self.rank == 0 else None, dst=0))

    def scatter(self, out: torch.Tensor, parts: list[torch.Tensor] | None) -> None:
        """Rank 0's ``parts[r]`` into rank r's ``out``."""
        self._timed("scatter", out.numel() * out.element_size() * self.world,
                    lambda: dist.scatter(out, parts if self.rank == 0 else None, src=0))

    def broadcast(self, t: torch.Tensor, kind: str = "broadcast") -> None:
        self._timed(kind, t.numel() * t.element_size(), lambda: dist.broadcast(t, src=0))


class RankGroup(_Collectives):
    """Rank 0's side: issues commands, queues page copies, notices a lost rank.

    Args:
        device: the device collectives run on (the pool's).
        heartbeat: seconds of idleness after which a ``noop`` command goes out (keep it well
            under the process group's timeout).
        processes: the worker processes this rank started (killed when the group is lost
            or closed); empty under ``torchrun``.
    """

    def __init__(self, device: torch.device, *, heartbeat: float = 10.0,
                 processes: Sequence[Any] = ()) -> None:
        super().__init__(device, CommStats())
        self._buffer = _Buffer(device)
        self._lock = threading.Lock()
        self._copies_lock = threading.Lock()
        self._copies: list[tuple[int, int]] = []
        self._last = time.monotonic()
        self.processes = list(processes)
        self.lost: RunnerLost | None = None
        self.num_steps = 0
        # rank 0 shares the process with others: the thread count it had before the ranks
        # split the cores, put back on close (torch.set_num_threads is process-wide)
        self.threads_before: int | None = None
        self._stopped = threading.Event()
        self._heartbeat = threading.Thread(target=self._beat, args=(heartbeat,), daemon=True,
                                           name="pie-ctx-tp-heartbeat")
        self._heartbeat.start()

    # ------------------------------------------------------------------ commands

    def queue_copies(self, dst: Sequence[int], src: Sequence[int]) -> None:
        """Page copies the workers apply before the next command (rank 0 copied already)."""
        with self._copies_lock:
            self._copies.extend(zip((int(d) for d in dst), (int(s) for s in src), strict=True))

    @contextmanager
    def command(self, kind: str, payload: Any = None) -> Iterator[None]:
        """Broadcast one command, then run the body (rank 0's share of it) under the lock.

        Raises:
            RunnerLost: the group was lost before, or is lost now (any failure after the
                broadcast, except a clean rejection of the batch by every rank).
        """
        with self._lock:
            if self.lost is not None:
                raise self.lost
            with self._copies_lock:
                copies, self._copies = self._copies, []
            sent = -1
            try:
                self._send((kind, copies, payload))
                sent = self.count
                yield
            except InvalidArgument:
                if self.count == sent and kind == "step":  # only the broadcast ran:
                    raise  # every rank rejected the same batch before any collective
                self.lose("a rank failed mid-command")
                raise self.lost from None  # type: ignore[misc]
            except RunnerLost:
                raise
            except Exception as err:
                self.lose(f"{type(err).__name__}: {err}")
                raise self.lost from err  # type: ignore[misc]
            finally:
                self._last = time.monotonic()

    def _send(self, obj: Any) -> None:
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        rest = self._buffer.pack(data)
        self.broadcast(self._buffer.tensor)
        if rest:  # a command larger than the buffer: the rest in a second broadcast
            extra = torch.frombuffer(bytearray(rest), dtype=torch.uint8).to(self.device)
            self.broadcast(extra, "broadcast_extra")

    def lose(self, why: str) -> None:
        """Mark the group lost (once) and end the workers this rank started."""
        if self.lost is None:
            self.lost = RunnerLost(f"a tensor-parallel rank was lost ({why}); the engine "
                                   "cannot run the model any more: restart it")
            log.error("%s", self.lost)
            self._kill()

    def stop(self, timeout: float = 5.0) -> None:
        """Tell the workers to exit (best effort: a lost group has nothing to tell)."""
        self._stopped.set()
        if not self._lock.acquire(timeout=timeout):
            self.lose("the engine stopped while a step was running")
            return
        try:
            if self.lost is None:
                try:
                    self._send(("stop", [], None))
                except Exception as err:  # noqa: BLE001 - stopping anyway
                    log.warning("could not tell the workers to stop: %s", err)
                self.lost = RunnerLost("the engine stopped")
        finally:
            self._lock.release()

    def close(self) -> None:
        """Stop the workers and leave the process group (another engine may start)."""
        self.stop()
        self._kill(grace=5.0)
        if self.threads_before is not None:
            torch.set_num_threads(self.threads_before)
            self.threads_before = None
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception as err:  # noqa: BLE001 - leaving anyway
                log.warning("destroy_process_group: %s", err)

    def _kill(self, grace: float = 0.0) -> None:
        """End the worker processes this rank started (they exit by themselves after a
        ``stop``; a lost one may hang in a collective)."""
        for p in self.processes:
            try:
                p.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                pass
            if p.poll() is None:
                p.kill()
        for p in self.processes:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                log.error("tensor-parallel worker %d did not exit", p.pid)

    def _beat(self, period: float) -> None:
        while not self._stopped.wait(period / 4):
            if self.lost is not None:
                return
            if time.monotonic() - self._last < period or not self._lock.acquire(blocking=False):
                continue
            self._lock.release()
            try:
                with self.command("noop"):
                    pass
            except RunnerLost:
                return


class WorkerChannel(_Collectives):
    """A worker's side: receives rank 0's commands in order."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(device, None)
        self._buffer = _Buffer(device)

    def receive(self) -> tuple[str, list[tuple[int, int]], Any]:
        """Wait for the next command: ``(kind, page copies, payload)``."""
        self.broadcast(self._buffer.tensor)
        head, more = self._buffer.unpack()
        if more:
            extra = torch.empty(more, dtype=torch.uint8, device=self.device)
            self.broadcast(extra)
            head += extra.cpu().numpy().tobytes()
        return pickle.loads(head)
