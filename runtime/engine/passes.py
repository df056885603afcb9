"""Forward passes and generations: turning requests into scheduler jobs.

Owns nothing of its own: a mixin of ``Engine`` holding the two requests that run the model
(``Forward`` and ``Generate``). Each validates everything before the job exists, runs the
job under the context's lock, and reads the result back; the scheduler does the rest.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import anyio
import numpy as np

from pie_ctx import protocol as P
from pie_ctx.checks import token_ids
from pie_ctx.errors import ContextTooLong, InvalidArgument, OutOfPages, PieError
from runtime.engine.jobs import Job, JobKind, JobStatus
from runtime.engine.stops import StopChecker
from runtime.engine.stream import GenerationStream
from runtime.engine.validate import check_sampler, mask_and_extras, seeded
from runtime.kv.snapshots import DEFAULT_NAMESPACE

if TYPE_CHECKING:
    from runtime.engine.engine import ContextRecord

__all__ = ["PassesMixin"]


class PassesMixin:
    """The model-running requests of ``Engine`` (see ``runtime.engine.engine``)."""

    def _validate_tokens(self, tokens: Sequence[int], what: str) -> list[int]:
        return token_ids(tokens, self.vocab_size, what)

    def _positions(self, record: ContextRecord, tokens: list[int],
                   positions: Sequence[int] | None) -> list[int]:
        seq_len = self.store.state(record.cid).seq_len
        if seq_len + len(tokens) > self.max_seq_len:
            raise ContextTooLong(
                f"{seq_len} tokens in the context + {len(tokens)} new exceed the model's "
                f"{self.max_seq_len}; truncate, or start a new context"
            )
        if positions is None:
            start = self.store.next_position(record.cid)
            return list(range(start, start + len(tokens)))
        out = list(positions)
        if len(out) != len(tokens):
            raise InvalidArgument(f"{len(out)} positions for {len(tokens)} tokens; give one each")
        for p in out:
            if not isinstance(p, int) or isinstance(p, bool) or not 0 <= p < self.max_seq_len:
                raise InvalidArgument(f"position {p!r} is not in [0, {self.max_seq_len})")
        return out

    def _new_job(self, kind: JobKind, record: ContextRecord, tokens: list[int],
                 positions: list[int], **kw: Any) -> Job:
        job = Job(kind=kind, handle=record, tokens=tokens, positions=positions,
                  extras=kw.pop("extras", None) or [0] * len(tokens), key=self._next_job, **kw)
        self._next_job += 1
        return job

    async def _run_job(self, job: Job) -> None:
        """Submit a job and wait for it; cancellation rolls it back."""
        done = anyio.Event()
        job.waiter = lambda _job: done.set()
        self.scheduler.submit(job)
        self._kick()
        try:
            await done.wait()
        except BaseException:
            self.cancel(job)
            raise
        if job.error is not None:
            raise job.error

    async def _forward(self, req: P.Forward, owner: Any, ns: str) -> P.ForwardReply:
        record = self._record(req.ctx, owner)
        async with record.lock:
            tokens = self._validate_tokens(req.tokens, "forward")
            if not tokens:
                raise InvalidArgument("forward: give at least one input token")
            positions = self._positions(record, tokens, req.positions)
            mask, extras = self._mask(record, req.mask, len(tokens))
            n = len(tokens)
            for what, idx in ([("sample", s.index) for s in req.sample]
                              + [("logits", i) for i in req.logits]
                              + [("distribution", d.index) for d in req.distributions]
                              + [("logprobs", lp.index) for lp in req.logprobs]):
                if not isinstance(idx, int) or not 0 <= idx < n:
                    raise InvalidArgument(f"{what} index {idx!r} is not in [0, {n}) (the pass's tokens)")
            for d in req.distributions:
                if not 1 <= d.top_k <= self.vocab_size:
                    raise InvalidArgument(f"distribution top_k must be in [1, {self.vocab_size}]")
            for lp in req.logprobs:
                self._validate_tokens(lp.token_ids, "logprobs")
            for s in req.sample:
                check_sampler(s.sampler)
            needed = math.ceil((self.store.state(record.cid).seq_len + n) / self.store.page_size)
            if needed > self.store.num_pages_total:
                raise OutOfPages(f"this pass needs {needed} pages; the pool has "
                                 f"{self.store.num_pages_total}")
            sample = [P.SampleSpec(index=s.index, sampler=seeded(s.sampler)) for s in req.sample]
            logits = list(req.logits)
            if n - 1 not in logits:
                logits.append(n - 1)  # kept as the context's last logits (see ContextRecord)
            job = self._new_job(
                JobKind.FORWARD, record, tokens, positions, extras=extras, mask=mask,
                commit=req.commit, reuse_prefix=req.reuse_prefix and mask is None
                and req.positions is None, sample=sample, logits=logits,
                distributions=list(req.distributions), logprobs=list(req.logprobs),
            )
            await self._run_job(job)
            last = np.frombuffer(job.logits_out[logits.index(n - 1)], dtype="<f4")
            record.last_logits = last if mask is None else None
            out_logits = job.logits_out[: len(req.logits)]
            return P.ForwardReply(
                state=self._state(record), report=job.report, sampled=job.sampled_out,
                logits=out_logits, distributions=job.distributions_out,
                logprobs=job.logprobs_out,
            )

    def _mask(self, record: ContextRecord, rows: list[list[bool]] | None,
              n: int) -> tuple[np.ndarray | None, list[int] | None]:
        if rows is None:
            return None, None
        return mask_and_extras(rows, self.store.state(record.cid).seq_len, n)

    async def generate(self, req: P.Generate, *, owner: Any = None,
                       namespace: str = DEFAULT_NAMESPACE) -> GenerationStream:
        """Start a generation; iterate the returned stream for its messages.

        The stream yields ``GenerateChunk``s and ends with ``GenerateDone`` or an
        ``ErrorReply``. Closing it early (``aclose()``, or dropping it) cancels the
        generation and leaves the context exactly as it was.
        """
        self._collect_garbage()
        send, receive = anyio.create_memory_object_stream[Any](math.inf)
        try:
            record = self._record(req.ctx, owner)
        except PieError as err:
            send.send_nowait(P.ErrorReply(kind=type(err).__name__, message=str(err)))
            send.close()
            return GenerationStream(self, None, receive)
        await record.lock.acquire()
        try:
            job = self._generate_job(record, req)
        except BaseException as err:
            record.lock.release()
            if not isinstance(err, PieError):
                raise
            send.send_nowait(P.ErrorReply(kind=type(err).__name__, message=str(err)))
            send.close()
            return GenerationStream(self, None, receive)

        def on_chunk(tokens: list[int], text: str, logprob: float) -> None:
            with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
                send.send_nowait(P.GenerateChunk(tokens=tokens, text=text, logprobs=[logprob]))

        def on_done(job: Job) -> None:
            try:
                if job.error is not None:
                    err = job.error
                    kind = type(err).__name__ if isinstance(err, PieError) else "PieError"
                    final: Any = P.ErrorReply(kind=kind, message=str(err))
                elif job.cancelled:
                    final = None
                else:
                    record.last_logits = None
                    final = P.GenerateDone(
                        finish_reason=job.finish_reason, tokens=list(job.generated),
                        pending=job.generated[-1:], state=self._state(record), report=job.report,
                    )
                if final is not None:
                    with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
                        send.send_nowait(final)
                send.close()
            finally:
                record.lock.release()

        job.on_chunk = on_chunk
        job.waiter = on_done
        self.scheduler.submit(job)
        self._kick()
        return GenerationStream(self, job, receive)

    def cancel(self, job: Job) -> None:
        """Cancel a job; its context stays exactly as it was before the job."""
        if job.status is JobStatus.DONE:
            return
        if self.scheduler.cancel(job):
            self._notify(job)
        self._kick()

    def _generate_job(self, record: ContextRecord, req: P.Generate) -> Job:
        tokens = self._validate_tokens(req.tokens, "generate")
        if not isinstance(req.max_tokens, int) or req.max_tokens < 1:
            raise InvalidArgument(f"max_tokens must be a positive int, got {req.max_tokens!r}")
        check_sampler(req.sampler)
        first_logits = None
        if not tokens:
            if record.last_logits is None:
                raise InvalidArgument(
                    "generate: nothing to continue from; add tokens (e.g. cue()) or flush a "
                    "prompt first"
                )
            first_logits = record.last_logits
        positions = self._positions(record, tokens, None)
        seq_len = self.store.state(record.cid).seq_len
        if seq_len + len(tokens) + req.max_tokens > self.max_seq_len:
            raise ContextTooLong(
                f"{seq_len} + {len(tokens)} prompt + max_tokens {req.max_tokens} exceed the "
                f"model's {self.max_seq_len} tokens; lower max_tokens"
            )
        needed = math.ceil((seq_len + len(tokens) + req.max_tokens) / self.store.page_size)
        if needed > self.store.num_pages_total:
            raise OutOfPages(
                f"prompt + max_tokens need {needed} pages; the pool has "
                f"{self.store.num_pages_total}: lower max_tokens or enlarge the pool"
            )
        stops = self.stop_token_ids if req.stop_token_ids is None else req.stop_token_ids
        self._validate_tokens(stops, "stop_token_ids")
        if any(not isinstance(s, str) for s in req.stop_strings):
            raise InvalidArgument("stop strings must be str")
        sampler = seeded(req.sampler)
        return self._new_job(
            JobKind.GENERATE, record, tokens, positions, commit=True, reuse_prefix=True,
            sampler=sampler, seed=sampler.seed or 0, max_tokens=req.max_tokens,
            stop_token_ids=frozenset(stops), first_logits=first_logits,
            stop=StopChecker(self._new_decoder, req.stop_strings),
        )

    def _new_decoder(self) -> Any:
        return self.tokenizer.incremental_decoder(skip_special_tokens=True)

