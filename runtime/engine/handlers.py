"""Request handlers: every non-streaming request of ``pie_ctx.proto.messages``.

Owns nothing but its dependencies, given at construction: the page store, the context
table, the passes (``Forward``) and the engine's facts. Bookkeeping requests (create, fork,
release, raw page operations, snapshots) answer at once from the store; ``Forward`` goes to
:class:`~runtime.engine.passes.Passes`. The channel requests have their own table
(``channel_requests.py``), as the hosted ones do (``hosted_requests.py``); the engine adds
both with ``extend``. Every input is checked here, once, through the
contract's ``pie_ctx.proto.checks`` (the store checks its own state-dependent rules), and a
``PieError`` becomes an ``ErrorReply`` that changes nothing.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import anyio

from pie_ctx.proto import checks
from pie_ctx.proto import messages as P
from pie_ctx.proto.errors import InvalidArgument, OutOfPages, PieError
from runtime.engine.adapters import Adapters
from runtime.engine.passes import Passes
from runtime.engine.records import ContextRecord, ContextTable

if TYPE_CHECKING:
    from runtime.kv.store import PageStore

__all__ = ["Handlers"]

Handler = Callable[[Any, Any, str], Awaitable[Any]]


class Handlers:
    """Answers requests for one engine.

    Args:
        store: the page store.
        records: the context table.
        passes: runs ``Forward`` requests.
        info: returns the engine's facts and limits (``GetInfo``).
        stats: builds the engine's counters (``GetStats``).
        tokenizer: encodes text (``Tokenize``).
        on_pages_freed: called when a request gave pages back (a waiting job may run).
        on_report: called with the report of every snapshot open or take that succeeded
            (the engine's counters sum it with the passes' reports).
        adapters: the engine's LoRA adapters (``LoadAdapter``, ``CreateContext.adapter``).
        page_limit: the most pages an owner's contexts may hold (None: the pool).
        default_priority: an owner's contexts' priority when ``CreateContext`` gives none.
    """

    def __init__(self, store: PageStore, records: ContextTable, passes: Passes,
                 info: Callable[[], P.EngineInfo],
                 stats: Callable[[], P.EngineStats], tokenizer: Any,
                 on_pages_freed: Callable[[], None],
                 on_report: Callable[[P.PassReport], None], adapters: Adapters,
                 page_limit: Callable[[Any], int | None] = lambda owner: None,
                 default_priority: Callable[[Any], int] = lambda owner: 0) -> None:
        self._page_limit = page_limit
        self._default_priority = default_priority
        self._store = store
        self._adapters = adapters
        self._on_report = on_report
        self._records = records
        self._passes = passes
        self._info = info  # a callable: the limits may be lowered by a server
        self._stats = stats
        self._tokenizer = tokenizer
        self._on_pages_freed = on_pages_freed
        self._save_lock = anyio.Lock()
        self._table: dict[type, Handler] = {
            P.CreateContext: self._create,
            P.ForkContext: self._fork,
            P.LoadAdapter: self._load_adapter,
            P.UnloadAdapter: self._unload_adapter,
            P.ReleaseContext: self._release,
            P.GetState: self._get_state,
            P.ReservePages: self._raw,
            P.CommitPages: self._raw,
            P.ReleasePages: self._raw,
            P.TruncateTokens: self._raw,
            P.Compact: self._compact,
            P.Retain: self._retain,
            P.Suspend: self._suspend,
            P.ReleaseHold: self._release_hold,
            P.SaveSnapshot: self._save,
            P.OpenSnapshot: self._open,
            P.TakeSnapshot: self._take,
            P.DeleteSnapshot: self._delete,
            P.ListSnapshots: self._list,
            P.Forward: self._forward,
            P.Verify: self._verify,
            P.Select: self._select,
            P.GetTokens: self._get_tokens,
            P.Tokenize: self._tokenize,
            P.GetInfo: self._get_info,
            P.GetStats: self._get_stats,
        }

    def extend(self, table: dict[type, Handler]) -> None:
        """Answer more request types (another part's handlers, e.g. ``HostedRequests``)."""
        clash = table.keys() & self._table.keys()
        if clash:
            raise RuntimeError(f"request types handled twice: {clash}")
        self._table.update(table)

    async def handle(self, req: Any, owner: Any, namespace: str) -> Any:
        """The reply to ``req``; a ``PieError`` is returned as an ``ErrorReply``."""
        handler = self._table.get(type(req))
        try:
            if handler is None:
                raise InvalidArgument(f"unknown request type {type(req).__name__}")
            return await handler(req, owner, namespace)
        except PieError as err:
            return P.error_reply(err)

    # ------------------------------------------------------------------------ contexts

    def _reply(self, record: ContextRecord, meta: str = "",
               report: P.PassReport | None = None) -> P.ContextReply:
        return P.ContextReply(ctx=record.handle, state=self._store.state(record.cid), meta=meta,
                              report=report)

    def _check_share(self, owner: Any, more: int) -> None:
        """Refuse to give ``owner`` ``more`` pages beyond its share of the pool."""
        share = self._page_limit(owner)
        if not share or more <= 0:
            return
        held = self._store.owner_pages(owner)
        if held + more > share:
            raise OutOfPages(
                f"this needs {more} more pages but your contexts already hold {held} of your "
                f"{share}-page share of the KV pool: release contexts you no longer need")

    async def _create(self, req: P.CreateContext, owner: Any, ns: str) -> P.ContextReply:
        key = self._adapters.key_of(checks.text(req.adapter, "adapter"))
        priority = self._default_priority(owner) if req.priority is None \
            else checks.priority(req.priority)
        record = self._records.add(self._store.create_context(owner, key), owner)
        record.priority = priority
        return self._reply(record)

    async def _load_adapter(self, req: P.LoadAdapter, owner: Any, ns: str) -> P.EngineInfo:
        await self._adapters.load(req.name, req.path)
        return self._info()

    async def _unload_adapter(self, req: P.UnloadAdapter, owner: Any, ns: str) -> P.EngineInfo:
        await self._adapters.unload(req.name)
        return self._info()

    async def _fork(self, req: P.ForkContext, owner: Any, ns: str) -> P.ContextReply:
        async with self._records.locked(req.ctx, owner) as parent:
            self._check_share(owner, self._store.state(parent.cid).num_working_pages)
            cid = self._store.fork(parent.cid)
        record = self._records.add(cid, owner, parent.last_logits)
        record.priority = parent.priority
        return self._reply(record)

    async def _release(self, req: P.ReleaseContext, owner: Any, ns: str) -> P.Ok:
        record = self._records.get(req.ctx, owner, resume=False)
        async with record.lock:
            self._records.release(record)
        return P.Ok()

    async def _get_state(self, req: P.GetState, owner: Any, ns: str) -> P.StateReply:
        return P.StateReply(state=self._store.state(self._records.get(req.ctx, owner).cid))

    async def _raw(self, req: Any, owner: Any, ns: str) -> P.StateReply:
        async with self._records.locked(req.ctx, owner) as record:
            ok = True
            cid = record.cid
            if isinstance(req, P.ReservePages):
                n = checks.count(req.num_pages, "num_pages")
                if n > self._store.num_pages_total:
                    raise OutOfPages(f"cannot reserve {n} pages: the pool has only "
                                     f"{self._store.num_pages_total}")
                self._check_share(owner, n)
                # the raw API's contract is back-pressure: no context is suspended for it
                ok = self._store.reserve_working_pages(cid, n, suspend=False)
            elif isinstance(req, P.CommitPages):
                self._store.commit_working_pages(cid, req.num_pages)
            elif isinstance(req, P.ReleasePages):
                self._store.release_working_pages(cid, req.num_pages)
                record.last_logits = None
                self._on_pages_freed()
            else:
                self._store.truncate_working_page_tokens(cid, req.num_tokens)
                if req.num_tokens:
                    record.last_logits = None
            return P.StateReply(state=self._store.state(cid), ok=ok)

    async def _compact(self, req: P.Compact, owner: Any, ns: str) -> P.StateReply:
        async with self._records.locked(req.ctx, owner) as record:
            # no share check: a compacted context never holds more pages than before
            self._store.compact(record.cid, req.keep)
            record.last_logits = None  # the last token now sees fewer keys
            self._on_pages_freed()
            return P.StateReply(state=self._store.state(record.cid))

    async def _retain(self, req: P.Retain, owner: Any, ns: str) -> P.HoldReply:
        async with self._records.locked(req.ctx, owner) as record:
            hold = self._store.retain(record.cid, req.ttl, req.priority, owner, req.num_tokens)
            return P.HoldReply(hold=hold.hold_id, num_pages=hold.num_pages, ttl=float(req.ttl),
                               priority=hold.priority)

    async def _suspend(self, req: P.Suspend, owner: Any, ns: str) -> P.SuspendReply:
        record = self._records.get(req.ctx, owner, resume=False)
        if not isinstance(req.lazy, bool):
            raise InvalidArgument(f"suspend: lazy must be a bool, got {req.lazy!r}")
        back_in = None if req.back_in is None else checks.finite(req.back_in, "back_in")
        if back_in is not None and back_in < 0:
            raise InvalidArgument(f"suspend: back_in must be >= 0 seconds, got {back_in!r}")
        async with record.lock:
            record.back_at = None if back_in is None else self._records.now() + back_in
            if req.lazy:
                return P.SuspendReply(suspended=record.suspended is not None, num_pages=0)
            num_pages = self._records.suspend(record)
        self._on_pages_freed()
        return P.SuspendReply(suspended=True, num_pages=num_pages)

    async def _release_hold(self, req: P.ReleaseHold, owner: Any, ns: str) -> P.Ok:
        self._store.release_hold(req.hold, owner)
        self._on_pages_freed()  # its pages may now be evicted for a waiting job
        return P.Ok()

    async def _forward(self, req: P.Forward, owner: Any, ns: str) -> P.ForwardReply:
        return await self._passes.forward(req, owner)

    async def _verify(self, req: P.Verify, owner: Any, ns: str) -> P.VerifyReply:
        return await self._passes.verify(req, owner)

    async def _select(self, req: P.Select, owner: Any, ns: str) -> P.SelectReply:
        return await self._passes.select(req, owner)

    async def _get_tokens(self, req: P.GetTokens, owner: Any, ns: str) -> P.TokenIds:
        cid = self._records.get(req.ctx, owner).cid
        return P.TokenIds(token_ids=self._store.tokens(cid), positions=self._store.positions(cid))

    # ----------------------------------------------------------------------- snapshots

    async def _save(self, req: P.SaveSnapshot, owner: Any, ns: str) -> P.Ok:
        record = self._records.get(req.ctx, owner)
        name = checks.snapshot_name(req.name)
        if not isinstance(req.meta, str):
            raise InvalidArgument("snapshot meta must be a str")
        # One durable save at a time: a second save of the same name then sees the first
        # listed (SnapshotExists), and a failed save never removes a page file another
        # save in flight has just written.
        async with self._save_lock:
            async with record.lock:  # the fork is instant; the context goes on after it
                await self._records.acquired(record)
                job = self._store.begin_save(record.cid, name, ns, meta=req.meta,
                                             last_logits=record.last_logits)
            if job is not None:
                await anyio.to_thread.run_sync(job.write)  # files, fsyncs: off the loop
                try:
                    self._store.end_save(job)
                finally:
                    self._on_pages_freed()  # a failed save gave its pages back
        return P.Ok()

    async def _restore(self, name: str, ns: str) -> P.PassReport:
        """Make the snapshot resident (reading spilled pages on a worker thread); the
        report says where its pages came from."""
        job = self._store.plan_restore(name, ns)
        if job is not None:
            await anyio.to_thread.run_sync(job.read)
        from_memory, from_disk = self._store.restore_snapshot(name, ns, job)
        return P.PassReport(pages_reused=from_memory + from_disk, pages_from_disk=from_disk)

    async def _open(self, req: P.OpenSnapshot, owner: Any, ns: str) -> P.ContextReply:
        name = checks.snapshot_name(req.name)
        self._adapters.check_loaded(self._store.snapshot(name, ns).adapter, f"snapshot {name!r}")
        report = await self._restore(name, ns)
        snap = self._store.snapshot(name, ns)
        self._check_share(owner, len(snap.state.working))
        cid = self._store.open_snapshot(name, ns, owner)
        self._on_report(report)
        return self._reply(self._records.add(cid, owner, snap.last_logits), snap.meta, report)

    async def _take(self, req: P.TakeSnapshot, owner: Any, ns: str) -> P.ContextReply:
        name = checks.snapshot_name(req.name)
        self._adapters.check_loaded(self._store.snapshot(name, ns).adapter, f"snapshot {name!r}")
        report = await self._restore(name, ns)
        snap = self._store.snapshot(name, ns)
        cid = self._store.take_snapshot(name, ns, owner)
        self._on_report(report)
        return self._reply(self._records.add(cid, owner, snap.last_logits), snap.meta, report)

    async def _delete(self, req: P.DeleteSnapshot, owner: Any, ns: str) -> P.Ok:
        self._store.delete_snapshot(checks.snapshot_name(req.name), ns)
        self._on_pages_freed()
        return P.Ok()

    async def _list(self, req: P.ListSnapshots, owner: Any, ns: str) -> P.SnapshotList:
        return P.SnapshotList(names=self._store.list_snapshots(ns))

    # ------------------------------------------------------------------------- engine

    async def _tokenize(self, req: P.Tokenize, owner: Any, ns: str) -> P.TokenIds:
        return P.TokenIds(token_ids=list(self._tokenizer.encode(checks.text(req.text, "tokenize"))))

    async def _get_info(self, req: P.GetInfo, owner: Any, ns: str) -> P.EngineInfo:
        return self._info()

    async def _get_stats(self, req: P.GetStats, owner: Any, ns: str) -> P.EngineStats:
        return self._stats()
