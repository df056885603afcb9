"""``Generator``: a generation in progress, streamed or collected.

Owns: one ``Generate`` request's stream and the update of its context when it ends. Nothing
runs until the generator is iterated or collected. ``async for delta in gen`` yields
:class:`Delta` values (new token ids and the text they completed; text never splits a
character and never shows a stop string or what follows it).

Messages are read from the stream by whoever needs them first: the consumer, or an
operation queued behind the generation on the same context (which then reads it to the
end; see ``pie_ctx.ops``). Their effects on the context are applied as they are read and
the deltas are kept for the consumer, so a generator nobody iterates still finishes, and
one that is iterated later still yields everything.

Usage::

    gen = ctx.generate(Sampler.greedy(), max_tokens=64, stop=["\\n\\n"])
    async for delta in gen:
        print(delta.text, end="", flush=True)
    print(gen.finish_reason)   # "stop_token" | "stop_string" | "length" | "constraint"
                               # | "tool_calls" (with tools= and a call made)
"""

from __future__ import annotations

import collections
from collections.abc import Generator as SyncGenerator
from dataclasses import dataclass, field
from typing import Any

import anyio
import msgspec

from pie_ctx.core import Cancellable, ContextCore
from pie_ctx.ops import Op
from pie_ctx.proto import messages as P
from pie_ctx.proto.errors import PieError, ProtocolError, error_from_name
from pie_ctx.rounds import Rounds, RoundStream
from pie_ctx.speculate import PromptLookup
from pie_ctx.tools.formats import Parsed, ToolOffer
from pie_ctx.tools.tool import ToolCall

__all__ = ["Generator", "Delta"]


@dataclass(slots=True, frozen=True)
class Delta:
    """What one step of a generation produced (one token, or several in a speculative
    round or a jump over forced tokens). ``logprobs``, ``top_logprobs`` and ``entropy`` have
    one entry per token; the last two are filled when ``generate(top_logprobs=k)`` asked
    for them.

    ``text`` is the model's own text. With tools, ``content`` is the part of it meant for
    the reader (tool-call markup held back and removed) and ``tool_calls`` the calls this
    delta completed, so a program can start a tool while the answer goes on; without
    tools, ``content == text``."""

    tokens: list[int]
    text: str
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    entropy: list[float] = field(default_factory=list)
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)


