"""Generations the SDK drives round by round: speculation and client-side constraints.

Owns: one such generation's progress. Each round is one ``Verify`` request, batched in the
engine with everyone else's rows: it writes the pending token (and a draft, if a
speculator proposed one), keeps the draft up to the first token plain decoding would not write,
and samples the next token. Rounds never commit pages, so the generation can end inside a
round (a stop string, ``max_tokens``) or be cancelled and leave no trace: the tokens it
wrote are truncated again. When it ends normally its full pages are committed.

The stream speaks the same messages as an engine-driven generation (``GenerateChunk`` per
round, then ``GenerateDone`` or an ``ErrorReply``), so ``Generator`` consumes either.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from pie_ctx.constrain import Constraint
from pie_ctx.proto import messages as P
from pie_ctx.proto.errors import InvalidArgument, PieError
from pie_ctx.proto.stops import StopChecker
from pie_ctx.speculate import Speculator

__all__ = ["Rounds", "RoundStream"]


@dataclass(slots=True)
class Rounds:
    """What drives a round: a speculator's drafts, or a constraint's allowed tokens."""

    speculator: Speculator | None = None
    constraint: Constraint | None = None


class RoundStream:
    """The messages of one client-driven generation (see the module docstring).

    Args:
        transport: the context's transport (the generation holds the context's chain).
        ctx: the context's handle; ``state``: its counters when the generation starts.
        prompt: the tokens to write first (the context's pending tokens).
        req: the generation's settings, as an engine-driven ``Generate`` would carry them.
        rounds: the speculator or constraint.
        tokenizer: decodes text for stop strings and deltas.
    """

    def __init__(self, transport: Any, ctx: int, state: P.ContextState, prompt: list[int],
                 req: P.Generate, rounds: Rounds, tokenizer: Any) -> None:
        self._transport = transport
        self._ctx = ctx
        self._start = state
        self._req = req
        self._rounds = rounds
        self._stops = frozenset(req.stop_token_ids or ())
        self._text = StopChecker(lambda: tokenizer.incremental_decoder(skip_special_tokens=True),
                                 req.stop_strings)
        self._next = list(prompt)  # tokens the next round writes
        self._written = 0  # tokens this generation wrote into the context
        self._generated: list[int] = []
        self._report = P.PassReport()
        self._state = state
        self._finish: str | None = None
        self._closed = False
        self._done_sent = False
        self._rounds_run = 0

    def __aiter__(self) -> RoundStream:
        return self

    async def __anext__(self) -> Any:
        if self._closed or self._done_sent:
            raise StopAsyncIteration
        try:
            if self._finish is not None:
                self._done_sent = True
                return await self._done()
            return await self._round()
        except PieError as err:
            await self._rollback()
            self._closed = True
            return P.error_reply(err)

    async def _round(self) -> P.GenerateChunk:
        req = self._req
        budget = req.max_tokens - len(self._generated)
        draft: list[int] = []
        allowed = req.allowed_tokens
        spec, constraint = self._rounds.speculator, self._rounds.constraint
        if spec is not None and self._next and budget > 1:
            draft = [int(t) for t in spec.draft()][: budget - 1]
        if constraint is not None:
            step = constraint.step(list(self._generated))
            if step is None:  # the constraint is complete
                self._finish = "constraint"
                return P.GenerateChunk(tokens=[], text=self._text.finish())
            step = [int(t) for t in step]
            if not step:
                raise InvalidArgument("the constraint allows no token here (its step() "
                                      "returned an empty list)")
            allowed = step if allowed is None else sorted(set(step) & set(allowed))
            if not allowed:
                raise InvalidArgument("no token is allowed both by the constraint and by "
                                      "allowed_tokens")
        reply = await self._transport.request(P.Verify(
            ctx=self._ctx, tokens=self._next + draft, num_draft=len(draft),
            sampler=self._round_sampler(), stop_token_ids=sorted(self._stops),
            logit_bias=req.logit_bias, allowed_tokens=allowed, top_logprobs=req.top_logprobs))
        self._written += len(self._next) + reply.accepted
        self._state = reply.state
        self._add_report(reply.report)
        emitted = draft[: reply.accepted] + ([] if reply.token is None else [reply.token])
        if spec is not None:
            spec.rollback(len(draft) - reply.accepted)
            spec.accept(emitted)
        return await self._take(emitted, reply)

    async def _take(self, emitted: list[int], reply: P.VerifyReply) -> P.GenerateChunk:
        """Record this round's tokens up to where the generation ends."""
        text, kept = "", 0
        for t in emitted:
            kept += 1
            self._generated.append(t)
            if t in self._stops:
                self._finish = "stop_token"
                text += self._text.finish()
                break
            final = len(self._generated) >= self._req.max_tokens
            text += self._text.feed(t, final=final)
            if self._text.stopped:
                self._finish = "stop_string"
                break
            if final:
                self._finish = "length"
                break
        # The last token kept stays pending (unwritten), as in an engine-driven generation.
        in_context = reply.accepted  # this round's kept draft tokens are in the context
        extra = in_context - (kept - 1) if kept <= in_context else 0
        if extra > 0:
            self._state = (await self._transport.request(
                P.TruncateTokens(ctx=self._ctx, num_tokens=extra))).state
            self._written -= extra
        self._next = [emitted[kept - 1]] if kept else []
        return P.GenerateChunk(tokens=emitted[:kept], text=text,
                               logprobs=reply.logprobs[:kept],
                               top_logprobs=reply.top_logprobs[:kept],
                               entropy=reply.entropy[:kept])

    async def _done(self) -> P.GenerateDone:
        """Commit the full pages the generation wrote, and report it."""
        full = self._state.num_working_tokens // self._state.page_size
        if full:
            self._state = (await self._transport.request(
                P.CommitPages(ctx=self._ctx, num_pages=full))).state
            self._report.pages_computed += full
        return P.GenerateDone(finish_reason=self._finish or "length",
                              tokens=list(self._generated), pending=self._generated[-1:],
                              state=self._state, report=self._report)

    def _round_sampler(self) -> P.SamplerSpec:
        """The sampler of the next round: a seeded one gets a fresh seed per round (derived
        from its own), so rounds draw independent numbers and the generation is still
        reproducible."""
        s = self._req.sampler
        self._rounds_run += 1
        if s.seed is None or s.is_greedy:
            return s
        seed = (s.seed + self._rounds_run * 0x9E3779B97F4A7C15) % 2**63
        return msgspec.structs.replace(s, seed=seed)

    def _add_report(self, r: P.PassReport) -> None:
        self._report.tokens_written += r.tokens_written
        self._report.tokens_computed += r.tokens_computed
        self._report.pages_reused += r.pages_reused
        self._report.pages_computed += r.pages_computed
        self._report.pages_from_disk += r.pages_from_disk
        self._report.num_steps += r.num_steps

    async def _rollback(self) -> None:
        """Take back everything this generation wrote (its pages were never committed)."""
        if self._written:
            state = (await self._transport.request(
                P.TruncateTokens(ctx=self._ctx, num_tokens=self._written))).state
            self._written = 0
            spare = state.num_working_pages - self._start.num_working_pages
            if spare > 0:
                await self._transport.request(P.ReleasePages(ctx=self._ctx, num_pages=spare))

    def close(self) -> None:
        """Stop (sync): no more rounds run. ``aclose`` also takes back what was written."""
        self._closed = True

    async def aclose(self) -> None:
        """Stop, and leave the context as it was before the generation."""
        if self._closed:
            return
        self._closed = True
        if not self._done_sent:
            try:
                await self._rollback()
            except PieError:
                pass  # the context or the connection is gone: nothing left to take back

