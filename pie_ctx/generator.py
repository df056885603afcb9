"""``Generator``: a generation in progress, streamed or collected.

Owns: one ``Generate`` request's stream and the update of its context when it ends. Nothing
runs until the generator is iterated or collected. ``async for delta in gen`` yields
:class:`Delta` values (new token ids and the text they completed; text never splits a
character and never shows a stop string or what follows it).

Usage::

    gen = ctx.generate(Sampler.greedy(), max_tokens=64, stop=["\\n\\n"])
    async for delta in gen:
        print(delta.text, end="", flush=True)
    print(gen.finish_reason)       # "stop_token" | "stop_string" | "length"
"""

from __future__ import annotations

from collections.abc import Generator as SyncGenerator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pie_ctx import protocol as P
from pie_ctx.errors import error_from_name

if TYPE_CHECKING:
    from pie_ctx.context import Context
    from pie_ctx.ops import Op

__all__ = ["Generator", "Delta"]


@dataclass(slots=True, frozen=True)
class Delta:
    """What one step of a generation produced."""

    tokens: list[int]
    text: str
    logprobs: list[float]


class Generator:
    """One generation on one context; single use."""

    def __init__(self, ctx: Context, sampler: P.SamplerSpec, max_tokens: int,
                 stop_token_ids: list[int], stop_strings: list[str]) -> None:
        self._ctx = ctx
        self._sampler = sampler
        self._max_tokens = max_tokens
        self._stop_ids = stop_token_ids
        self._stop_strings = stop_strings
        self._stream: Any = None
        self._op: Op | None = None
        self._started = False
        self._finished = False
        self._prompt: list[int] = []
        self.tokens_out: list[int] = []
        self.logprobs: list[float] = []  # the model's log-probability of each token
        self.text_out = ""
        self.finish_reason: str | None = None
        self.report: P.PassReport | None = None

    # ------------------------------------------------------------------ iteration

    def __aiter__(self) -> Generator:
        return self

    async def __anext__(self) -> Delta:
        if self._finished:
            raise StopAsyncIteration
        if not self._started:
            await self._start()
        try:
            msg = await self._stream.__anext__()
        except StopAsyncIteration:
            self._end(RuntimeError("the generation stream ended without a final message"))
            raise
        except BaseException:
            await self.aclose()
            raise
        if isinstance(msg, P.GenerateChunk):
            self.tokens_out.extend(msg.tokens)
            self.logprobs.extend(msg.logprobs)
            self.text_out += msg.text
            return Delta(tokens=list(msg.tokens), text=msg.text, logprobs=list(msg.logprobs))
        if isinstance(msg, P.GenerateDone):
            self._done(msg)
            raise StopAsyncIteration
        if isinstance(msg, P.ErrorReply):
            err = error_from_name(msg.kind, msg.message)
            self._end(err)
            raise err
        err2 = RuntimeError(f"unexpected message in a generation stream: {type(msg).__name__}")
        self._end(err2)
        raise err2

    async def _start(self) -> None:
        self._started = True
        ctx = self._ctx
        self._op, wait = ctx._chain.acquire()
        try:
            await wait()
            ctx._check_open()
            if ctx._handle is None:
                await ctx._request(P.GetState, {})  # raises why the context does not exist
            self._prompt = list(ctx._pending)
            req = P.Generate(ctx=ctx._handle, tokens=self._prompt, sampler=self._sampler,
                             max_tokens=self._max_tokens, stop_token_ids=self._stop_ids,
                             stop_strings=self._stop_strings)
            self._stream = await ctx._transport.generate(req)
        except BaseException as exc:
            self._end(exc if isinstance(exc, Exception) else None)
            raise

    def _done(self, msg: P.GenerateDone) -> None:
        ctx = self._ctx
        ctx._state = msg.state
        # Tokens filled in while it ran stay after the (pending) last generated token.
        ctx._pending[:] = list(msg.pending) + ctx._pending[len(self._prompt):]
        tok = ctx._rt.tokenizer
        ctx._chat.record_generation(tok.decode(msg.tokens), self.text_out)
        self.finish_reason = msg.finish_reason
        self.report = msg.report
        self.tokens_out = list(msg.tokens)
        self._end(None)

    def _end(self, error: BaseException | None) -> None:
        if self._finished:
            return
        self._finished = True
        if self._op is not None:
            self._op.error = error
            self._op.done.set()

    async def aclose(self) -> None:
        """Stop early: the generation is cancelled and the context left as it was (if the
        generation had already finished, its result is kept)."""
        if self._finished:
            return
        stream, self._stream = self._stream, None
        if stream is not None:
            await stream.aclose()
        await self._resync()
        self._end(None)

    async def _resync(self) -> None:
        ctx = self._ctx
        if ctx._handle is None or ctx._released:
            return
        before = ctx._state.seq_len
        try:
            state = (await ctx._transport.request(P.GetState(ctx=ctx._handle))).state
        except Exception:  # noqa: BLE001 - best effort; the next reply refreshes the state
            return
        ctx._state = state
        if state.seq_len != before:  # it finished before the cancel: the prompt is in KV
            del ctx._pending[: len(self._prompt)]
            ctx._chat.synced = False

    def __del__(self) -> None:
        if self._started and not self._finished:
            stream = self._stream
            if stream is not None and hasattr(stream, "close"):
                stream.close()
            self._finished = True
            if self._op is not None:
                self._op.done.set()

    # ----------------------------------------------------------------- collection

    async def text(self) -> str:
        """Run to the end; the generated text (without any stop string)."""
        async for _ in self:
            pass
        return self.text_out

    async def tokens(self) -> list[int]:
        """Run to the end; every generated token id (the last one is still pending)."""
        async for _ in self:
            pass
        return list(self.tokens_out)

    def __await__(self) -> SyncGenerator[Any, None, str]:
        return self.text().__await__()
