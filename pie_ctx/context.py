"""``Context``: one KV sequence an inferlet builds, forks, generates from and saves.

Owns nothing itself: its state lives in a ``ContextCore`` (handle, pending tokens,
conversation, operation order); the conversation's turns come from ``pie_ctx.turns``. It keeps no page counters of its own: ``seq_len`` and
friends are the runtime's state as returned with the latest reply (``await ctx.refresh()``
asks again).

Usage::

    base = Context(rt).system("You are terse.").user("Why is the sky blue?").cue()
    report = await base.flush()                     # prefill, commit full pages
    forks = [base.fork() for _ in range(4)]         # share every committed page
    texts = await asyncio.gather(*(f.generate(Sampler.top_p(0.7, 0.95), max_tokens=64).text()
                                   for f in forks))
    await base.save("sky-prefix")                   # a snapshot that outlives this program
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

from pie_ctx.constrain import Constraint, constraint_spec
from pie_ctx.core import ContextCore
from pie_ctx.counters import Counters
from pie_ctx.ops import Op, OpChain
from pie_ctx.proto import checks
from pie_ctx.proto import messages as P
from pie_ctx.proto.errors import InvalidArgument
from pie_ctx.rounds import Rounds
from pie_ctx.selection import SELECT_METHODS, select_scores
from pie_ctx.speculate import Speculator
from pie_ctx.tools.tool import Tool
from pie_ctx.turns import Turns

if TYPE_CHECKING:
    from pie_ctx.forward import Forward
    from pie_ctx.generator import Generator
    from pie_ctx.raw import RawContext
    from pie_ctx.runtime import Runtime

__all__ = ["Context"]

PROMPT_LOOKUP_DRAFT = 8  # the most tokens prompt lookup proposes per step


class Context(Counters, Turns):
    """A context on the runtime. Creating one is synchronous; the runtime side is created
    in the background, in order with everything else done to it.

    Args:
        rt: the inferlet's runtime.
        adapter: the name of a loaded LoRA adapter (``rt.info.adapters``) every token of
            this context runs through; its forks keep it, its snapshots record it. None:
            the base model. Pages are shared only between contexts of the same adapter
            (docs/adapters.md).
        priority: an int in [0, 100]; under pressure a higher one is admitted first and
            preempted, suspended and evicted last (docs/scheduling.md); its forks keep it.
            None: this client's default (0, or its API key's on a server).

    Raises:
        ContextClosed: the runtime is closed.
        InvalidArgument: ``priority`` out of range.
        AdapterNotFound: (from the first operation) no adapter of that name is loaded.
    """

    def __init__(self, rt: Runtime, *, adapter: str | None = None, priority: int | None = None,
                 _core: ContextCore | None = None) -> None:
        if _core is None:
            _core = ContextCore(rt)
            name = "" if adapter is None else checks.text(adapter, "adapter")
            if priority is not None:
                priority = checks.priority(priority)
            _core.created = _core.spawn(partial(_core.create, name, priority))
        self._core = _core

    @classmethod
    async def open(cls, rt: Runtime, name: str) -> Context:
        """A new context forked from the snapshot ``name`` (the snapshot is unchanged).

        Raises:
            SnapshotNotFound: no snapshot has that name.
        """
        req = P.OpenSnapshot(name=checks.snapshot_name(name))
        return cls._from_reply(rt, await rt.transport.request(req))

    @classmethod
    async def take(cls, rt: Runtime, name: str) -> Context:
        """Open the snapshot ``name`` and delete it, in one step (no copy)."""
        req = P.TakeSnapshot(name=checks.snapshot_name(name))
        return cls._from_reply(rt, await rt.transport.request(req))

    @classmethod
    async def delete(cls, rt: Runtime, name: str) -> None:
        """Delete the snapshot ``name``; its pages are freed once nothing else uses them."""
        await rt.transport.request(P.DeleteSnapshot(name=checks.snapshot_name(name)))

    @classmethod
    def _from_reply(cls, rt: Runtime, reply: P.ContextReply) -> Context:
        core = ContextCore(rt)
        core.adopt(reply)
        core.chat = core.chat.from_meta(reply.meta)
        core.open_report = reply.report
        return cls(rt, _core=core)

    # --------------------------------------------------------------------- counters

    def _context_state(self) -> P.ContextState:
        self._core.check_open()
        return self._core.state

    @property
    def pending_tokens(self) -> list[int]:
        """Tokens filled in but not yet written to the KV cache (a copy)."""
        self._core.check_open()
        return list(self._core.pending)

    @property
    def open_report(self) -> P.PassReport | None:
        """For a context made by :meth:`open` or :meth:`take`: where the snapshot's pages
        came from, as a ``PassReport``. None for any other context.

        Every page of the snapshot counts, the partly filled tail page included, so
        ``pages_reused`` is ``num_committed_pages + num_working_pages`` right after the
        open: ``pages_from_disk`` of them were read from the snapshot directory,
        ``pages_from_memory`` were still in the pool, and none is computed. The engine's
        counters (``await rt.stats()``) add this report to their sums."""
        return self._core.open_report

    @property
    def is_released(self) -> bool:
        """True after ``release()``: every further use (counters included) raises
        ``ContextClosed``."""
        return self._core.released

    async def tokens(self) -> list[int]:
        """Every token of this context, in order: those in the KV cache, then the pending
        ones (what the model reads next time it runs)."""
        core = self._core

        async def body() -> list[int]:
            return list((await core.request(P.GetTokens)).token_ids) + list(core.pending)
        return await core.run(body)

    async def positions(self) -> list[int]:
        """Every token's rotary position, in the order of :meth:`tokens`: those in the KV
        cache, then where the pending ones will go (from ``next_position`` on). After
        :meth:`compact` the kept tokens keep their positions, so the next position
        continues from the last one, not from the new length."""
        core = self._core

        async def body() -> list[int]:
            held = list((await core.request(P.GetTokens)).positions)
            start = held[-1] + 1 if held else core.state.next_position
            return held + list(range(start, start + len(core.pending)))
        return await core.run(body)

    async def refresh(self) -> P.ContextState:
        """Ask the runtime for this context's counters now."""
        core = self._core

        async def body() -> P.ContextState:
            core.set_state((await core.request(P.GetState)).state)
            return core.state
        return await core.run(body)

    # ------------------------------------------------------------------- operations

    async def flush(self) -> P.PassReport:
        """Write the pending tokens into the KV cache and commit every full page.

        Full pages whose contents the runtime already holds (from any context) are attached
        instead of computed; the report says how many pages were reused vs computed.
        """
        return await self._core.run(self._core.write_pending)

    def generate(self, sampler: P.SamplerSpec | None = None, *, max_tokens: int = 256,
                 stop: Sequence[int | str] | str | int | None = (),
                 ignore_eos: bool = False, constrain: Any = None,
                 logit_bias: dict[int, float] | None = None,
                 allowed_tokens: Sequence[int] | None = None, top_logprobs: int = 0,
                 speculator: Speculator | str | None = None, cue: bool = True,
                 min_tokens: int = 0, tools: Sequence[Tool] | None = None,
                 tool_choice: str | None = None, parallel_tool_calls: bool = True,
                 jump_forward: bool = True,
                 attention_scores: P.ScoresSpec | bool | None = None) -> Generator:
        """Generate from this context; returns a :class:`Generator` (nothing runs until it
        is iterated or collected).

        Args:
            sampler: a ``Sampler.*`` value; default greedy.
            max_tokens: most tokens to generate.
            stop: token ids and/or strings that end generation (one str is one stop
                string). A matched stop string is excluded from the text. The model's
                end-of-turn tokens always stop unless ``ignore_eos``.
            ignore_eos: do not stop at the model's end-of-turn tokens.
            constrain: a constraint from ``pie_ctx.constrain`` (``Regex``, ``JsonSchema``,
                ``AnyJson``, ``Grammar``, ``Choice``), applied in the engine, or a
                ``Constraint`` object of yours (asked before every token: one round trip
                per token). With tools, only a ``JsonSchema``: the answer's (the calls
                follow their tools' schemas).
            logit_bias: ``{token id: bias}`` added to the logits before sampling.
            allowed_tokens: only these token ids may be sampled.
            top_logprobs: per generated token, also report the ``k`` most likely tokens
                with their log-probabilities and the entropy (``k <= 20``).
            speculator: ``"prompt_lookup"`` (drafts copied from the context's own tokens,
                proposed and verified in the engine, with any constraint) or a
                ``pie_ctx.speculate.Speculator`` of yours (driven round by round from this
                process): draft tokens are verified in one pass, losslessly
                (docs/decoding.md).
            cue: after a system or user turn, open the assistant turn first (as
                ``cue()`` does); ``False`` generates right after the turn.
            min_tokens: the stop tokens cannot end the generation before this many tokens
                (they are masked until then); stop strings and constraints still can.
            tools: the tools this generation may call, among those declared with
                ``system(text, tools=...)`` or ``declare_tools`` (default: every declared
                tool). With tools, the output is read back into ``Generator.tool_calls``
                and ``finish_reason == "tool_calls"`` (docs/agents.md).
            tool_choice: ``"auto"`` (default: text or calls, and a call the model starts
                is constrained to its tool's schema), ``"none"`` (no call, ever: what
                looks like one stays text),
                ``"required"`` (at least one call) or a tool's name (a call of that tool).
                Every call is generated under a constraint: valid JSON for its schema.
            parallel_tool_calls: allow several calls in one answer (at most one per tool
                offered, and at least 2; ``pie_ctx.tools.formats.max_calls``).
            jump_forward: under a constraint, append the tokens it forces (JSON keys, tool
                names, punctuation) in one pass instead of one step each; the output is
                exactly what plain constrained decoding gives (the same tokens, greedy or
                sampled with a seed). False decodes them step by step.
            attention_scores: ``True`` (or a ``ScoresSpec`` with its layers, reduce,
                heads, by_layer and no queries): the attention weights the rows that
                sample the tokens gave each KV entry, summed (or maxed) over the whole
                generation, in ``Generator.attention_scores`` (H2O's heavy hitters;
                docs/compaction.md). No speculation runs with it.

        Raises:
            InvalidArgument: a bad argument (the message says which).
        """
        from pie_ctx.generator import Generator

        core = self._core
        core.check_open()
        info = core.rt.info
        sampler = checks.sampler(P.SamplerSpec() if sampler is None else sampler)
        checks.positive(max_tokens, "max_tokens")
        ids, strings = checks.stop(stop, info.vocab_size)
        for flag, name in ((ignore_eos, "ignore_eos"), (cue, "cue")):
            if not isinstance(flag, bool):
                raise InvalidArgument(f"{name} must be a bool, got {flag!r}")
        for flag, name in ((parallel_tool_calls, "parallel_tool_calls"),
                           (jump_forward, "jump_forward")):
            if not isinstance(flag, bool):
                raise InvalidArgument(f"{name} must be a bool, got {flag!r}")
        checks.count(min_tokens, "min_tokens")
        constraint = constraint_spec(constrain)
        answer = None
        if constraint is not None and (tools is not None or tool_choice is not None
                                       or core.chat.tools):
            # With tools, a JSON Schema constrains the answer (the branch that is no call).
            if not (isinstance(constraint, P.ConstraintSpec)
                    and constraint.kind == "json_schema"):
                raise InvalidArgument("with tools, constrain= takes only JsonSchema (it "
                                      "constrains the answer; the tool format's grammar "
                                      "constrains the calls)")
            answer = json.loads(constraint.source)
        offer = self._tool_offer(tools, tool_choice, parallel_tool_calls, answer)
        if offer is not None:
            constraint = offer.constraint
        rounds = None
        prompt_lookup = 0
        if speculator == "prompt_lookup" and not isinstance(constraint, Constraint):
            prompt_lookup = PROMPT_LOOKUP_DRAFT  # proposed and verified in the engine
        elif speculator is not None:
            if not isinstance(speculator, Speculator):
                raise InvalidArgument("speculator takes 'prompt_lookup' or an object with "
                                      "draft(), accept(tokens) and rollback(n)")
            if isinstance(constraint, P.ConstraintSpec):
                raise InvalidArgument("a speculator of yours cannot be combined with an "
                                      "engine constraint; constrain the drafts yourself")
            rounds = Rounds(speculator=speculator)
        if isinstance(constraint, Constraint):
            rounds = Rounds(speculator=rounds.speculator if rounds else
                            ("prompt_lookup" if speculator == "prompt_lookup" else None),
                            constraint=constraint)
            constraint = None
        scores = None
        if attention_scores is True:
            scores = P.ScoresSpec()
        elif isinstance(attention_scores, P.ScoresSpec):
            scores = attention_scores
        elif attention_scores not in (None, False):
            raise InvalidArgument("attention_scores takes True or a ScoresSpec, got "
                                  f"{attention_scores!r}")
        if scores is not None:
            checks.scores(scores, info, None)
            if rounds is not None or prompt_lookup:
                raise InvalidArgument("attention_scores cannot be combined with a speculator "
                                      "or a constraint object of yours")
        defaults = [] if ignore_eos else list(info.stop_token_ids)
        req = P.Generate(
            ctx=0, tokens=[], sampler=sampler, max_tokens=max_tokens,
            stop_token_ids=sorted(set(defaults + ids)), stop_strings=strings,
            constraint=constraint, logit_bias=checks.logit_bias(logit_bias, info.vocab_size),
            allowed_tokens=checks.allowed_tokens(
                None if allowed_tokens is None else list(allowed_tokens), info.vocab_size),
            top_logprobs=checks.top_logprobs_k(top_logprobs, info.max_top_logprobs),
            min_tokens=min_tokens, jump_forward=jump_forward, prompt_lookup=prompt_lookup,
            attention_scores=scores)
        if constraint is not None and not info.can_constrain:
            raise InvalidArgument("this engine cannot compile constraints (its tokenizer is "
                                  "not a Hugging Face tokenizer.json)")
        return Generator(core, req, rounds, cue=cue, tools=offer)

    async def select(self, options: Sequence[str | Sequence[int]], *,
                     method: str = "token_length_normalized") -> tuple[int, list[float]]:
        """Score each option as a continuation of this context; the context is unchanged.

        All options are scored in one pass that reads the context's pages; options that
        start with the same tokens share them (computed once). Text options are tokenized
        as they are (include the leading space a continuation needs).

        Args:
            options: strings or token id lists.
            method: how to score (SGLang's three choices methods, see docs/decoding.md):
                ``"token_length_normalized"`` (mean token log-probability),
                ``"greedy_token"`` (the first token's log-probability, ties broken by the
                next tokens), ``"unconditional_likelihood_normalized"`` (mean of each
                token's log-probability minus its log-probability without the context).

        Returns:
            ``(best, scores)``: the index of the best option and every option's score.
            Idiom: ``best, _ = await ctx.select(opts); ctx.assistant(opts[best])``.

        Raises:
            InvalidArgument: no options, an empty option, an unknown method.
        """
        core = self._core
        core.check_open()
        if method not in SELECT_METHODS:
            raise InvalidArgument(f"method must be one of {', '.join(SELECT_METHODS)}, "
                                  f"got {method!r}")
        if isinstance(options, str) or not options:
            raise InvalidArgument("select takes a non-empty list of options")
        token_lists = [list(core.rt.tokenizer.encode(checks.text(o, "select option")))
                       if isinstance(o, str) else checks.token_ids(o, core.rt.info.vocab_size,
                                                                   "select option")
                       for o in options]
        if any(not t for t in token_lists):
            raise InvalidArgument("every option needs at least one token")
        unconditional = method == "unconditional_likelihood_normalized"

        async def body() -> tuple[int, list[float]]:
            req = P.Select(ctx=0, options=token_lists, unconditional=unconditional)
            checks.select(req, core.rt.info, core.state.seq_len + len(core.pending))
            await core.write_pending()
            reply = await core.request(P.Select, options=token_lists,
                                       unconditional=unconditional)
            return select_scores(method, reply.logprobs, reply.unconditional)

        return await core.run(body)

    def fork(self) -> Context:
        """A new context sharing this one's committed pages (its working tail is copied).

        Synchronous: the runtime-side fork happens in the background, before any later
        operation on this context. Pending tokens and the conversation are copied too.
        """
        core = self._core
        core.check_open()
        child = ContextCore(core.rt)
        child.state = core.state
        child.pending = list(core.pending)
        child.chat = core.chat.copy()

        async def body() -> None:
            child.adopt(await core.request(P.ForkContext))

        op = core.spawn(body)
        child.created = op
        child.chain = OpChain(after=op)
        return Context(core.rt, _core=child)

    async def truncate(self, n: int) -> None:
        """Drop the last ``n`` tokens: pending ones first, then tokens in working pages.

        ``generate()`` keeps working afterwards: with nothing pending, it recomputes the
        logits of the (new) last token in the KV cache, which costs one token of compute.

        Raises:
            InvalidArgument: ``n`` reaches into committed pages (nothing is changed).
        """
        core = self._core
        core.check_open()
        checks.count(n, "truncate(n)")

        async def body() -> None:
            from_pending = min(n, len(core.pending))
            rest = n - from_pending
            if rest:
                core.set_state((await core.request(P.TruncateTokens, num_tokens=rest)).state)
            if from_pending:
                del core.pending[len(core.pending) - from_pending:]
            if n:
                core.chat.synced = False
        await core.run(body)

    async def compact(self, keep: Any) -> P.ContextState:
        """Keep only the tokens at ``keep`` and drop the rest, anywhere in the context.

        ``keep`` is sorted token indices (of :meth:`tokens`), or ranges: ints,
        ``range`` objects and ``(start, stop)`` pairs, in order. Pending tokens are
        written first, so they can be kept or dropped like the others. The kept tokens'
        K/V are kept as computed, at their positions (they saw the dropped tokens when
        they were computed); the next token goes after the last kept position
        (:meth:`positions`). Leading pages kept whole are shared, not copied. See
        docs/compaction.md.

        Returns:
            The context's counters after the compaction.

        Raises:
            InvalidArgument: ``keep`` empty, unsorted, repeated or out of range.
            OutOfPages: no room for the copies. Nothing changes on any error.
        """
        core = self._core
        core.check_open()
        indices = checks.keep_ranges(keep)

        async def body() -> P.ContextState:
            checks.keep(indices, core.state.seq_len + len(core.pending))
            await core.write_pending()
            core.set_state((await core.request(P.Compact, keep=indices)).state)
            core.chat.synced = False  # the KV no longer holds the whole conversation
            return core.state
        return await core.run(body)

    async def retain(self, ttl: float, priority: int = 0,
                     num_tokens: int | None = None) -> P.HoldReply:
        """Ask the engine to keep this context's pages cached for ``ttl`` seconds, even
        after the context is released: an agent waiting on a tool keeps its prefix warm.

        Pending tokens are written first. The hold covers the committed pages (those of
        the first ``num_tokens`` tokens, if given; a partly filled last page is not held).
        Under memory pressure held pages go only after every unheld cached page, lower
        ``priority`` first; with a snapshot directory they go to disk first. The hold ends
        after ``ttl`` seconds or at ``rt.release_hold``. See docs/pages.md, "Holds".

        Args:
            ttl: seconds to keep the pages, in ``(0, 86400]`` (a day).
            priority: an int in ``[0, 100]``; higher is evicted later.
            num_tokens: hold only the leading tokens' whole pages (None: all of them).

        Returns:
            The hold: ``hold`` (its id), ``num_pages``, ``ttl``, ``priority``.

        Raises:
            InvalidArgument: ``ttl``, ``priority`` or ``num_tokens`` out of range.
            HoldLimit: this client's holds would cover more than
                ``rt.info.max_held_pages_per_owner`` pages. Nothing changes on any error.
        """
        core = self._core
        core.check_open()
        ttl, priority, num_tokens = checks.hold_terms(ttl, priority, num_tokens)

        async def body() -> P.HoldReply:
            await core.write_pending()
            return await core.request(P.Retain, ttl=ttl, priority=priority,
                                      num_tokens=num_tokens)
        return await core.run(body)

    async def suspend(self, *, lazy: bool = False, back_in: float | None = None) -> int:
        """Take this context's pages out of the engine's pool while it waits (on a tool, a
        user, a message); its next use brings them back without recomputing a token.

        Committed pages stay cached, evicted last among cached pages and, with a snapshot
        directory, written to disk when evicted; working pages are copied to host memory.
        Pending tokens stay pending. The engine also suspends idle contexts by itself when
        it needs room. See docs/pages.md, "Suspend and resume".

        Args:
            lazy: only tell the engine this context is idle: it is suspended when the
                engine needs its room, not now.
            back_in: your estimate of the seconds until this context is used again; under
                pressure the engine suspends first the contexts expected back furthest off.

        Returns:
            The pages the context held in the pool (0 with ``lazy``).

        Raises:
            InvalidArgument: ``back_in`` negative or not a finite number.
        """
        core = self._core
        core.check_open()
        if back_in is not None:
            back_in = checks.finite(back_in, "back_in")
            if back_in < 0:
                raise InvalidArgument(f"suspend: back_in must be >= 0 seconds, got {back_in!r}")

        async def body() -> int:
            reply = await core.request(P.Suspend, lazy=bool(lazy), back_in=back_in)
            return reply.num_pages
        return await core.run(body)

    def save(self, name: str) -> Op:
        """Flush pending tokens, then save this context as the snapshot ``name``.

        The snapshot holds references to the context's pages (nothing is copied but the
        working tail) and its conversation, and outlives the inferlet. Queued in order like
        ``fork()``; ``await`` the result to see errors (``SnapshotExists``). An error nobody
        awaited is raised by the next operation on this context.
        """
        core = self._core
        core.check_open()
        name = checks.snapshot_name(name)

        async def body() -> None:
            await core.write_pending()
            await core.request(P.SaveSnapshot, name=name, meta=core.chat.to_meta())

        return core.spawn(body, watch=True)

    async def release(self) -> None:
        """Free this context's pages (shared pages stay with their other holders).

        Idempotent; any later use raises ``ContextClosed``. A generation still running on
        the context is cancelled (its stream ends with ``ContextClosed``)."""
        await self._core.release()

    async def __aenter__(self) -> Context:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.release()

    # ----------------------------------------------------------- raw and explicit passes

    def inner(self) -> RawContext:
        """The raw page handle: reserve/commit/release working pages, truncate tokens."""
        from pie_ctx.raw import RawContext

        self._core.check_open()
        return RawContext(self._core)

    def forward(self) -> Forward:
        """Build one explicit forward pass (see ``pie_ctx.forward.Forward``)."""
        from pie_ctx.forward import Forward

        self._core.check_open()
        return Forward(self._core)

