"""The requests that run the model: ``Forward``, ``Generate``, ``Verify`` and ``Select``
become scheduler jobs.

Owns nothing but its dependencies: the page store (to read a context's counters), the
context table, the job queue (the engine: scheduler plus loop), the engine's facts and
limits (``EngineInfo``), the tokenizer and the constraint compiler. Each request is checked
completely here, through the contract's ``pie_ctx.proto.checks``, before its job exists: a
request that passes cannot fail the model step it shares with other owners' rows. The job
then runs under the context's lock and its result is read back; the scheduler does the
rest.

Scratch passes: recomputing the last token's logits and scoring ``Select`` options write
tokens after the context without committing them, read what they need, then drop them
again (``_scratch``), so the context ends exactly as it was.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import anyio
import numpy as np
import xxhash

from pie_ctx.proto import checks
from pie_ctx.proto import messages as P
from pie_ctx.proto.errors import InvalidArgument, OutOfPages, PieError
from pie_ctx.proto.stops import StopChecker
from runtime.engine.decoding import Grammars
from runtime.engine.drafts import Drafter
from runtime.engine.jobs import Decoding, Job, JobKind, JobQueue, VerifyRound
from runtime.engine.records import ContextRecord, ContextTable
from runtime.engine.scores import ScoreProbe
from runtime.engine.stream import GenerationStream

if TYPE_CHECKING:
    from runtime.kv.store import PageStore

__all__ = ["Passes"]


class Passes:
    """Turns model-running requests into jobs and their results into replies.

    Args:
        store: the page store.
        records: the context table.
        jobs: where jobs go (``submit``/``cancel``).
        info: returns the engine's facts and limits (vocabulary, lengths, reply size...).
        tokenizer: decodes generated text for stop strings and streaming.
        grammars: compiles constraints.
        page_limit: the most pages an owner's contexts may hold (None: the pool).
    """

    def __init__(self, store: PageStore, records: ContextTable, jobs: JobQueue,
                 info: Callable[[], P.EngineInfo], tokenizer: Any, grammars: Grammars,
                 page_limit: Callable[[Any], int | None] = lambda owner: None) -> None:
        self._page_limit = page_limit
        self._store = store
        self._records = records
        self._jobs = jobs
        self._info = info  # a callable: the limits may be lowered by a server
        self._tokenizer = tokenizer
        self._grammars = grammars
        self._next_job = 1

    # ------------------------------------------------------------------------ forward

    async def forward(self, req: P.Forward, owner: Any) -> P.ForwardReply:
        """Run one explicit pass (or a flush) and answer its probes."""
        async with self._records.locked(req.ctx, owner) as record:
            seq_len = self._store.state(record.cid).seq_len
            mask = checks.forward(req, self._info(), seq_len)
            tokens = list(req.tokens)
            n = len(tokens)
            self._check_fits(seq_len + n, "this pass", owner)
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
                entropy=list(req.entropy), top_logprobs=list(req.top_logprobs),
                hidden=list(req.hidden), scores=self._scores(req.attention_scores, False),
            )
            await self._run(job)
            record.last_logits = np.frombuffer(job.progress.out.logits[logits.index(n - 1)], dtype="<f4")
            return P.ForwardReply(
                state=self._store.state(record.cid),
                report=record.take_resumed(job.progress.report),
                sampled=job.progress.out.sampled,
                logits=job.progress.out.logits[: len(req.logits)],
                distributions=job.progress.out.distributions,
                logprobs=job.progress.out.logprobs, entropy=job.progress.out.entropy,
                top_logprobs=job.progress.out.top_logprobs, hidden=job.progress.out.hidden,
                attention_scores=[] if job.scores is None else job.scores.results(
                    self._store.state(record.cid).seq_len),
            )

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
            await self._records.acquired(record)
            job = await self._generate_job(record, req)
        except BaseException as err:
            record.lock.release()
            if not isinstance(err, PieError):
                raise
            return GenerationStream.failed(err)
        send, receive = anyio.create_memory_object_stream[Any](math.inf)
        held = P.GenerateChunk(tokens=[], text="")  # without req.stream: everything, once

        def on_chunk(job: Job, token: int, text: str, row: Any) -> None:
            chunk = P.GenerateChunk(
                tokens=[token], text=text, logprobs=[row.sampled_logprob],
                top_logprobs=[] if row.top_logprobs is None else [row.top_logprobs],
                entropy=[] if row.entropy is None else [row.entropy])
            if not req.stream:
                _extend(held, chunk)
                return
            with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
                send.send_nowait(chunk)

        def on_done(job: Job) -> None:
            try:
                final: Any = None
                if job.error is not None:
                    final = P.error_reply(job.error)
                elif not job.cancelled:
                    record.last_logits = None  # the pending token's logits are not computed
                    state = self._store.state(record.cid)
                    final = P.GenerateDone(
                        finish_reason=job.finish_reason, tokens=list(job.progress.generated),
                        pending=job.progress.generated[-1:], state=state,
                        report=record.take_resumed(job.progress.report),
                        attention_scores=None if job.scores is None
                        else job.scores.results(state.seq_len)[0],
                    )
                if final is not None:
                    with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
                        if held.tokens:
                            send.send_nowait(held)
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
                         "prompt + max_tokens", record.owner, "lower max_tokens or ")
        first_logits = None if tokens else await self._first_logits(record)
        matcher = None
        if req.constraint is not None:  # compiling may take a while: not on the loop
            matcher = await anyio.to_thread.run_sync(self._grammars.matcher, req.constraint)
        stops = self._info().stop_token_ids if req.stop_token_ids is None else req.stop_token_ids
        sampler = _seeded(req.sampler)
        drafter = None
        scored = req.attention_scores is not None  # every row scored: no drafted rows
        if not scored and (req.prompt_lookup or (matcher is not None and req.jump_forward)):
            history = self._store.tokens(record.cid) + tokens if req.prompt_lookup else []
            drafter = Drafter(history, prompt_lookup=req.prompt_lookup,
                              jump_forward=req.jump_forward)
        return self._new_job(
            JobKind.GENERATE, record, tokens, self._default_positions(record, len(tokens)),
            commit=True, reuse_prefix=True, sampler=sampler, seed=sampler.seed or 0,
            max_tokens=req.max_tokens, stop_token_ids=frozenset(stops),
            first_logits=first_logits,
            stop=StopChecker(self._new_decoder, req.stop_strings),
            decoding=Decoding(logit_bias=req.logit_bias, allowed=req.allowed_tokens,
                              matcher=matcher, top_logprobs=req.top_logprobs),
            min_tokens=req.min_tokens, drafter=drafter,
            scores=self._scores([req.attention_scores] if scored else [], True),
        )

    async def _first_logits(self, record: ContextRecord) -> np.ndarray:
        """The logits to sample a prompt-less generation's first token from."""
        if self._store.state(record.cid).seq_len == 0:
            raise InvalidArgument("generate: the context is empty; add tokens (e.g. "
                                  "user(...)) first")
        if record.last_logits is None:
            # Unknown after a truncation or a raw page operation: compute them again.
            record.last_logits = await self._last_logits(record)
        return record.last_logits

    def _new_decoder(self) -> Any:
        return self._tokenizer.incremental_decoder(skip_special_tokens=True)

    # -------------------------------------------------------------- verify and select

    async def verify(self, req: P.Verify, owner: Any) -> P.VerifyReply:
        """One round of a client-driven generation (see ``messages.Verify``)."""
        async with self._records.locked(req.ctx, owner) as record:
            state = self._store.state(record.cid)
            checks.verify(req, self._info(), state.seq_len)
            tokens = list(req.tokens)
            if req.num_draft and len(tokens) == req.num_draft:
                raise InvalidArgument("a draft needs the token before it in the same round; "
                                      "send a round without a draft first")
            self._check_fits(state.seq_len + len(tokens) + 1, "this round", owner)
            decoding = Decoding(logit_bias=req.logit_bias, allowed=req.allowed_tokens,
                                top_logprobs=req.top_logprobs)
            sampler = _seeded(req.sampler)
            if not tokens:  # sample from the last token's logits: a one-token generation
                job = self._new_job(
                    JobKind.GENERATE, record, [], [], commit=False, sampler=sampler,
                    seed=sampler.seed or 0, max_tokens=1,
                    first_logits=await self._first_logits(record), decoding=decoding)
                rows: list[Any] = []
                job.on_chunk = lambda _job, _token, _text, row: rows.append(row)
                await self._run(job)
                record.last_logits = None
                return self._verify_reply(record, job, 0, job.progress.generated[0], rows)
            draft = tokens[len(tokens) - req.num_draft:]
            v = VerifyRound(draft=draft, sampler=sampler, stops=frozenset(req.stop_token_ids),
                            seed=sampler.seed)
            job = self._new_job(JobKind.FORWARD, record, tokens,
                                self._default_positions(record, len(tokens)), commit=False,
                                verify=v, decoding=decoding)
            await self._run(job)
            rejected = len(draft) - v.accepted
            if rejected:  # dropped from the working pages: no trace of them is left
                self._store.truncate_working_page_tokens(record.cid, rejected)
            record.last_logits = None
            return self._verify_reply(record, job, v.accepted, v.token, v.rows)

    def _verify_reply(self, record: ContextRecord, job: Job, accepted: int, token: int | None,
                      rows: list[Any]) -> P.VerifyReply:
        """A round's reply; ``rows`` are the RowResults of the tokens it emitted."""
        return P.VerifyReply(
            accepted=accepted, token=token, logprobs=[r.sampled_logprob for r in rows],
            top_logprobs=[r.top_logprobs for r in rows if r.top_logprobs is not None],
            entropy=[r.entropy for r in rows if r.entropy is not None],
            state=self._store.state(record.cid),
            report=record.take_resumed(job.progress.report))

    async def select(self, req: P.Select, owner: Any) -> P.SelectReply:
        """Score options as continuations, in one pass that changes nothing.

        The options become a tree (a shared prefix is one branch, computed once): each
        node attends to the whole context and to its own ancestors, at the position it
        would have in the context. With ``unconditional``, a second tree in the same pass
        sees only its ancestors, from position 0.
        """
        async with self._records.locked(req.ctx, owner) as record:
            state = self._store.state(record.cid)
            checks.select(req, self._info(), state.seq_len)
            first_lp = _log_softmax(await self._first_logits(record))
            tree = _Tree(req.options)
            tokens, positions, parents = tree.layout(state.next_position)
            bases = [0]
            if req.unconditional:  # the same tree again, seeing nothing before it
                more_tokens, more_positions, more_parents = tree.layout(0)
                tokens += more_tokens
                positions += more_positions
                parents += [p + tree.size if p >= 0 else -1 for p in more_parents]
                bases.append(tree.size)
            mask = np.zeros((len(tokens), state.seq_len + len(tokens)), dtype=bool)
            for base in bases:
                _tree_mask(mask, parents, state.seq_len, base, tree.size, see_context=base == 0)
            specs = [P.LogprobSpec(index=base + node, token_ids=ids)
                     for base in bases for node, ids in tree.children()]
            job = await self._scratch(record, tokens, positions, mask, logprobs=specs)
            lp = {spec.index: dict(zip(spec.token_ids, out, strict=True))
                  for spec, out in zip(specs, job.progress.out.logprobs, strict=True)}
            conditional = tree.score(0, lp, lambda t: float(first_lp[t]))
            unconditional = tree.score(tree.size, lp, lambda t: 0.0) if req.unconditional else []
            return P.SelectReply(logprobs=conditional, unconditional=unconditional)

    # ------------------------------------------------------------------------ helpers

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

    async def _scratch(self, record: ContextRecord, tokens: list[int], positions: list[int],
                       mask: np.ndarray, **probes: Any) -> Job:
        """Run a masked pass after the context without keeping it: the tokens are written
        uncommitted, read, then dropped, and the context's pages are as before."""
        before = self._store.state(record.cid).num_working_pages
        job = self._new_job(JobKind.FORWARD, record, tokens, positions,
                            extras=_mask_extras(mask), mask=mask, commit=False, **probes)
        await self._run(job)
        self._store.truncate_working_page_tokens(record.cid, len(tokens))
        spare = self._store.state(record.cid).num_working_pages - before
        if spare > 0:
            self._store.release_working_pages(record.cid, spare)
        return job

    async def _last_logits(self, record: ContextRecord) -> np.ndarray:
        """The logits after the context's last token, recomputed without changing it.

        The last token is run again at its own position, in a scratch slot after the
        context, with a mask that shows it every entry before it and itself (its old copy
        is hidden).
        """
        state = self._store.state(record.cid)
        last = self._store.tokens(record.cid)[-1]
        row = [True] * (state.seq_len + 1)
        row[state.seq_len - 1] = False
        job = await self._scratch(record, [last], [state.next_position - 1],
                                  np.asarray([row]), logits=[0])
        return np.frombuffer(job.progress.out.logits[0], dtype="<f4")

    def _scores(self, specs: list[P.ScoresSpec], generation: bool) -> ScoreProbe | None:
        """The attention-scores probe of a job (None when nothing is asked)."""
        if not specs:
            return None
        return ScoreProbe(list(specs), self._info().score_layers, generation)

    def _check_fits(self, num_tokens: int, what: str, owner: Any, hint: str = "") -> None:
        """Refuse at once what could never fit: the pool, or the owner's share of it."""
        needed = math.ceil(num_tokens / self._store.page_size)
        total = self._store.num_pages_total
        if needed > total:
            raise OutOfPages(f"{what} need {needed} pages; the pool has {total}: {hint}"
                             "split the work or start the engine with more pages")
        share = self._page_limit(owner)
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


