"""The engine: one narrow async request interface over the page store and the model.

Owns: its lifecycle and the step loop (plan -> model call -> complete), the model thread,
and the parts it wires together, each with explicit dependencies:

* ``ContextTable`` (``records.py``): the public context handles and their owners;
* ``Scheduler`` (``scheduler.py``): which tokens of which jobs go into each model call;
* ``StepExecutor`` (``executor.py``): one model call plus sampling, on the model thread;
* ``Passes`` (``passes.py``): ``Forward``/``Generate`` requests as jobs;
* ``Channels`` (``channels.py``): queues and topics between inferlets, with their requests
  table (``channel_requests.py``);
* ``Handlers`` (``handlers.py``): every other request;
* ``HostedRequests`` (``hosted_requests.py``): the namespaced store (``inferlet_store.py``),
  and inferlets launched by name once a host is attached (``runtime.hosted.host``, which
  sits above the SDK and so above the engine: the engine only holds what it attaches).

The SDK and the server both talk to it with the plain-data messages of
``pie_ctx.proto.messages``::

    reply = await engine.handle(request, owner=..., namespace=...)
    async for message in await engine.generate(request, ...): ...

Every ``PieError`` comes back as an ``ErrorReply`` (``raise_errors=True`` raises instead)
and changes nothing. Requests on one context run one at a time (its record's lock);
requests on different contexts run concurrently and share each step's model call.

Threads: the event loop does bookkeeping only, plus the page copies of forks, which go in
slices small enough never to start a parallel region (``PagePool.copy_pages``); every
model step runs on the one model thread (see ``run_on_model_thread``).

Usage::

    async with boot_engine(model=None, page_size=16) as engine:   # runtime.boot
        reply = await engine.handle(CreateContext())
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
import msgspec

from pie_ctx.proto import checks
from pie_ctx.proto import messages as P
from pie_ctx.proto.errors import (
    InvalidArgument,
    OutOfPages,
    PieError,
    ProtocolError,
    single_exception,
)
from runtime.engine.adapters import Adapters
from runtime.engine.channel_requests import ChannelRequests
from runtime.engine.channels import ChannelLimits, Channels
from runtime.engine.decoding import Grammars
from runtime.engine.executor import StepExecutor
from runtime.engine.handlers import Handlers
from runtime.engine.hosted_requests import HostedRequests
from runtime.engine.inferlet_store import InferletStore, StoreLimits
from runtime.engine.jobs import Job, JobStatus
from runtime.engine.page_metrics import page_families, tenant_families
from runtime.engine.passes import Passes
from runtime.engine.records import ContextRecord, ContextTable
from runtime.engine.rows import EntryKind, RowResult, StepPlan
from runtime.engine.scheduler import Scheduler
from runtime.engine.step_share import DEFAULT_DECODE_SHARE
from runtime.engine.stream import GenerationStream
from runtime.engine.tenants import REQUEST_PRIORITY, Tenant, Tenants
from runtime.kv.snapshots import DEFAULT_NAMESPACE
from runtime.model.failures import RunnerLost

if TYPE_CHECKING:
    from runtime.kv.store import PageStore
    from runtime.model.runner_protocol import Runner

__all__ = ["Engine"]

log = logging.getLogger("pie_ctx.engine")

DEFAULT_MAX_REPLY_BYTES = 16 * 2**20
DEFAULT_MAX_MASK_ENTRIES = 2**26
# Room a channel request or reply needs around its payload (a 256-char name is <= 1 KiB).
_MESSAGE_ENVELOPE = 2048
# Requests that work on a context as it is: they never bring a suspended one back first.
_KEEPS_SUSPENDED = (P.Suspend, P.ReleaseContext)
_RESUME_POLL = 0.02  # seconds between tries of a resume that waits for room


def _on_asyncio() -> bool:
    """Whether this thread runs an asyncio event loop (else trio, through anyio)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


@dataclass(slots=True)
class LoopCounters:
    """What the engine has done so far (reported by ``Engine.stats``).

    The page counters are the sums of the ``PassReport`` values the engine handed out:
    every pass that succeeded, and every snapshot open or take (their ``open_report``), so
    ``rt.stats()`` agrees with the reports a program saw.
    """

    model_seconds: float = 0.0
    scheduler_seconds: float = 0.0
    tokens_computed: int = 0
    pages_reused: int = 0
    pages_computed: int = 0
    pages_from_disk: int = 0
    isolated_failures: int = 0  # jobs failed alone because their rows broke a step

    def add_pages(self, report: P.PassReport) -> None:
        """Count the pages of a report handed to a client (a pass or a snapshot open)."""
        self.pages_reused += report.pages_reused
        self.pages_computed += report.pages_computed
        self.pages_from_disk += report.pages_from_disk


