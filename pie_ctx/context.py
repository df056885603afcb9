"""``Context``: one KV sequence an inferlet builds, forks, generates from and saves.

Owns: the SDK side of one context: its handle, its *pending* tokens (filled but not yet in
the KV cache), its conversation, and the order of its operations. It keeps no page
counters of its own: ``seq_len`` and friends are the runtime's state as returned with the
latest reply (``await ctx.refresh()`` asks again).

Usage::

    base = Context(rt).system("You are terse.").user("Why is the sky blue?").cue()
    report = await base.flush()                     # prefill, commit full pages
    forks = [base.fork() for _ in range(4)]         # share every committed page
    texts = await asyncio.gather(*(f.generate(Sampler.top_p(0.7, 0.95), max_tokens=64).text()
                                   for f in forks))
    await base.save("sky-prefix")                   # a snapshot that outlives this program
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from pie_ctx import protocol as P
from pie_ctx.chat import Conversation
from pie_ctx.checks import token_ids
from pie_ctx.counters import Counters
from pie_ctx.errors import ContextClosed, InvalidArgument
from pie_ctx.ops import Op, OpChain

if TYPE_CHECKING:
    from pie_ctx.forward import Forward
    from pie_ctx.generator import Generator
    from pie_ctx.raw import RawContext
    from pie_ctx.runtime import Runtime

__all__ = ["Context"]

log = logging.getLogger("pie_ctx")


def _empty_state(page_size: int) -> P.ContextState:
    return P.ContextState(seq_len=0, page_size=page_size, num_committed_pages=0,
                          num_working_pages=0, num_working_tokens=0, next_position=0)


class Context(Counters):
    """A context on the runtime. Creating one is synchronous; the runtime side is created
    in the background, in order with everything else done to it.

    Args:
        rt: the inferlet's runtime.
    """

    def __init__(self, rt: Runtime, *, _created: bool = False) -> None:
        self._rt = rt
        self._transport = rt.transport
        self._handle: int | None = None
        self._state = _empty_state(rt.page_size)
        self._pending: list[int] = []
        self._chat = Conversation()
        self._chain = OpChain()
        self._released = False
        self._created: Op | None = None
        if not _created:
            self._created = self._spawn(self._create_remote)

    # ------------------------------------------------------------------ construction

    async def _create_remote(self) -> None:
        reply = await self._transport.request(P.CreateContext())
        self._adopt(reply)

    def _adopt(self, reply: P.ContextReply) -> None:
        self._handle, self._state = reply.ctx, reply.state
        if self._released:  # released before creation finished
            self._transport.release_soon(reply.ctx)

    def _spawn(self, body: Any) -> Op:
        op, run = self._chain.enqueue(body)
        self._rt.spawn(run)
        return op

    @classmethod
    async def open(cls, rt: Runtime, name: str) -> Context:
        """A new context forked from the snapshot ``name`` (the snapshot is unchanged).

        Raises:
            SnapshotNotFound: no snapshot has that name.
        """
        return cls._from_reply(rt, await rt.transport.request(P.OpenSnapshot(name=_name(name))))

    @classmethod
    async def take(cls, rt: Runtime, name: str) -> Context:
        """Open the snapshot ``name`` and delete it, in one step (no copy)."""
        return cls._from_reply(rt, await rt.transport.request(P.TakeSnapshot(name=_name(name))))

    @classmethod
    async def delete(cls, rt: Runtime, name: str) -> None:
        """Delete the snapshot ``name``; its pages are freed once nothing else uses them."""
        await rt.transport.request(P.DeleteSnapshot(name=_name(name)))

    @classmethod
    def _from_reply(cls, rt: Runtime, reply: P.ContextReply) -> Context:
        ctx = cls(rt, _created=True)
        ctx._adopt(reply)
        ctx._chat = Conversation.from_meta(reply.meta)
        return ctx

    # --------------------------------------------------------------------- counters

    def _context_state(self) -> P.ContextState:
        return self._state

    @property
    def pending_tokens(self) -> list[int]:
        """Tokens filled in but not yet written to the KV cache (a copy)."""
        return list(self._pending)

    @property
    def is_released(self) -> bool:
        """True after ``release()``: every further use raises ``ContextClosed``."""
        return self._released

    async def refresh(self) -> P.ContextState:
        """Ask the runtime for this context's counters now."""
        async def body() -> P.ContextState:
            self._state = (await self._request(P.GetState, {})).state
            return self._state
        return await self._chain.run(body)

    # ---------------------------------------------------------------------- fillers

    def system(self, text: str) -> Context:
        """Add a system turn (tokenized through the chat template into pending tokens)."""
        return self._fill("system", text)

    def user(self, text: str) -> Context:
        """Add a user turn."""
        return self._fill("user", text)

    def assistant(self, text: str) -> Context:
        """Add an assistant turn (or complete the one a ``cue()`` opened)."""
        self._check_open()
        self._pending.extend(self._chat.add_assistant(self._rt.tokenizer, text))
        return self

    def cue(self) -> Context:
        """Add the template's generation prompt (e.g. ``<|im_start|>assistant\\n``)."""
        self._check_open()
        self._pending.extend(self._chat.add(self._rt.tokenizer, None, None, generation_prompt=True))
        return self

    def append(self, tokens: Sequence[int] | str) -> Context:
        """Add raw token ids, or raw text tokenized without any template."""
        self._check_open()
        if isinstance(tokens, str):
            ids = list(self._rt.tokenizer.encode(tokens))
        else:
            ids = token_ids(tokens, self._rt.info.vocab_size, "append")
        self._pending.extend(ids)
        return self

    def _fill(self, role: str, text: str) -> Context:
        self._check_open()
        self._pending.extend(self._chat.add(self._rt.tokenizer, role, text))
        return self

    # ------------------------------------------------------------------- operations

    async def flush(self) -> P.PassReport:
        """Write the pending tokens into the KV cache and commit every full page.

        Full pages whose contents the runtime already holds (from any context) are attached
        instead of computed; the report says how many pages were reused vs computed.
        """
        self._check_open()
        return await self._chain.run(self._write_pending)

    async def _write_pending(self) -> P.PassReport:
        """Flush's body (runs inside the chain)."""
        self._check_open()
        if not self._pending:
            return P.PassReport()
        tokens = list(self._pending)
        reply = await self._request(P.Forward, {"tokens": tokens, "reuse_prefix": True})
        del self._pending[: len(tokens)]
        self._state = reply.state
        return reply.report

    def generate(self, sampler: P.SamplerSpec | None = None, *, max_tokens: int = 256,
                 stop: Sequence[int | str] = (), ignore_eos: bool = False) -> Generator:
        """Generate from this context; returns a :class:`Generator` (nothing runs until it
        is iterated or collected).

        Args:
            sampler: a ``Sampler.*`` value; default greedy.
            max_tokens: most tokens to generate.
            stop: token ids and/or strings that end generation. A matched stop string is
                excluded from the text. The model's end-of-turn tokens always stop unless
                ``ignore_eos``.
        """
        from pie_ctx.generator import Generator

        self._check_open()
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise InvalidArgument(f"max_tokens must be a positive int, got {max_tokens!r}")
        ids = [s for s in stop if not isinstance(s, str)]
        strings = [s for s in stop if isinstance(s, str)]
        token_ids(ids, self._rt.info.vocab_size, "stop")
        if any(not s for s in strings):
            raise InvalidArgument("stop strings must be non-empty")
        defaults = [] if ignore_eos else list(self._rt.info.stop_token_ids)
        return Generator(self, sampler or P.SamplerSpec(), max_tokens,
                         sorted(set(defaults + ids)), strings)

    def fork(self) -> Context:
        """A new context sharing this one's committed pages (its working tail is copied).

        Synchronous: the runtime-side fork happens in the background, before any later
        operation on this context. Pending tokens and the conversation are copied too.
        """
        self._check_open()
        child = Context(self._rt, _created=True)
        child._state = self._state
        child._pending = list(self._pending)
        child._chat = self._chat.copy()

        async def body() -> None:
            reply = await self._request(P.ForkContext, {})
            child._adopt(reply)

        op = self._spawn(body)
        child._created = op
        child._chain = OpChain(after=op)
        return child

    async def truncate(self, n: int) -> None:
        """Drop the last ``n`` tokens: pending ones first, then tokens in working pages.

        Raises:
            InvalidArgument: ``n`` reaches into committed pages (nothing is changed).
        """
        self._check_open()
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise InvalidArgument(f"truncate needs a non-negative int, got {n!r}")

        async def body() -> None:
            from_pending = min(n, len(self._pending))
            rest = n - from_pending
            if rest:
                reply = await self._request(P.TruncateTokens, {"num_tokens": rest})
                self._state = reply.state
            if from_pending:
                del self._pending[len(self._pending) - from_pending:]
            if n:
                self._chat.synced = False
        await self._chain.run(body)

    def save(self, name: str) -> Op:
        """Flush pending tokens, then save this context as the snapshot ``name``.

        The snapshot holds references to the context's pages (nothing is copied but the
        working tail) and its conversation, and outlives the inferlet. Queued in order like
        ``fork()``; ``await`` the result to see errors (``SnapshotExists``).
        """
        self._check_open()
        name = _name(name)

        async def body() -> None:
            await self._write_pending()
            await self._request(P.SaveSnapshot, {"name": name, "meta": self._chat.to_meta()})

        return self._spawn(body)

    async def release(self) -> None:
        """Free this context's pages (shared pages stay with their other holders).
        Idempotent; any later use raises ``ContextClosed``."""
        if self._released:
            return

        async def body() -> None:
            self._released = True
            if self._handle is not None:
                await self._transport.request(P.ReleaseContext(ctx=self._handle))
        await self._chain.run(body)

    async def __aenter__(self) -> Context:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.release()

    def __del__(self) -> None:
        if getattr(self, "_released", True) or getattr(self, "_handle", None) is None:
            return
        if os.environ.get("PIE_CTX_DEBUG"):
            log.warning("context %s was garbage collected without release(); releasing it",
                        self._handle)
        self._transport.release_soon(self._handle)

    # ----------------------------------------------------------- raw and explicit passes

    def inner(self) -> RawContext:
        """The raw page handle: reserve/commit/release working pages, truncate tokens."""
        from pie_ctx.raw import RawContext

        self._check_open()
        return RawContext(self)

    def forward(self) -> Forward:
        """Build one explicit forward pass (see ``pie_ctx.forward.Forward``)."""
        from pie_ctx.forward import Forward

        self._check_open()
        return Forward(self)

    # ---------------------------------------------------------------------- internals

    def _check_open(self) -> None:
        if self._released:
            raise ContextClosed("this context was released; fork, open or create a new one")

    async def _request(self, cls: type, fields: dict[str, Any]) -> Any:
        """Send a request about this context (inside its chain: the handle exists)."""
        self._check_open()
        if self._handle is None:
            if self._created is not None and self._created.error is not None:
                raise self._created.error  # why creating (or forking) it failed
            raise ContextClosed("this context was never created on the runtime")
        return await self._transport.request(cls(ctx=self._handle, **fields))


def _name(name: Any) -> str:
    if not isinstance(name, str) or not name or len(name) > 256:
        raise InvalidArgument(f"snapshot names are non-empty str of at most 256 chars, got {name!r}")
    return name