class Generator(Cancellable):
    """One generation on one context; single use."""

    def __init__(self, core: ContextCore, req: P.Generate, rounds: Rounds | None = None,
                 cue: bool = True, tools: ToolOffer | None = None) -> None:
        self._core = core
        self._tools = tools
        self._reader = None if tools is None else tools.reader()
        self._req = req  # the settings; ``ctx`` and ``tokens`` are filled in when it starts
        self._rounds = rounds
        self._cue = cue
        self._stream: Any = None
        self._op: Op | None = None
        self._started = False
        self._streamed = True  # False when collected whole (text(), ...) from the start
        self._finished = False  # the stream ended (done, failed or cancelled)
        self._error: BaseException | None = None  # raised once the deltas are consumed
        self._deltas: collections.deque[Delta] = collections.deque()
        self._read_lock = anyio.Lock()
        self._prompt: list[int] = []
        self._undo_cue: tuple[Any, int] | None = None  # (conversation, pending length) before
        self.tokens_out: list[int] = []
        self.logprobs: list[float] = []  # the model's log-probability of each token
        self.top_logprobs: list[list[tuple[int, float]]] = []  # per token, with top_logprobs=
        self.entropies: list[float] = []  # per token, with top_logprobs=
        self.text_out = ""  # the model's text (with tools: tool-call markup included)
        self.content = ""  # the text for the reader (with tools: without the markup)
        self.tool_calls: list[ToolCall] = []  # with tools: the calls the model made
        self.finish_reason: str | None = None  # ... or "tool_calls" or "cancelled"
        self.report: P.PassReport | None = None
        # with attention_scores=: float32 [layers]? [heads]? [seq_len], once it ended
        self.attention_scores: Any = None

    # ------------------------------------------------------------------ iteration

    def __aiter__(self) -> Generator:
        return self

    async def __anext__(self) -> Delta:
        if not self._started:
            await self._start()
        while not self._deltas and not self._finished:
            await self._read_one()
        if self._deltas:
            return self._deltas.popleft()
        if self._error is not None:
            err, self._error = self._error, None
            raise err
        raise StopAsyncIteration

    async def _start(self) -> None:
        self._started = True
        core = self._core
        try:
            core.check_open()
        except PieError as err:
            self._finished = True
            raise err from None
        self._op, wait = core.chain.acquire()
        self._op.drain = self._drain
        core.started(self)
        try:
            await wait()
            core.check_open()
            core.raise_unobserved()
            if core.handle is None:
                await core.request(P.GetState)  # raises why the context does not exist
            if self._cue and core.chat.awaits_answer:  # a system/user turn wants its answer
                self._undo_cue = (core.chat.copy(), len(core.pending))
                core.pending.extend(core.chat.cue(core.rt.tokenizer))
            self._prompt = list(core.pending)
            req = msgspec.structs.replace(self._req, ctx=core.handle, tokens=self._prompt,
                                          stream=self._streamed)
            if self._rounds is None:
                self._stream = await core.transport.generate(req)
            else:
                self._stream = await self._round_stream(req)
        except BaseException as exc:
            self._end(exc if isinstance(exc, Exception) else None)
            self._error = None  # raised right here, not again later
            raise

    async def _round_stream(self, req: P.Generate) -> RoundStream:
        core = self._core
        rounds = self._rounds
        if rounds.speculator == "prompt_lookup":  # built on the context's own tokens
            history = (await core.request(P.GetTokens)).token_ids + self._prompt
            rounds = Rounds(speculator=PromptLookup(history), constraint=rounds.constraint)
        return RoundStream(core.transport, core.handle, core.state, self._prompt, req, rounds,
                           core.rt.tokenizer)

    async def _drain(self) -> None:
        """Read the stream to its end (for an operation queued behind this one)."""
        while not self._finished:
            await self._read_one()

    async def _read_one(self) -> None:
        """Read one message from the stream and apply it (one reader at a time)."""
        async with self._read_lock:
            if self._finished:
                return
            try:
                msg = await self._stream.__anext__()
            except StopAsyncIteration:
                msg = None
            except Exception:
                if self._finished:
                    return  # stopped under us (release, aclose): the reason is recorded
                await self.aclose()
                raise
            except BaseException:  # our own task is cancelled: stop the generation
                await self.aclose()
                raise
            if not self._finished:
                self._apply(msg)

    def _apply(self, msg: Any) -> None:
        if isinstance(msg, P.GenerateChunk):
            tops = [list(zip(t.token_ids, t.logprobs, strict=True)) for t in msg.top_logprobs]
            self.tokens_out.extend(msg.tokens)
            self.logprobs.extend(msg.logprobs)
            self.top_logprobs.extend(tops)
            self.entropies.extend(msg.entropy)
            self.text_out += msg.text
            content, calls = self._read(msg.text)
            self._deltas.append(Delta(tokens=list(msg.tokens), text=msg.text,
                                      logprobs=list(msg.logprobs), top_logprobs=tops,
                                      entropy=list(msg.entropy), content=content,
                                      tool_calls=calls))
        elif isinstance(msg, P.GenerateDone):
            self._done(msg)
        elif isinstance(msg, P.ErrorReply):
            self._end(error_from_name(msg.kind, msg.message))
        elif msg is None:
            self._end(ProtocolError("the generation stream ended without a final message"))
        else:
            self._end(ProtocolError(f"unexpected message in a generation stream: "
                                    f"{type(msg).__name__}"))

    def _read(self, text: str) -> tuple[str, list[ToolCall]]:
        """The reader's part of new model text, and the tool calls it completed."""
        if self._reader is None:
            self.content += text
            return text, []
        done = len(self._reader.calls_done)
        content = self._reader.feed(text)
        calls = self._reader.calls_done[done:]
        self.content += content
        self.tool_calls.extend(calls)
        return content, calls

    def _done(self, msg: P.GenerateDone) -> None:
        core = self._core
        core.set_state(msg.state)
        # Tokens filled in while it ran stay after the (pending) last generated token.
        core.pending[:] = list(msg.pending) + core.pending[len(self._prompt):]
        raw = core.rt.tokenizer.decode(msg.tokens)
        self.finish_reason = msg.finish_reason
        if self._reader is None:
            # The answer as the context holds it: a matched stop string included (its
            # tokens are in the KV cache), so the next turn renders after it.
            answer = core.rt.tokenizer.decode(msg.tokens, skip_special_tokens=True)
            core.chat.record_generation(raw, answer, core.rt.tokenizer)
        else:
            tail = self._reader.finish()
            if tail:  # held back (an unfinished call, say): the reader gets it now
                self.content += tail
                self._deltas.append(Delta(tokens=[], text="", logprobs=[], content=tail))
            message = self._tools.format.assistant_message(
                self.text_out, Parsed(self.content, self.tool_calls))
            core.chat.record_tool_generation(raw, message,
                                             {c.id: c.name for c in self.tool_calls})
            if self.tool_calls and msg.finish_reason != "length":
                self.finish_reason = "tool_calls"
        self.report = msg.report
        if msg.attention_scores is not None:
            from pie_ctx.forward import scores_array

            self.attention_scores = scores_array(msg.attention_scores)
        self.tokens_out = list(msg.tokens)
        self._end(None)

    def _end(self, error: BaseException | None) -> None:
        """The generation is over: free the context's chain (the first call wins)."""
        if self._finished:
            return
        self._finished = True
        self._error = error
        if self.finish_reason in (None, "cancelled"):
            self._take_back_cue()
        self._core.ended(self)
        if self._op is not None:
            self._op.drain = None  # nothing to read any more (and no reference cycle)
            self._op.finish(error)

    # ------------------------------------------------------------------ stopping

    def _take_back_cue(self) -> None:
        """A generation that did not happen did not open the assistant turn either."""
        if self._undo_cue is None:
            return
        chat, n = self._undo_cue
        self._undo_cue = None
        core = self._core
        del core.pending[n:len(self._prompt)]  # the cue's tokens, right after what was there
        core.chat = chat

    def cancel(self, reason: BaseException) -> None:
        """Stop now (the context is being released): the stream ends with ``reason``."""
        if self._finished:
            return
        stream, self._stream = self._stream, None
        if stream is not None:
            stream.close()
        self.finish_reason = "cancelled"
        self._end(reason)

    async def aclose(self) -> None:
        """Stop early: the generation is cancelled and the context left as it was (if the
        generation had already finished, its result is kept)."""
        if self._finished:
            return
        stream, self._stream = self._stream, None
        if stream is not None:
            with anyio.CancelScope(shield=True):
                await stream.aclose()
        await self._resync()
        self.finish_reason = "cancelled"
        self._end(None)

    async def _resync(self) -> None:
        """After a cancel: learn whether the generation had finished after all."""
        core = self._core
        if core.handle is None or core.released or core.rt.closed:
            return
        before = core.state.seq_len
        try:
            with anyio.CancelScope(shield=True), anyio.move_on_after(10):
                state = (await core.transport.request(P.GetState(ctx=core.handle))).state
                core.set_state(state)
                if state.seq_len != before:  # it finished before the cancel: prompt in KV
                    del core.pending[: len(self._prompt)]
                    core.chat.synced = False
                    self._undo_cue = None  # the turn it opened is in the context now
        except PieError:
            pass  # best effort; the next reply refreshes the counters

    def __del__(self) -> None:
        if self._started and not self._finished:
            stream = self._stream
            if stream is not None and hasattr(stream, "close"):
                stream.close()
            self._finished = True
            if self._op is not None:
                self._op.done.set()

    # ----------------------------------------------------------------- collection

    async def _collect(self) -> None:
        """Run to the end. Collected whole from the start, the engine sends the output in
        one message instead of one per token."""
        if not self._started:
            self._streamed = False
        async for _ in self:
            pass

    async def text(self) -> str:
        """Run to the end; the generated text (without any stop string). With tools, the
        answer's content: tool-call markup is removed (``text_out`` keeps the model's own
        text, and ``tool_calls`` the calls)."""
        await self._collect()
        return self.content

    async def calls(self) -> list[ToolCall]:
        """Run to the end; the tool calls the model made (empty without tools)."""
        await self._collect()
        return list(self.tool_calls)

    async def tokens(self) -> list[int]:
        """Run to the end; every generated token id (the last one is still pending)."""
        await self._collect()
        return list(self.tokens_out)

    def __await__(self) -> SyncGenerator[Any, None, str]:
        return self.text().__await__()
