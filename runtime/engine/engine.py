"""The engine: one narrow async request interface over the page store and the model.

Owns: the page store (pool, trie, contexts, snapshots), the model runner (through the step
executor), the scheduler and its loop, and the table of public context handles. The SDK and
the server both talk to it with the plain-data messages of ``pie_ctx.protocol``:

    reply = await engine.handle(request, owner=..., namespace=...)
    async for message in engine.generate(request, ...): ...

Every ``PieError`` comes back as an ``ErrorReply`` (``raise_errors=True`` raises instead)
and changes nothing. Requests on one context are serialized by that context's lock; requests
on different contexts run concurrently and their model work shares each step's model call.

Usage::

    async with Engine.boot(model=None, page_size=16) as engine:
        reply = await engine.handle(CreateContext())
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import anyio
import numpy as np

from pie_ctx import protocol as P
from pie_ctx.concurrency import single_exception
from pie_ctx.errors import (
    ContextClosed,
    InvalidArgument,
    OutOfPages,
    PieError,
)
from runtime.engine.executor import StepExecutor
from runtime.engine.jobs import Job
from runtime.engine.passes import PassesMixin
from runtime.engine.scheduler import Scheduler
from runtime.engine.validate import check_count
from runtime.kv.snapshots import DEFAULT_NAMESPACE

__all__ = ["Engine", "ContextRecord"]


@dataclass(slots=True, eq=False)
class ContextRecord:
    """A public context handle: which store context it is now, who owns it, its lock."""

    handle: int
    cid: Any  # store ContextId; replaced when a job's shadow is swapped in
    owner: Any
    # A semaphore, not a lock: a generation takes it in the caller's task and the engine
    # loop gives it back when the job ends.
    lock: anyio.Semaphore = field(default_factory=lambda: anyio.Semaphore(1))
    # Logits of the last token written, so generate() can start right after a flush.
    last_logits: np.ndarray | None = None


class Engine(PassesMixin):
    """Continuous-batching engine over one model and one page store.

    Args:
        store: the ``PageStore``.
        runner: anything with ``forward(list[SeqInput]) -> Tensor[rows, vocab]``.
        tokenizer: decodes generated text (``decode``, ``encode``, ``stop_token_ids``).
        model_name, vocab_size, max_seq_len: reported in ``EngineInfo``; ``max_seq_len``
            bounds positions.
        max_step_tokens: token budget of one model call (prefill chunks + decodes).
        stall_timeout: seconds a request waiting for pages that only a release elsewhere can
            free keeps waiting before it fails with ``OutOfPages``.
        model_thread: the single-thread executor every model step runs on (``boot`` passes
            the one that loaded the model); shut down when the engine exits.
    """

    def __init__(
        self,
        store: Any,
        runner: Any,
        tokenizer: Any,
        *,
        model_name: str = "model",
        vocab_size: int,
        max_seq_len: int,
        max_step_tokens: int = 1024,
        stall_timeout: float = 5.0,
        model_thread: ThreadPoolExecutor | None = None,
    ) -> None:
        self.store = store
        self.tokenizer = tokenizer
        self.executor = StepExecutor(runner)
        self.scheduler = Scheduler(store, max_step_tokens=max_step_tokens)
        self.model_name = model_name
        self.vocab_size = vocab_size
        self.max_seq_len = max_seq_len
        self.stall_timeout = stall_timeout
        self.stop_token_ids: list[int] = sorted(getattr(tokenizer, "stop_token_ids", []) or [])
        self._records: dict[int, ContextRecord] = {}
        self._next_handle = 1
        self._next_job = 1
        self._wake = anyio.Event()
        self._gc_queue: deque[int] = deque()  # handles whose SDK object was collected
        self._task_group: Any = None
        # Every model step runs on this one thread (the one that loaded the model, when
        # booted). torch's OpenMP team is per calling thread, and once a second thread has
        # run a parallel region every step is ~25% slower on 2 cores (measured), so torch
        # work stays on this thread and the event loop only does bookkeeping.
        self._model_thread = model_thread or ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="pie-ctx-model")
        # Per snapshot: the last logits (see ContextRecord) and the SDK's opaque meta.
        self._snapshot_extra: dict[tuple[str, str], tuple[np.ndarray | None, str]] = {}
        self.model_seconds = 0.0
        self.scheduler_seconds = 0.0
        self.num_tokens_computed = 0
        self.num_pages_reused = 0
        self.num_pages_computed = 0

    # ------------------------------------------------------------------------ lifecycle

    @classmethod
    def boot(cls, model: str | None = None, *, page_size: int = 16, num_pages: int | None = None,
             kv_memory_gb: float = 2.0, dtype: Any = None, device: Any = None,
             max_step_tokens: int = 1024, progress: bool = True) -> Engine:
        """Load a model and build an engine around it (see ``runtime.engine.boot``)."""
        from runtime.engine.boot import boot_engine

        return boot_engine(model, page_size=page_size, num_pages=num_pages,
                           kv_memory_gb=kv_memory_gb, dtype=dtype, device=device,
                           max_step_tokens=max_step_tokens, progress=progress)

    async def __aenter__(self) -> Engine:
        self._task_group = anyio.create_task_group()
        await self._task_group.__aenter__()
        self._task_group.start_soon(self._loop)
        return self

    async def __aexit__(self, *exc: Any) -> bool | None:
        self._task_group.cancel_scope.cancel()
        try:
            return await self._task_group.__aexit__(*exc)
        except BaseExceptionGroup as group:
            raise single_exception(group) from None
        finally:
            self._model_thread.shutdown(wait=False, cancel_futures=True)

    def run_on_model_thread(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` on the thread that runs the model, and wait for it (blocking).

        Other torch work in the same process (a baseline model in a benchmark, custom
        tensor code) belongs there too: a second thread running torch's parallel kernels
        slows every model step by ~25% on 2 cores.
        """
        return self._model_thread.submit(fn, *args).result()

    def _kick(self) -> None:
        self._wake.set()

    async def _loop(self) -> None:
        while True:
            self._collect_garbage()
            t0 = time.perf_counter()
            plan = self.scheduler.plan()
            while self.scheduler.dropped:
                self._notify(self.scheduler.dropped.pop())
            self.scheduler_seconds += time.perf_counter() - t0
            if plan is None:
                stalled = self.scheduler.stalled
                with anyio.move_on_after(self.stall_timeout if stalled else 0.5) as scope:
                    await self._wake.wait()
                self._wake = anyio.Event()
                if scope.cancelled_caught and stalled is not None and stalled is self.scheduler.stalled:
                    job = self.scheduler.fail_stalled()
                    if job is not None:
                        self._notify(job)
                continue
            t1 = time.perf_counter()
            try:
                step = self._model_thread.submit(self.executor.run, plan)
                # Wait off the event loop; the waiting thread runs no torch code.
                results: Any = await anyio.to_thread.run_sync(step.result)
            except Exception as exc:  # a model failure fails this step's jobs, not the engine
                results = RuntimeError(f"model step failed: {exc!r}")
            t2 = time.perf_counter()
            self.model_seconds += t2 - t1
            for job in self.scheduler.complete(plan, results):
                self._notify(job)
            self.scheduler_seconds += time.perf_counter() - t2

    def _notify(self, job: Job) -> None:
        self.executor.forget(job.key)
        report = job.report
        self.num_tokens_computed += report.tokens_computed
        if job.error is None and not job.cancelled:
            self.num_pages_reused += report.pages_reused
            self.num_pages_computed += report.pages_computed
        if job.waiter is not None:
            job.waiter(job)

    # -------------------------------------------------------------------------- helpers

    def _record(self, handle: int, owner: Any) -> ContextRecord:
        record = self._records.get(handle)
        if record is None or record.owner != owner:
            raise ContextClosed(
                f"context {handle} is unknown or released; create, fork or open a new one"
            )
        return record

    def _new_record(self, cid: Any, owner: Any, last_logits: np.ndarray | None) -> ContextRecord:
        record = ContextRecord(self._next_handle, cid, owner, last_logits=last_logits)
        self._next_handle += 1
        self._records[record.handle] = record
        return record

    def _state(self, record: ContextRecord) -> P.ContextState:
        s = self.store.state(record.cid)
        return P.ContextState(
            seq_len=s.seq_len, page_size=s.page_size, num_committed_pages=s.num_committed_pages,
            num_working_pages=s.num_working_pages, num_working_tokens=s.num_working_tokens,
            next_position=self.store.next_position(record.cid),
        )

    def _context_reply(self, record: ContextRecord, meta: str = "") -> P.ContextReply:
        return P.ContextReply(ctx=record.handle, state=self._state(record), meta=meta)

    def release_soon(self, handle: int) -> None:
        """Release a handle from any thread (used when an SDK object is garbage collected)."""
        self._gc_queue.append(handle)

    def _collect_garbage(self) -> None:
        """Release collected handles; a busy one waits for its running request to end."""
        busy: list[int] = []
        while self._gc_queue:
            handle = self._gc_queue.popleft()
            record = self._records.get(handle)
            if record is None:
                continue
            if _busy(record):
                busy.append(handle)
            else:
                self._release_record(record)
        self._gc_queue.extend(busy)

    def _release_record(self, record: ContextRecord) -> None:
        self._records.pop(record.handle, None)
        self.store.release(record.cid)
        self._kick()  # pages came back: a stalled job may run now

    def release_owner(self, owner: Any) -> int:
        """Release every context of one owner (a disconnected client, an exited inferlet)."""
        records = [r for r in self._records.values() if r.owner == owner]
        for record in records:
            if _busy(record):
                self.release_soon(record.handle)
            else:
                self._release_record(record)
        return len(records)

    # ------------------------------------------------------------------------- requests

    async def handle(self, req: Any, *, owner: Any = None, namespace: str = DEFAULT_NAMESPACE,
                     raise_errors: bool = False) -> Any:
        """Answer one non-streaming request. See the module docstring."""
        self._collect_garbage()
        try:
            method = self._handlers[type(req)]
        except KeyError:
            err: PieError = InvalidArgument(f"unknown request type {type(req).__name__}")
            if raise_errors:
                raise err from None
            return P.ErrorReply(kind=type(err).__name__, message=str(err))
        try:
            return await method(self, req, owner, namespace)
        except PieError as err:
            if raise_errors:
                raise
            return P.ErrorReply(kind=type(err).__name__, message=str(err))

    async def _create(self, req: P.CreateContext, owner: Any, ns: str) -> P.ContextReply:
        return self._context_reply(self._new_record(self.store.create_context(), owner, None))

    async def _fork(self, req: P.ForkContext, owner: Any, ns: str) -> P.ContextReply:
        parent = self._record(req.ctx, owner)
        async with parent.lock:
            cid = self.store.fork(parent.cid)
        return self._context_reply(self._new_record(cid, owner, parent.last_logits))

    async def _release(self, req: P.ReleaseContext, owner: Any, ns: str) -> P.Ok:
        record = self._record(req.ctx, owner)
        async with record.lock:
            if self._records.get(record.handle) is record:
                self._release_record(record)
        return P.Ok()

    async def _get_state(self, req: P.GetState, owner: Any, ns: str) -> P.StateReply:
        return P.StateReply(state=self._state(self._record(req.ctx, owner)))

    async def _raw(self, req: Any, owner: Any, ns: str) -> P.StateReply:
        record = self._record(req.ctx, owner)
        async with record.lock:
            ok = True
            if isinstance(req, P.ReservePages):
                check_count("num_pages", req.num_pages)
                if req.num_pages > self.store.num_pages_total:
                    raise OutOfPages(f"cannot reserve {req.num_pages} pages: the pool has only "
                                     f"{self.store.num_pages_total}")
                ok = self.store.reserve_working_pages(record.cid, req.num_pages)
            elif isinstance(req, P.CommitPages):
                self.store.commit_working_pages(record.cid, req.num_pages)
            elif isinstance(req, P.ReleasePages):
                self.store.release_working_pages(record.cid, req.num_pages)
                record.last_logits = None
            else:
                self.store.truncate_working_page_tokens(record.cid, req.num_tokens)
                if req.num_tokens:
                    record.last_logits = None
            if not isinstance(req, P.ReservePages):
                self._kick()
            return P.StateReply(state=self._state(record), ok=ok)

    async def _save(self, req: P.SaveSnapshot, owner: Any, ns: str) -> P.Ok:
        record = self._record(req.ctx, owner)
        async with record.lock:
            self.store.save(record.cid, req.name, ns)
            self._snapshot_extra[(ns, req.name)] = (record.last_logits, req.meta)
        return P.Ok()

    async def _open(self, req: P.OpenSnapshot, owner: Any, ns: str) -> P.ContextReply:
        cid = self.store.open(req.name, ns)
        logits, meta = self._snapshot_extra.get((ns, req.name), (None, ""))
        return self._context_reply(self._new_record(cid, owner, logits), meta)

    async def _take(self, req: P.TakeSnapshot, owner: Any, ns: str) -> P.ContextReply:
        cid = self.store.take(req.name, ns)
        logits, meta = self._snapshot_extra.pop((ns, req.name), (None, ""))
        return self._context_reply(self._new_record(cid, owner, logits), meta)

    async def _delete(self, req: P.DeleteSnapshot, owner: Any, ns: str) -> P.Ok:
        self.store.delete(req.name, ns)
        self._snapshot_extra.pop((ns, req.name), None)
        self._kick()
        return P.Ok()

    async def _list(self, req: P.ListSnapshots, owner: Any, ns: str) -> P.SnapshotList:
        return P.SnapshotList(names=self.store.list(ns))

    async def _tokenize(self, req: P.Tokenize, owner: Any, ns: str) -> P.TokenIds:
        return P.TokenIds(token_ids=list(self.tokenizer.encode(req.text)))

    async def _info(self, req: P.GetInfo, owner: Any, ns: str) -> P.EngineInfo:
        return self.info()

    def info(self) -> P.EngineInfo:
        return P.EngineInfo(
            protocol_version=P.PROTOCOL_VERSION, model_name=self.model_name,
            page_size=self.store.page_size, num_pages=self.store.num_pages_total,
            vocab_size=self.vocab_size, max_seq_len=self.max_seq_len,
            stop_token_ids=self.stop_token_ids, max_step_tokens=self.scheduler.max_step_tokens,
        )

    async def _stats(self, req: P.GetStats, owner: Any, ns: str) -> P.EngineStats:
        return self.stats()

    def stats(self) -> P.EngineStats:
        s = self.store.stats()
        looked_up = self.num_pages_reused + self.num_pages_computed
        return P.EngineStats(
            num_pages_total=s.num_pages_total, num_pages_free=s.num_pages_free,
            num_pages_used=s.num_pages_working + s.num_pages_committed,
            num_pages_cached=s.num_pages_cached, num_contexts=len(self._records),
            num_snapshots=s.num_snapshots, num_steps=self.scheduler.num_steps,
            num_model_calls=self.executor.num_model_calls,
            tokens_computed=self.num_tokens_computed, pages_reused=self.num_pages_reused,
            pages_computed=self.num_pages_computed,
            hit_rate=self.num_pages_reused / looked_up if looked_up else 0.0,
            model_seconds=self.model_seconds, scheduler_seconds=self.scheduler_seconds,
        )

    _handlers: dict[type, Callable[..., Any]] = {
        P.CreateContext: _create,
        P.ForkContext: _fork,
        P.ReleaseContext: _release,
        P.GetState: _get_state,
        P.ReservePages: _raw,
        P.CommitPages: _raw,
        P.ReleasePages: _raw,
        P.TruncateTokens: _raw,
        P.SaveSnapshot: _save,
        P.OpenSnapshot: _open,
        P.TakeSnapshot: _take,
        P.DeleteSnapshot: _delete,
        P.ListSnapshots: _list,
        P.Forward: PassesMixin._forward,
        P.Tokenize: _tokenize,
        P.GetInfo: _info,
        P.GetStats: _stats,
    }


def _busy(record: ContextRecord) -> bool:
    return record.lock.value == 0
