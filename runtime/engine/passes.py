"""The requests that run the model: ``Forward`` and ``Generate`` become scheduler jobs.

Owns nothing but its dependencies: the page store (to read a context's counters), the
context table, the job queue (the engine: scheduler plus loop) and the engine's fixed
facts and limits (``EngineInfo``). Each request is checked completely here, through the
contract's ``pie_ctx.proto.checks``, before its job exists: a request that passes cannot
fail the model step it shares with other owners' rows. The job then runs under the
context's lock and its result is read back; the scheduler does the rest.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import Any

import anyio
import numpy as np
import xxhash

from pie_ctx.proto import checks
from pie_ctx.proto import messages as P
from pie_ctx.proto.errors import InvalidArgument, OutOfPages, PieError
from runtime.engine.jobs import Job, JobKind, JobQueue
from runtime.engine.records import ContextRecord, ContextTable
from runtime.engine.stops import StopChecker
from runtime.engine.stream import GenerationStream

__all__ = ["Passes"]


class Passes:
    """Turns ``Forward`` and ``Generate`` requests into jobs and their results into replies.

    Args:
        store: the page store.
        records: the context table.
        jobs: where jobs go (``submit``/``cancel``).
        info: returns the engine's facts and limits (vocabulary, lengths, reply size...).
        tokenizer: decodes generated text for stop strings and streaming.
    """

    def __init__(self, store: Any, records: ContextTable, jobs: JobQueue,
                 info: Callable[[], P.EngineInfo], tokenizer: Any) -> None:
        self._store = store
        self._records = records
        self._jobs = jobs
        self._info = info  # a callable: the limits may be lowered by a server
        self._tokenizer = tokenizer
        self._next_job = 1

    # ------------------------------------------------------------------------ forward

    async def forward(self, req: P.Forward, owner: Any) -> P.ForwardReply:
        """Run one explicit pass (or a flush) and answer its probes."""
        record = self._records.get(req.ctx, owner)
        async with record.lock:
            seq_len = self._store.state(record.cid).seq_len
            mask = checks.forward(req, self._info(), seq_len)
            tokens = list(req.tokens)
            n = len(tokens)
            self._check_fits(seq_len + n, "this pass")
            positions = self._default_positions(record, n) if req.positions is None \
                else list(req.positions)
            logits = list(req.logits)
            if n - 1 not in logits:
                logits.append(n - 1)  # kept as the context's last logits
            job = self._new_job(
                JobKind.FORWARD, record, tokens, positions, extras=_mask_extras(mask),
                mask=mask, commit=req.commit,
                reuse_prefix=req.reuse_prefix and mask is None and req.positions is None,
                sample=list(req.sample), logits=logits,
                distributions=list(req.distributions), logprobs=list(req.logprobs),
            )
            await self._run(job)
            record.last_logits = np.frombuffer(job.logits_out[logits.index(n - 1)], dtype="<f4")
            return P.ForwardReply(
                state=self._store.state(record.cid), report=job.report, sampled=job.sampled_out,
                logits=job.logits_out[: len(req.logits)], distributions=job.distributions_out,
                logprobs=job.logprobs_out,
            )

    async def _run(self, job: Job) -> None:
        """Submit a job and wait for it; cancellation rolls it back."""
        done = anyio.Event()
        job.waiter = lambda _job: done.set()
        self._jobs.submit(job)
        try:
            await done.wait()
        except BaseException:
            self._jobs.cancel(job)
            raise
        if job.error is not None:
            raise job.error

    # ----------------------------------------------------------------------- generate

    async def generate(self, req: P.Generate, owner: Any) -> GenerationStream:
        """Start a generation; iterate the returned stream for its messages.

        The stream yields ``GenerateChunk``s and ends with ``GenerateDone`` or an
        ``ErrorReply``. Closing it early (``aclose()``, or dropping it) cancels the
        generation and leaves the context exactly as it was.
        """
        try:
            record = self._records.get(req.ctx, owner)
        except PieError as err:
            return GenerationStream.failed(err)
        await record.lock.acquire()
        try:
            job = await self._generate_job(record, req)
        except BaseException as err:
            record.lock.release()
            if not isinstance(err, PieError):
                raise
            return GenerationStream.failed(err)
        send, receive = anyio.create_memory_object_stream[Any](math.inf)

        def on_chunk(tokens: list[int], text: str, logprob: float) -> None:
            with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
                send.send_nowait(P.GenerateChunk(tokens=tokens, text=text, logprobs=[logprob]))

        def on_done(job: Job) -> None:
            try:
                final: Any = None
                if job.error is not None:
                    final = P.error_reply(job.error)
                elif not job.cancelled:
                    record.last_logits = None  # the pending token's logits are not computed
                    final = P.GenerateDone(
                        finish_reason=job.finish_reason, tokens=list(job.generated),
                        pending=job.generated[-1:], state=self._store.state(record.cid),
                        report=job.report,
                    )
                if final is not None:
                    with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
                        send.send_nowait(final)
                send.close()
            finally:
                record.lock.release()

        job.on_chunk = on_chunk
        job.waiter = on_done
        self._jobs.submit(job)
        return GenerationStream(self._jobs, job, receive)

    async def _generate_job(self, record: ContextRecord, req: P.Generate) -> Job:
        state = self._store.state(record.cid)
        checks.generate(req, self._info(), state.seq_len)
        tokens = list(req.tokens)
        self._check_fits(state.seq_len + len(tokens) + req.max_tokens,
                         "prompt + max_tokens", "lower max_tokens or ")
        first_logits = None
        if not tokens:
            if state.seq_len == 0:
                raise InvalidArgument(
                    "generate: the context is empty; add tokens (e.g. user(...)) first")
            if record.last_logits is None:
                # Unknown after a truncation or a raw page operation: compute them again.
                record.last_logits = await self._last_logits(record)
            first_logits = record.last_logits
        stops = self._info().stop_token_ids if req.stop_token_ids is None else req.stop_token_ids
        sampler = _seeded(req.sampler)
        return self._new_job(
            JobKind.GENERATE, record, tokens, self._default_positions(record, len(tokens)),
            commit=True, reuse_prefix=True, sampler=sampler, seed=sampler.seed or 0,
            max_tokens=req.max_tokens, stop_token_ids=frozenset(stops),
            first_logits=first_logits,
            stop=StopChecker(self._new_decoder, req.stop_strings),
        )

    async def _last_logits(self, record: ContextRecord) -> np.ndarray:
        """The logits after the context's last token, recomputed without changing it.

        The last token is run again at its own position, written to a scratch slot after
        the context, with a mask that shows it every entry before it and itself (its old
        copy is hidden). The scratch token is then dropped, so the context ends exactly as
        it was.
        """
        state = self._store.state(record.cid)
        last = self._store.tokens(record.cid)[-1]
        seq_len = state.seq_len
        row = [True] * (seq_len + 1)
        row[seq_len - 1] = False
        job = self._new_job(
            JobKind.FORWARD, record, [last], [state.next_position - 1],
            extras=[1], mask=np.asarray([row]), commit=False, logits=[0])
        await self._run(job)
        self._store.truncate_working_page_tokens(record.cid, 1)
        spare = self._store.state(record.cid).num_working_pages - state.num_working_pages
        if spare > 0:
            self._store.release_working_pages(record.cid, spare)
        return np.frombuffer(job.logits_out[0], dtype="<f4")

    def _new_decoder(self) -> Any:
        return self._tokenizer.incremental_decoder(skip_special_tokens=True)

    # ------------------------------------------------------------------------ helpers

    def _check_fits(self, num_tokens: int, what: str, hint: str = "") -> None:
        """Refuse at once what could never fit: the pool, or the owner's share of it."""
        needed = math.ceil(num_tokens / self._store.page_size)
        total = self._store.num_pages_total
        if needed > total:
            raise OutOfPages(f"{what} need {needed} pages; the pool has {total}: {hint}"
                             "split the work or start the engine with more pages")
        share = self._info().max_pages_per_owner
        if share and needed > share:
            raise OutOfPages(f"{what} need {needed} pages; one client's share of the pool is "
                             f"{share}: {hint}split the work")

    def _default_positions(self, record: ContextRecord, n: int) -> list[int]:
        start = self._store.next_position(record.cid)
        return list(range(start, start + n))

    def _new_job(self, kind: JobKind, record: ContextRecord, tokens: list[int],
                 positions: list[int], **kw: Any) -> Job:
        extras = kw.pop("extras", None) or [0] * len(tokens)
        job = Job(kind=kind, record=record, tokens=tokens, positions=positions, extras=extras,
                  key=self._next_job, **kw)
        self._next_job += 1
        return job


def _mask_extras(mask: np.ndarray | None) -> list[int] | None:
    """Each token's page-hash extra under a custom mask (0 is reserved for causal).

    Pages written under a custom mask must never be shared with causal ones: each token's
    mask row folds into its page hash.
    """
    if mask is None:
        return None
    return [xxhash.xxh3_64_intdigest(np.packbits(r).tobytes()) | 1 for r in mask]


def _seeded(s: P.SamplerSpec) -> P.SamplerSpec:
    """Give an unseeded sampler a seed now, so a preempted job replays the same tokens."""
    if s.seed is not None or s.is_greedy:
        return s
    seed = int.from_bytes(np.random.bytes(8), "little") >> 1
    return P.SamplerSpec(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
                         min_p=s.min_p, seed=seed)
