"""The OpenAI-compatible API as an inferlet: ``/v1/models``, ``/v1/chat/completions``,
``/v1/completions``.

Owner: the routes and OpenAI's rendering (bodies, chunks, logprobs). This module is written against the public ``pie_ctx`` SDK only (it
never imports the engine): every request is an ordinary pie-ctx program. A chat request
builds a context from its messages with the chat fillers and flushes it once; ``n``
choices are forks of that one prefilled context (the engine decodes them in one batch
and reads their shared prompt once); each choice is a ``generate()`` whose deltas become
the response or its SSE chunks. Earlier turns of a conversation are not remembered here:
the engine's prefix reuse finds their pages again, and ``usage.prompt_tokens_details
.cached_tokens`` says how many prompt tokens it did not have to compute.

Request bodies are checked against typed Structs of OpenAI's schema (``schema``):
a field this server does not implement is refused by name, never silently dropped. Tools,
tool choices and tool messages map onto the shared conversation (``chat``); calls come back
as ``message.tool_calls`` or as ``delta.tool_calls`` chunks.

Extensions to OpenAI's bodies (docs/http.md): ``top_k``, ``min_p``, ``min_tokens``,
``ignore_eos`` and vLLM's other fields (constraints, template options,
``skip_special_tokens``: ``decoding``, ``chat.rendering_of``), and
``snapshot`` (start from a saved snapshot: ``Context.open``, then the messages or the
prompt).

Errors use OpenAI's body ``{"error": {"message", "type", "param", "code"}}``: 400 for a bad
request, 404 for an unknown model or snapshot (the app answers unknown paths likewise),
413 for a body over ``MAX_BODY_BYTES``, 503 when the engine has no room, 500 otherwise. A
malformed body is a 400, never a crash.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from pie_ctx import Context, Delta, Runtime, gather
from pie_ctx.tools import ToolCall
from runtime.server.http.conversation.body import MAX_BODY_BYTES
from runtime.server.http.conversation.errors import (
    ApiError,
    error_body,
    guard,
)
from runtime.server.http.conversation.generation import Exchange, Observer
from runtime.server.http.conversation.holds import RETENTION_S, TOOL_WAIT_S, PromptHolds
from runtime.server.http.conversation.keys import key_scope
from runtime.server.http.conversation.sse import event_stream, sse_response
from runtime.server.http.conversation.turns import build_context
from runtime.server.http.disconnect import unless_disconnected
from runtime.server.http.limits import output_limit
from runtime.server.http.openai.chat import openai_call, rendering_of, turns_of
from runtime.server.http.openai.decoding import Decoding, decoding_of
from runtime.server.http.openai.schema import (
    ChatRequest,
    CompletionRequest,
    decode_body,
)

__all__ = ["MAX_BODY_BYTES", "OpenAIService"]

_FINISH = {"stop_token": "stop", "stop_string": "stop", "constraint": "stop", "length": "length",
           "tool_calls": "tool_calls"}


# ------------------------------------------------------------------------------ choices


@dataclass(slots=True)
class _Choice:
    """One choice's output as it accumulates."""

    index: int
    text: list[str] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    calls: list[ToolCall] = field(default_factory=list)
    finish_reason: str | None = None


OnDelta = Callable[["_Choice", Delta, int], Awaitable[None]]


