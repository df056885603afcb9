"""``Context``: one KV sequence an inferlet builds, forks, generates from and saves.

Owns nothing itself: its state lives in a ``ContextCore`` (handle, pending tokens,
conversation, operation order). It keeps no page counters of its own: ``seq_len`` and
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

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from pie_ctx.core import ContextCore
from pie_ctx.counters import Counters
from pie_ctx.ops import Op, OpChain
from pie_ctx.proto import checks
from pie_ctx.proto import messages as P
from pie_ctx.proto.errors import InvalidArgument

if TYPE_CHECKING:
    from pie_ctx.forward import Forward
    from pie_ctx.generator import Generator
    from pie_ctx.raw import RawContext
    from pie_ctx.runtime import Runtime

__all__ = ["Context"]


class Context(Counters):
    """A context on the runtime. Creating one is synchronous; the runtime side is created
    in the background, in order with everything else done to it.

    Args:
        rt: the inferlet's runtime.

    Raises:
        ContextClosed: the runtime is closed.
    """

    def __init__(self, rt: Runtime, *, _core: ContextCore | None = None) -> None:
        if _core is None:
            _core = ContextCore(rt)
            _core.created = _core.spawn(_core.create)
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
    def is_released(self) -> bool:
        """True after ``release()``: every further use (counters included) raises
        ``ContextClosed``."""
        return self._core.released

    async def refresh(self) -> P.ContextState:
        """Ask the runtime for this context's counters now."""
        core = self._core

        async def body() -> P.ContextState:
            core.set_state((await core.request(P.GetState)).state)
            return core.state
        return await core.run(body)

    # ---------------------------------------------------------------------- fillers

    def system(self, text: str) -> Context:
        """Add a system turn (tokenized through the chat template into pending tokens)."""
        return self._fill("system", text)

    def user(self, text: str) -> Context:
        """Add a user turn."""
        return self._fill("user", text)

    def assistant(self, text: str) -> Context:
        """Add an assistant turn (or complete the one a ``cue()`` opened)."""
        core = self._core
        core.check_open()
        text = checks.text(text, "assistant()")
        core.pending.extend(core.chat.add_assistant(core.rt.tokenizer, text))
        return self

    def cue(self) -> Context:
        """Open the assistant turn: add the template's generation prompt (e.g.
        ``<|im_start|>assistant\\n``). A no-op while the turn is already open."""
        core = self._core
        core.check_open()
        core.pending.extend(core.chat.cue(core.rt.tokenizer))
        return self

    def append(self, tokens: Sequence[int] | str) -> Context:
        """Add raw token ids, or raw text tokenized without any template."""
        core = self._core
        core.check_open()
        if isinstance(tokens, str):
            ids = list(core.rt.tokenizer.encode(checks.text(tokens, "append()")))
        else:
            ids = checks.token_ids(tokens, core.rt.info.vocab_size, "append")
        core.pending.extend(ids)
        core.chat.note_raw()
        return self

    def _fill(self, role: str, text: str) -> Context:
        core = self._core
        core.check_open()
        text = checks.text(text, f"{role}()")
        core.pending.extend(core.chat.add(core.rt.tokenizer, role, text))
        return self

    # ------------------------------------------------------------------- operations

    async def flush(self) -> P.PassReport:
        """Write the pending tokens into the KV cache and commit every full page.

        Full pages whose contents the runtime already holds (from any context) are attached
        instead of computed; the report says how many pages were reused vs computed.
        """
        return await self._core.run(self._core.write_pending)

    def generate(self, sampler: P.SamplerSpec | None = None, *, max_tokens: int = 256,
                 stop: Sequence[int | str] | str | int | None = (),
                 ignore_eos: bool = False) -> Generator:
        """Generate from this context; returns a :class:`Generator` (nothing runs until it
        is iterated or collected).

        Args:
            sampler: a ``Sampler.*`` value; default greedy.
            max_tokens: most tokens to generate.
            stop: token ids and/or strings that end generation (one str is one stop
                string). A matched stop string is excluded from the text. The model's
                end-of-turn tokens always stop unless ``ignore_eos``.
            ignore_eos: do not stop at the model's end-of-turn tokens.

        Raises:
            InvalidArgument: a bad sampler, ``max_tokens`` or stop condition.
        """
        from pie_ctx.generator import Generator

        core = self._core
        core.check_open()
        sampler = P.SamplerSpec() if sampler is None else sampler
        if not isinstance(sampler, P.SamplerSpec):
            raise InvalidArgument(f"sampler must come from Sampler.* (a SamplerSpec), got {sampler!r}")
        checks.positive(max_tokens, "max_tokens")
        ids, strings = checks.stop(stop, core.rt.info.vocab_size)
        if not isinstance(ignore_eos, bool):
            raise InvalidArgument(f"ignore_eos must be a bool, got {ignore_eos!r}")
        defaults = [] if ignore_eos else list(core.rt.info.stop_token_ids)
        return Generator(core, sampler, max_tokens, sorted(set(defaults + ids)), strings)

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