def _extend(held: P.GenerateChunk, chunk: P.GenerateChunk) -> None:
    """Add one token's chunk to the chunk that carries a whole unstreamed generation."""
    held.tokens.extend(chunk.tokens)
    held.text += chunk.text
    held.logprobs.extend(chunk.logprobs)
    held.top_logprobs.extend(chunk.top_logprobs)
    held.entropy.extend(chunk.entropy)


class _Tree:
    """Options as a token trie: a prefix shared by several options is one branch."""

    def __init__(self, options: list[list[int]]) -> None:
        self.options = options
        self.nodes: list[tuple[int, int]] = []  # (token, parent node or -1)
        index: dict[tuple[int, int], int] = {}
        self.paths: list[list[int]] = []  # per option, its nodes
        for option in options:
            parent, path = -1, []
            for token in option:
                key = (parent, token)
                if key not in index:
                    index[key] = len(self.nodes)
                    self.nodes.append((token, parent))
                parent = index[key]
                path.append(parent)
            self.paths.append(path)
        self.size = len(self.nodes)

    def layout(self, start: int) -> tuple[list[int], list[int], list[int]]:
        """Tokens, positions (``start`` + depth) and parents, in node order."""
        depth: list[int] = []
        for _, parent in self.nodes:
            depth.append(0 if parent < 0 else depth[parent] + 1)
        return ([t for t, _ in self.nodes], [start + d for d in depth],
                [p for _, p in self.nodes])

    def children(self) -> list[tuple[int, list[int]]]:
        """Per node that has children: (the node, its children's tokens)."""
        kids: dict[int, list[int]] = {}
        for token, parent in self.nodes:
            if parent >= 0:
                kids.setdefault(parent, []).append(token)
        return sorted(kids.items())

    def score(self, base: int, lp: dict[int, dict[int, float]],
              first: Callable[[int], float]) -> list[list[float]]:
        """Per option, per token: its log-probability after what precedes it."""
        out = []
        for option, path in zip(self.options, self.paths, strict=True):
            values = [first(option[0])]
            for j in range(1, len(option)):
                values.append(lp[base + path[j - 1]][option[j]])
            out.append(values)
        return out


def _tree_mask(mask: np.ndarray, parents: list[int], seq_len: int, base: int, size: int, *,
               see_context: bool) -> None:
    """Fill the rows of one tree in ``mask`` [n, seq_len + n]: each node sees itself and
    its ancestors, and the context's ``seq_len`` entries if ``see_context``."""
    for i in range(base, base + size):
        mask[i, :seq_len] = see_context
        node = i
        while node >= 0:
            mask[i, seq_len + node] = True
            node = parents[node]


def _log_softmax(row: np.ndarray) -> np.ndarray:
    x = row.astype(np.float64)
    x = x - x.max()
    return x - np.log(np.exp(x).sum())


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