async def _run_choice(rt: Runtime, exchange: Exchange, d: Decoding, i: int, ctx: Context,
                      on_delta: OnDelta) -> _Choice:
    """Generate choice ``i`` on ``ctx``; ``on_delta(choice, delta, first_token_index)``
    hears each delta (``delta.content``: the text for the client; ``delta.tool_calls``:
    the calls it completed)."""
    choice = _Choice(i)
    limit = output_limit(d.max_tokens, rt.info.max_seq_len,
                         ctx.seq_len + len(ctx.pending_tokens))
    gen = ctx.generate(d.sampler(i), max_tokens=limit, stop=d.stop or None,
                       constrain=d.constrain, logit_bias=d.logit_bias,
                       top_logprobs=d.top_logprobs, cue=False, min_tokens=d.min_tokens,
                       ignore_eos=d.ignore_eos, **d.tool_options())
    # skip_special_tokens false: the text decoded again from the tokens, specials in.
    decoder = None if d.skip_special_tokens else \
        rt.tokenizer.incremental_decoder(skip_special_tokens=False)
    last = None
    async for delta in gen:
        if decoder is not None:
            delta = dataclasses.replace(delta, content=decoder.feed(delta.tokens))
        last = exchange.heard(len(delta.tokens), last)
        start = len(choice.tokens)
        choice.text.append(delta.content)
        choice.tokens.extend(delta.tokens)
        choice.logprobs.extend(delta.logprobs)
        choice.top.extend(delta.top_logprobs)
        await on_delta(choice, delta, start)
        choice.calls.extend(delta.tool_calls)
    tail = decoder.flush() if decoder is not None else ""
    if tail:
        choice.text.append(tail)
        await on_delta(choice, Delta(tokens=[], text="", logprobs=[], content=tail),
                       len(choice.tokens))
    stop = _matched_stop(rt, gen, d) if d.include_stop_str else ""
    if stop:  # vLLM's include_stop_str_in_output: the text ends with the stop string
        choice.text.append(stop)
        await on_delta(choice, Delta(tokens=[], text=stop, logprobs=[], content=stop),
                       len(choice.tokens))
    choice.finish_reason = _FINISH.get(gen.finish_reason or "", "stop")
    return choice


def _usage(exchange: Exchange) -> dict[str, Any]:
    """OpenAI's ``usage`` of a request."""
    prompt, completion = exchange.prompt_tokens, exchange.completion_tokens
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": exchange.cached_tokens}}


# ----------------------------------------------------------------------------- service