class Engine:
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
        max_reply_bytes: the largest reply one request may ask for (``EngineInfo``).
        max_mask_entries: the largest custom attention mask of one pass.
        max_pages_per_owner: the page share of one owner (a client): its contexts may hold
            at most this many pages (see docs/scheduling.md); None = the whole pool.
        decode_share: the share of a decoding step's time its decode rows keep, in [0, 1):
            prompt tokens beside them are bounded so a long prompt slows running
            generations by about ``1 / decode_share`` (``runtime.engine.step_share``;
            0, the default: prompt chunks fill the token budget).
        hidden_size: size of one ``hidden_states`` row (reported in ``EngineInfo``).
        channel_limits: the bounds of the channels between inferlets (docs/messages.md);
            None = the defaults of ``ChannelLimits``.
        model_thread: the single-thread executor every model step runs on (``boot`` passes
            the one that loaded the model); shut down when the engine exits.
        adapters: LoRA adapters to load now, ``{name: PEFT folder}`` (docs/adapters.md);
            more load at run time (``LoadAdapter``).
        store_limits: the bounds of ``rt.store`` (None = the defaults of ``StoreLimits``);
            its values live in ``<snapshot dir>/store`` (in memory without a snapshot dir).
    """

    def __init__(
        self,
        store: PageStore,
        runner: Runner,
        tokenizer: Any,
        *,
        model_name: str = "model",
        vocab_size: int,
        max_seq_len: int,
        max_step_tokens: int = 1024,
        stall_timeout: float = 5.0,
        max_reply_bytes: int = DEFAULT_MAX_REPLY_BYTES,
        max_mask_entries: int = DEFAULT_MAX_MASK_ENTRIES,
        max_pages_per_owner: int | None = None,
        decode_share: float = DEFAULT_DECODE_SHARE,
        hidden_size: int = 0,
        model_thread: ThreadPoolExecutor | None = None,
        channel_limits: ChannelLimits | None = None,
        adapters: dict[str, str] | None = None,
        store_limits: StoreLimits | None = None,
    ) -> None:
        self.store = store
        # The KV-event publisher boot_engine(kv_events=...) starts (runtime.kv.events);
        # whoever runs the engine closes it after the engine stops. None: no events.
        self.kv_events: Any = None
        self.tokenizer = tokenizer
        self.executor = StepExecutor(runner)
        self.tenants = Tenants()
        self.scheduler = Scheduler(store, max_step_tokens=max_step_tokens,
                                   max_pages_per_owner=max_pages_per_owner,
                                   decode_share=decode_share, tenants=self.tenants)
        self.stall_timeout = stall_timeout
        stop_token_ids = sorted(getattr(tokenizer, "stop_token_ids", []) or [])
        grammars = Grammars(tokenizer, vocab_size, stop_token_ids)
        limits = channel_limits or ChannelLimits()
        self.channels = Channels(limits)
        store_root = None if store.tier is None else store.tier.files.root / "store"
        self.kv_store = InferletStore(store_root, store_limits,
                                      shared=store.tier is not None and store.tier.shared)
        slim = self.kv_store.limits
        self._info = P.EngineInfo(
            protocol_version=P.PROTOCOL_VERSION, model_name=model_name,
            page_size=store.page_size, num_pages=store.num_pages_total, vocab_size=vocab_size,
            max_seq_len=max_seq_len, stop_token_ids=stop_token_ids,
            max_step_tokens=max_step_tokens, max_reply_bytes=max_reply_bytes,
            max_mask_entries=max_mask_entries, max_pages_per_owner=max_pages_per_owner or 0,
            max_held_pages_per_owner=store.holds.max_pages_per_owner,
            hidden_size=hidden_size, can_constrain=grammars.available,
            score_layers=getattr(runner, "score_layers", 0),
            score_heads=getattr(runner, "score_heads", 0),
            dtype=str(store.pool.dtype).removeprefix("torch."),
            device=str(store.pool.kv.device), attention=runner.backend.name,
            weights=runner.weight_format, kv_dtype=store.pool.kv_dtype, backend=runner.kind,
            deterministic=runner.deterministic,
            kernels=list(getattr(getattr(runner, "model", None), "kernel_report", None) or []),
            snapshot_dir="" if store.tier is None else str(store.tier.files.folder),
            max_message_bytes=limits.max_message_bytes,
            max_queue_messages=limits.max_queue_messages, max_channels=limits.max_channels,
            max_subscriptions=limits.max_subscriptions,
            max_channel_bytes=limits.max_channel_bytes,
            max_store_value_bytes=slim.max_value_bytes, max_store_keys=slim.max_keys,
            max_store_bytes=slim.max_bytes,
        )
        self.adapters = Adapters(runner, store, model_name, self.run_on_model_thread,
                                 self._adapters_changed)
        self.counters = LoopCounters()
        self.records = ContextTable(store, on_release=self._kick)
        store.set_room_maker(self._suspend_idle)
        self.scheduler.resume = self.records.resume
        self.passes = Passes(store, self.records, self, self.info, tokenizer, grammars,
                             page_limit=self.scheduler.page_limit)
        self.handlers = Handlers(store, self.records, self.passes, self.info, self.stats,
                                 tokenizer, on_pages_freed=self._kick,
                                 on_report=self.counters.add_pages, adapters=self.adapters,
                                 page_limit=self.scheduler.page_limit,
                                 default_priority=self._default_priority)
        self.handlers.extend(ChannelRequests(self.channels, self.info).table)
        self.host: Any = None  # an InferletHost, once attached
        self._hosted = HostedRequests(self.kv_store)
        self.handlers.extend(self._hosted.table)
        self._wake = anyio.Event()
        self.lost: RunnerLost | None = None  # the runner can step no more (see _lose_runner)
        self._lost = anyio.Event()
        self._task_group: Any = None
        self._running = False
        # Every model step runs on this one thread (the one that loaded the model, when
        # booted). torch's OpenMP team is per calling thread, and once a second thread has
        # run a parallel region every step is ~25% slower on 2 cores (measured).
        self._model_thread = model_thread or ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="pie-ctx-model")
        for name, path in (adapters or {}).items():  # on the model thread, like any load
            self.run_on_model_thread(self.adapters.load_now, name, path)

    @property
    def model_name(self) -> str:
        return self._info.model_name

    # ------------------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> Engine:
        self._task_group = anyio.create_task_group()
        await self._task_group.__aenter__()
        self._running = True
        self._task_group.start_soon(self._loop)
        return self

    async def __aexit__(self, *exc: Any) -> bool | None:
        self._running = False
        if self.host is not None:
            self.host.stop()
        self._task_group.cancel_scope.cancel()
        try:
            return await self._task_group.__aexit__(*exc)
        except BaseExceptionGroup as group:
            raise single_exception(group) from None
        finally:
            # Whoever still waits for a job hears that it will never run; then the contexts
            # those jobs held are free to go.
            for job in self.scheduler.abort_all(ProtocolError("the engine stopped")):
                self._notify(job)
            self.records.collect_garbage()
            self._model_thread.shutdown(wait=False, cancel_futures=True)
            self.store.close()  # another engine may now use the snapshot folder
            close = getattr(self.executor.runner, "close", None)  # tensor parallel: the ranks
            if close is not None:
                close()

    def run_on_model_thread(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` on the thread that runs the model, and wait for it (blocking).

        Other torch work in the same process (a baseline model in a benchmark, custom
        tensor code) belongs there too: a second thread running torch's parallel kernels
        slows every model step by ~25% on 2 cores.
        """
        return self._model_thread.submit(fn, *args).result()

    # ------------------------------------------------------------------------ requests

    async def handle(self, req: Any, *, owner: Any = None, namespace: str = DEFAULT_NAMESPACE,
                     raise_errors: bool = False) -> Any:
        """Answer one non-streaming request. See the module docstring."""
        self.records.collect_garbage()
        if not self._running:
            reply: Any = P.error_reply(self.lost or ProtocolError("the engine is not running"))
        elif isinstance(req, _KEEPS_SUSPENDED):
            reply = await self.handlers.handle(req, owner, namespace)
        else:
            with self.records.pinned(getattr(req, "ctx", None), owner) as record:
                try:
                    await self._resume(record)
                except PieError as err:
                    reply = P.error_reply(err)
                else:
                    reply = await self.handlers.handle(req, owner, namespace)
        if raise_errors:
            P.raise_if_error(reply)
        return reply

    async def generate(self, req: P.Generate, *, owner: Any = None,
                       namespace: str = DEFAULT_NAMESPACE) -> GenerationStream:
        """Start a generation (see ``Passes.generate``)."""
        self.records.collect_garbage()
        if not self._running:
            return GenerationStream.failed(self.lost or ProtocolError("the engine is not running"))
        with self.records.pinned(req.ctx, owner) as record:
            try:
                await self._resume(record)
            except PieError as err:
                return GenerationStream.failed(err)
            return await self.passes.generate(req, owner)

    # ------------------------------------------------------------ suspend and resume

    async def _resume(self, record: ContextRecord | None) -> None:
        """Bring a suspended context's pages back before a request runs on it, waiting for
        room while the pool is full of running work: as long as the engine keeps
        stepping (those jobs end and give their pages back), and ``stall_timeout`` more.

        Raises:
            OutOfPages: no room, and no step for ``stall_timeout``. SnapshotCorrupt: the
                disk tier lost one of its pages.
        """
        if record is None or record.suspended is None:
            return
        steps, deadline = -1, 0.0
        async with record.lock:
            while record.suspended is not None:
                try:
                    self.records.resume(record)
                except OutOfPages:
                    if self.scheduler.num_steps != steps:  # progress: wait on
                        steps = self.scheduler.num_steps
                        deadline = time.monotonic() + self.stall_timeout
                    elif time.monotonic() >= deadline:
                        raise
                    await anyio.sleep(_RESUME_POLL)

    def _suspend_idle(self, n: int) -> bool:
        """The store needs ``n`` pages it does not have (the page store's room maker):
        suspend idle contexts (furthest from their expected return first, then least
        recently used), then the contexts of jobs waiting for admission (last in the queue
        first: each is resumed when its job is admitted), until they are there. True when
        they are."""
        for record in (*self.records.idle(), *self.scheduler.queued_records()):
            if self.store.num_pages_available() >= n:
                break
            if self.records.holds_pages(record):  # (an earlier one may have been a fork)
                self.records.suspend(record, auto=True)
        return self.store.num_pages_available() >= n

    # ------------------------------------------------------------------------ tenants

    def add_tenant(self, owner: Any, name: str, share: float, priority: int = 0) -> None:
        """Give ``owner`` (a server's API key: its runtime's owner) a weighted share of
        the step rows and of the pool, and a default priority for its contexts
        (``runtime.engine.tenants``; docs/http.md, "Keys and shares").

        Raises:
            InvalidArgument: ``share`` not a positive number, or a bad ``priority``.
        """
        share = checks.finite(share, "share")
        if share <= 0:
            raise InvalidArgument(f"a key's share must be > 0, got {share:g}")
        self.tenants.add(owner, Tenant(name, share, checks.priority(priority)),
                         self.store.num_pages_total)

    def remove_tenant(self, owner: Any) -> None:
        self.tenants.remove(owner)

    def _default_priority(self, owner: Any) -> int:
        """A new context's priority when its request gives none: the server request's
        (``x-pie-priority``), else its tenant's, else 0."""
        asked = REQUEST_PRIORITY.get()
        if asked is not None:
            return asked
        tenant = self.tenants.of(owner)
        return 0 if tenant is None else tenant.priority

    def attach_host(self, host: Any, folder: str) -> None:
        """Let ``rt.spawn`` launch inferlets through ``host`` (an ``InferletHost`` of the
        operator's ``folder``; see ``runtime.hosted.host.host_inferlets``)."""
        if self.host is not None:
            raise RuntimeError("this engine already hosts inferlets")
        self.host = host
        self._hosted.host = host
        self._info = msgspec.structs.replace(self._info, inferlet_folder=folder)

    def release_soon(self, handle: int) -> None:
        """Release a handle from any thread (used when an SDK object is garbage collected)."""
        self.records.release_soon(handle)

    def release_owner(self, owner: Any) -> int:
        """Release every context of one owner (a disconnected client, an exited inferlet).

        Its jobs still queued or running are cancelled first (a job inside the step being
        computed ends with that step), so its contexts go now or right after. Its channel
        state goes too: messages it took but had not confirmed return to the front of their
        queues, its subscriptions close, its waiting sends and receives end.
        """
        self.channels.release_owner(owner)
        if self.host is not None:
            self.host.release_owner(owner)  # the inferlets it spawned end with it
        for job in self.scheduler.jobs_of(owner):
            self.cancel(job)
        return self.records.release_owner(owner)

    def info(self) -> P.EngineInfo:
        """The engine's fixed facts and limits."""
        return self._info

    def _adapters_changed(self, adapters: list[P.AdapterInfo]) -> None:
        self._info = msgspec.structs.replace(self._info, adapters=adapters)

    def cap_reply_bytes(self, limit: int) -> None:
        """Lower ``max_reply_bytes`` to ``limit`` (a server whose frames are smaller calls
        this before it accepts clients, so no request can ask for a reply it cannot send).
        Channel messages shrink to fit such frames too."""
        if limit < self._info.max_reply_bytes:
            self._info = msgspec.structs.replace(self._info, max_reply_bytes=limit)
        message_limit = max(1, limit - _MESSAGE_ENVELOPE)
        if message_limit < self._info.max_message_bytes:
            self._info = msgspec.structs.replace(self._info, max_message_bytes=message_limit)

    def stats(self) -> P.EngineStats:
        """Engine-wide counters (``EngineStats`` says what each one counts)."""
        s = self.store.stats()
        c, r = self.counters, self.records.counters
        looked_up = c.pages_reused + c.pages_computed
        return P.EngineStats(
            num_pages_total=s.num_pages_total, num_pages_free=s.num_pages_free,
            num_pages_used=s.num_pages_working + s.num_pages_committed,
            num_pages_cached=s.num_pages_cached, num_contexts=len(self.records),
            num_snapshots=s.num_snapshots, num_steps=self.scheduler.num_steps,
            num_model_calls=self.executor.num_model_calls,
            tokens_computed=c.tokens_computed, pages_reused=c.pages_reused,
            pages_computed=c.pages_computed, hit_rate=c.pages_reused / looked_up if looked_up else 0.0,
            model_seconds=c.model_seconds, scheduler_seconds=c.scheduler_seconds,
            num_isolated_failures=c.isolated_failures, pages_from_disk=c.pages_from_disk,
            num_snapshots_resident=s.num_snapshots_resident,
            num_snapshots_spilled=s.num_snapshots_spilled, num_disk_pages=s.num_disk_pages,
            disk_bytes=s.num_disk_bytes, disk_pages_written=s.disk_pages_written,
            disk_bytes_written=s.disk_bytes_written, disk_pages_loaded=s.disk_pages_loaded,
            disk_bytes_loaded=s.disk_bytes_loaded, num_holds=s.num_holds,
            num_pages_held=s.num_pages_held, pages_held_by_priority=s.pages_held_by_priority,
            num_channels=self.channels.num_channels,
            num_subscriptions=self.channels.num_subscriptions,
            num_channel_messages=self.channels.num_messages,
            channel_bytes=self.channels.num_bytes,
            num_contexts_suspended=self.records.num_suspended, num_suspends=r.suspends,
            num_auto_suspends=r.auto_suspends, num_resumes=r.resumes,
            pages_suspended=r.pages_suspended,
            pages_resumed_from_memory=r.pages_resumed_from_memory,
            pages_resumed_from_disk=r.pages_resumed_from_disk,
        )

    def metric_families(self) -> Iterator[Any]:
        """Prometheus series of the engine's own beyond ``GET /metrics``' fixed ones (the
        holds; ``runtime.engine.page_metrics``)."""
        yield from page_families(self.stats())
        yield from tenant_families(self.tenants, self.store)

    # ------------------------------------------------------------------ the job queue

    def submit(self, job: Job) -> None:
        """Queue a job for the loop (``JobQueue``)."""
        if not self._running:
            job.fail(self.lost or ProtocolError("the engine is not running"))
            self._notify(job)
            return
        self.scheduler.submit(job)
        self._kick()

    def cancel(self, job: Job) -> None:
        """Cancel a job; its context stays exactly as it was before the job (``JobQueue``)."""
        if job.status is JobStatus.DONE:
            return
        if self.scheduler.cancel(job):
            self._notify(job)
        self._kick()

    # ----------------------------------------------------------------------- the loop

    def _kick(self) -> None:
        self._wake.set()

    async def _loop(self) -> None:
        while True:
            self.records.collect_garbage()
            t0 = time.perf_counter()
            plan = self.scheduler.plan()
            while self.scheduler.dropped:
                self._notify(self.scheduler.dropped.pop())
            for job in self.scheduler.fail_over_share(self.stall_timeout):
                self._notify(job)
            self.counters.scheduler_seconds += time.perf_counter() - t0
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
                results, failed = await self._run_isolated(plan)
            except RunnerLost as lost:
                self._lose_runner(lost)
                return
            t2 = time.perf_counter()
            self.counters.model_seconds += t2 - t1
            self.scheduler.share.observe(*_step_tokens(plan), t2 - t1)
            for job in self.scheduler.complete(plan, results, failed):
                self._notify(job)
            self.counters.scheduler_seconds += time.perf_counter() - t2

    async def _run_step(self, plan: StepPlan) -> list[RowResult]:
        step = self._model_thread.submit(self.executor.run, plan)
        if _on_asyncio():
            # The model thread's done-callback wakes the loop itself: no waiting thread to
            # hand the result over (one thread wake-up and a lock handoff less a step, on
            # cores the model's OpenMP team is using). Shielded like the thread path: a
            # started step always finishes before the loop moves on.
            with anyio.CancelScope(shield=True):
                return await asyncio.wrap_future(step)
        # Wait off the event loop; the waiting thread runs no torch code.
        return await anyio.to_thread.run_sync(step.result)

    async def _run_isolated(self, plan: StepPlan) -> tuple[list[RowResult | None],
                                                           dict[Job, BaseException]]:
        """Run a step; if it fails, find the jobs that cause the failure and fail only them.

        The batch is bisected: each half runs as its own step, down to single jobs, so a
        row that breaks the model step costs its own job and ~log2(batch) extra calls, and
        everyone else's results are exactly what they would have been. Re-running is safe:
        a step only writes the new tokens' K/V into the jobs' own working slots, and the
        executor restores any sampling state a failed step consumed.
        """
        results: list[RowResult | None] = [None] * len(plan.rows)
        failed: dict[Job, BaseException] = {}

        async def run(entries: list[int], known: BaseException | None) -> None:
            sub, rows = plan.subset(entries)
            error = known
            if error is None:
                try:
                    for i, result in zip(rows, await self._run_step(sub), strict=True):
                        results[i] = result
                    return
                except RunnerLost:
                    raise  # no row caused it: every later step would fail alike
                except Exception as exc:  # noqa: BLE001 - isolated below, never fatal
                    error = exc
            if len(entries) == 1:
                job = plan.entries[entries[0]].job
                log.warning("a model step failed on one request's rows only: %r", error)
                failed[job] = PieError(f"the model step failed on this request: {error!r}")
                self.counters.isolated_failures += 1
                return
            half = len(entries) // 2
            await run(entries[:half], None)
            await run(entries[half:], None)

        await run(list(range(len(plan.entries))), None)
        return results, failed

    def _lose_runner(self, lost: RunnerLost) -> None:
        """The runner can step no more: every job fails with ``lost`` and none is taken."""
        self.lost = lost
        self._running = False
        for job in self.scheduler.abort_all(lost):
            self._notify(job)
        self._lost.set()

    async def wait_lost(self) -> RunnerLost:
        """Wait until the runner is lost (a server then exits, see ``runtime.server.run``)."""
        await self._lost.wait()
        assert self.lost is not None
        return self.lost

    def _notify(self, job: Job) -> None:
        self.executor.forget(job.key)
        report, c = job.progress.report, self.counters
        c.tokens_computed += report.tokens_computed
        if job.error is None and not job.cancelled:
            c.add_pages(report)
        if job.waiter is not None:
            job.waiter(job)


def _step_tokens(plan: StepPlan) -> tuple[int, list[tuple[int, int]]]:
    """A step's decode tokens (a generation's pending token and its draft) and its prompt
    chunks as ``(tokens, depth)`` (depth: the context's tokens before the chunk)."""
    decode, chunks = 0, []
    computed = (e for e in plan.entries if e.has_chunk)  # in the order of plan.chunks
    for entry, chunk in zip(computed, plan.chunks, strict=True):
        if entry.kind is EntryKind.DECODE:
            decode += entry.length
        elif entry.kind is EntryKind.PROMPT:
            chunks.append((entry.length, chunk.num_cached))
    return decode, chunks