class OpenAIService:
    """The API's routes over one runtime (``get_runtime()`` is called per request)."""

    def __init__(self, get_runtime: Callable[[], Runtime], model_name: str,
                 observer: Observer | None = None,
                 adapters: Callable[[], list[Any]] | None = None,
                 holds: PromptHolds | None = None, tool_wait_s: float = TOOL_WAIT_S) -> None:
        from starlette.routing import Route

        self.get_runtime, self.model_name, self.observer = get_runtime, model_name, observer
        self.holds = holds or PromptHolds()
        self.tool_wait_s = tool_wait_s
        # the engine's adapters now (any runtime may load one), else this runtime's view
        self.adapters = adapters or (lambda: self.get_runtime().info.adapters)
        self.created = int(time.time())
        self.routes = [
            Route("/v1/models", guard(self.models), methods=["GET"]),
            Route("/v1/models/{model:path}", guard(self.model), methods=["GET"]),
            Route("/v1/chat/completions", guard(self.chat), methods=["POST"]),
            Route("/v1/completions", guard(self.completions), methods=["POST"]),
        ]

    # ------------------------------------------------------------------------ models

    def _model_card(self, adapter: str | None = None) -> dict[str, Any]:
        """The base model's card, or a LoRA adapter's (``parent``: the base, as vLLM)."""
        if adapter is None:
            return {"id": self.model_name, "object": "model", "created": self.created,
                    "owned_by": "pie-ctx", "root": self.model_name, "parent": None}
        info = next(a for a in self.adapters() if a.name == adapter)
        return {"id": adapter, "object": "model", "created": self.created,
                "owned_by": "pie-ctx", "root": info.path, "parent": self.model_name}

    async def models(self, request: Any) -> Any:
        from starlette.responses import JSONResponse

        cards = [self._model_card()] + [self._model_card(a.name)
                                        for a in self.adapters()]
        return JSONResponse({"object": "list", "data": cards})

    async def model(self, request: Any) -> Any:
        from starlette.responses import JSONResponse

        return JSONResponse(self._model_card(self.check_model(request.path_params["model"])))

    def check_model(self, model: Any) -> str | None:
        """The LoRA adapter ``model`` names (as vLLM's ``--lora-modules``), None for the
        base model."""
        if not isinstance(model, str):
            raise ApiError(400, "'model' must be a string", param="model")
        if model == self.model_name:
            return None
        adapters = [a.name for a in self.adapters()]
        if model in adapters:
            return model
        raise ApiError(404, f"The model '{model}' does not exist; this server serves "
                            f"'{self.model_name}'"
                            + (f" and the adapters {adapters}" if adapters else ""),
                       param="model", code="model_not_found")

    # ------------------------------------------------------------------ completions

    async def chat(self, request: Any) -> Any:
        req = await decode_body(request, ChatRequest)
        adapter = self.check_model(req.model)
        turns = turns_of(req.messages)
        decoding = decoding_of(req)
        rendering = rendering_of(req)

        async def build(rt: Runtime) -> Context:
            return await build_context(rt, turns, decoding.tools, req.snapshot, adapter,
                                       rendering)

        return await self._respond(request, req, decoding, build, chat=True)

    async def completions(self, request: Any) -> Any:
        req = await decode_body(request, CompletionRequest)
        adapter = self.check_model(req.model)
        prompt: Any = req.prompt
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        ok = isinstance(prompt, str) and prompt or (
            isinstance(prompt, list) and prompt
            and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt))
        if not ok:
            raise ApiError(400, "'prompt' must be a non-empty string or list of token ids "
                                "(one prompt per request)", param="prompt")
        decoding = decoding_of(req)

        async def build(rt: Runtime) -> Context:
            ctx = (await Context.open(rt, req.snapshot) if req.snapshot
                   else Context(rt, adapter=adapter))
            return ctx.append(prompt)

        return await self._respond(request, req, decoding, build, chat=False)

    async def _respond(self, request: Any, body: ChatRequest | CompletionRequest,
                       d: Decoding, build: Callable[[Runtime], Any], *, chat: bool) -> Any:
        rt = self.get_runtime()
        exchange = Exchange(self.observer)
        ident = ("chatcmpl-" if chat else "cmpl-") + _new_id()
        head = {"id": ident, "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()), "model": body.model}  # base or adapter
        key = key_scope(request.headers)

        async def start() -> list[Context]:
            """Build, prefill, and hold the prompt when ``prompt_cache_retention`` asks."""
            ctx = await build(rt)
            retention = body.prompt_cache_retention
            prompt = ctx.pending_tokens if retention else []
            contexts = await exchange.prefill(ctx, d.n)
            if retention:
                await self.holds.hold(rt, ctx, key, RETENTION_S[retention], prompt=prompt,
                                      salt=f"{body.model}:{body.snapshot}")
            return contexts

        async def tool_waits(contexts: list[Context], done: list[_Choice]) -> None:
            """Hold each choice that ends in tool calls while the client runs them."""
            for c in done:
                if c.finish_reason == "tool_calls" and self.tool_wait_s > 0:
                    await self.holds.hold(rt, contexts[c.index], key, self.tool_wait_s)

        if not body.stream:
            choices: list[_Choice] = []

            async def quiet(choice: _Choice, delta: Delta, start: int) -> None:
                return None

            async def answer() -> list[_Choice]:
                contexts = await start()
                done = await gather(*(_run_choice(rt, exchange, d, i, c, quiet)
                                      for i, c in enumerate(contexts)))
                await tool_waits(contexts, done)
                return done

            try:
                choices = await unless_disconnected(request, answer)
            finally:
                await exchange.close(finished=bool(choices))
            from starlette.responses import JSONResponse

            out = [self._choice_body(rt, c, chat, d.logprobs) for c in choices]
            return JSONResponse({**head, "choices": out, "usage": _usage(exchange)})
        # Streaming: prefill first, so a refused prompt is still a plain error response.
        try:
            contexts = await start()
        except BaseException:
            await exchange.close(finished=False)
            raise
        chunk_object = "chat.completion.chunk" if chat else "text_completion"
        include_usage = body.stream_options is not None and \
            body.stream_options.include_usage is True
        return sse_response(self._stream(rt, exchange, d, contexts,
                                         {**head, "object": chunk_object}, chat,
                                         include_usage, tool_waits))

    def _stream(self, rt: Runtime, exchange: Exchange, d: Decoding, contexts: list[Context],
                head: dict[str, Any], chat: bool, include_usage: bool,
                tool_waits: Callable[[list[Context], list[_Choice]], Awaitable[None]]
                ) -> Any:
        """SSE events: a role chunk per choice (chat), content chunks, finish chunks, the
        usage chunk if asked, ``[DONE]``. Leaving early (the client went away) cancels the
        generations and releases the contexts."""
        finished: list[_Choice] = []

        def chunk(index: int, delta: dict[str, Any], finish: str | None,
                  logprobs: Any = None) -> dict[str, Any]:
            if chat:
                c = {"index": index, "delta": delta, "logprobs": logprobs,
                     "finish_reason": finish}
            else:
                c = {"index": index, "text": delta.get("content", ""), "logprobs": logprobs,
                     "finish_reason": finish}
            return {**head, "choices": [c]}

        async def produce(send: Callable[[dict[str, Any]], Awaitable[None]]) -> None:
            async def on_delta(choice: _Choice, delta: Delta, start: int) -> None:
                lp = self._logprobs(rt, choice, start, chat) if d.logprobs else None
                if delta.content or (lp is not None and delta.tokens) or not d.tools:
                    await send(chunk(choice.index, {"content": delta.content}, None, lp))
                if delta.tool_calls:  # each call whole, in the chunk where it completed
                    first = len(choice.calls)
                    calls = [openai_call(c, first + j) for j, c in enumerate(delta.tool_calls)]
                    await send(chunk(choice.index, {"tool_calls": calls}, None))

            if chat:
                for i in range(len(contexts)):
                    await send(chunk(i, {"role": "assistant", "content": ""}, None))
            done = await gather(*(_run_choice(rt, exchange, d, i, c, on_delta)
                                  for i, c in enumerate(contexts)))
            finished.extend(done)
            await tool_waits(contexts, done)
            for c in done:
                await send(chunk(c.index, {}, c.finish_reason))
            if include_usage:
                await send({**head, "choices": [], "usage": _usage(exchange)})

        async def failed(err: ApiError, send: Callable[[dict[str, Any]], Awaitable[None]]
                         ) -> None:
            await send(error_body(err))

        async def finish() -> None:
            await exchange.close(finished=bool(finished))

        return event_stream(rt, produce, failed, lambda m: {"data": json.dumps(m)}, finish,
                            tail=[{"data": "[DONE]"}])

    # --------------------------------------------------------------------- bodies

    def _choice_body(self, rt: Runtime, c: _Choice, chat: bool, logprobs: bool
                     ) -> dict[str, Any]:
        lp = self._logprobs(rt, c, 0, chat) if logprobs else None
        text = "".join(c.text)
        if chat:
            message: dict[str, Any] = {"role": "assistant",
                                       "content": text if text or not c.calls else None}
            if c.calls:
                message["tool_calls"] = [openai_call(call) for call in c.calls]
            return {"index": c.index, "message": message, "logprobs": lp,
                    "finish_reason": c.finish_reason}
        return {"index": c.index, "text": text, "logprobs": lp,
                "finish_reason": c.finish_reason}

    def _logprobs(self, rt: Runtime, c: _Choice, start: int, chat: bool) -> Any:
        """OpenAI's logprobs of choice ``c``'s tokens from ``start`` on."""
        tok = rt.tokenizer

        def piece(token_id: int) -> str:
            return tok.decode([token_id])

        ids, lps = c.tokens[start:], c.logprobs[start:]
        tops = c.top[start:] if c.top else [[] for _ in ids]
        if chat:
            content = []
            for t, lp, top in zip(ids, lps, tops, strict=False):
                text = piece(t)
                content.append({"token": text, "logprob": lp, "bytes": list(text.encode()),
                                "top_logprobs": [{"token": piece(a), "logprob": b,
                                                  "bytes": list(piece(a).encode())}
                                                 for a, b in top]})
            return {"content": content}
        texts = [piece(t) for t in ids]
        offsets, pos = [], sum(len(piece(t)) for t in c.tokens[:start])
        for text in texts:
            offsets.append(pos)
            pos += len(text)
        return {"tokens": texts, "token_logprobs": lps,
                "top_logprobs": [{piece(a): b for a, b in top} for top in tops] if c.top
                else None, "text_offset": offsets}


def _matched_stop(rt: Runtime, gen: Any, d: Decoding) -> str:
    """The stop string that ended ``gen`` (the first in its text; the longest of those
    starting there), or "" when none did."""
    if gen.finish_reason != "stop_string":
        return ""
    full = rt.tokenizer.decode(gen.tokens_out, skip_special_tokens=True)
    hits = [(full.find(s), -len(s), s) for s in d.stop if s and s in full]
    return min(hits)[2] if hits else ""


def _new_id() -> str:
    import secrets

    return secrets.token_hex(12)
