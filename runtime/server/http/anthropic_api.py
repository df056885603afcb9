"""Anthropic's Messages API as an inferlet: ``POST /v1/messages`` and
``POST /v1/messages/count_tokens``.

Owner: the HTTP app. Written against the public ``pie_ctx`` SDK only, like the OpenAI API
beside it, and over the same conversation builder (``openai_chat.build_context``): a
request's system prompt, messages, ``tool_use`` and ``tool_result`` blocks become the same
turns a chat completion's messages do (``anthropic_schema``), the context is flushed once
and one ``generate()`` answers. Its text becomes a ``text`` block, its calls ``tool_use``
blocks; streamed, they are Anthropic's events (``message_start``, ``content_block_start``,
``content_block_delta`` with ``text_delta`` or ``input_json_delta``,
``content_block_stop``, ``message_delta``, ``message_stop``).

``stop_reason``: ``end_turn`` (an end-of-turn token, or a finished constraint),
``max_tokens``, ``stop_sequence`` (with the one that matched) or ``tool_use``. ``usage``:
``input_tokens`` are the prompt tokens the engine computed, ``cache_read_input_tokens``
the ones it found in its prefix cache, ``output_tokens`` the generated ones.

A last message from the assistant (a prefill) is continued, as Anthropic does: its text is
written without the end of its turn (not with tools). Errors use Anthropic's body
``{"type": "error", "error": {"type", "message"}}`` on these routes (401, 404 and 405
included).
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio

from pie_ctx import Context, Runtime
from pie_ctx.constrain import JsonSchema
from pie_ctx.proto.errors import InvalidArgument, PieError
from pie_ctx.proto.messages import SamplerSpec
from runtime.server.http.access_log import note_tokens
from runtime.server.http.anthropic_schema import (
    ACCEPTS,
    CountTokensRequest,
    MessagesRequest,
    check_refused,
    tool_choice_of,
    tools_of,
    turns_of,
)
from runtime.server.http.disconnect import NO_RESPONSE, ClientGone, unless_disconnected
from runtime.server.http.openai_api import Observer, as_api_error
from runtime.server.http.openai_chat import Rendering, build_context
from runtime.server.http.openai_schema import ApiError, decode_body

__all__ = ["MessagesService", "anthropic_error", "is_anthropic_path"]

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                403: "permission_error", 404: "not_found_error", 405: "invalid_request_error",
                413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error",
                529: "overloaded_error"}
_STOP = {"stop_token": "end_turn", "constraint": "end_turn", "length": "max_tokens",
         "stop_string": "stop_sequence", "tool_calls": "tool_use"}


def is_anthropic_path(path: str) -> bool:
    """Whether ``path`` is one of this API's (its errors take Anthropic's shape)."""
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def error_body(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error body."""
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(status, "api_error"),
                                       "message": message}}


def anthropic_error(status: int, message: str) -> Any:
    """Anthropic's error response."""
    from starlette.responses import JSONResponse

    return JSONResponse(error_body(status, message), status_code=status)


class MessagesService:
    """The Messages API's routes over one runtime (``get_runtime()`` per request)."""

    def __init__(self, get_runtime: Callable[[], Runtime], check_model: Callable[[Any], Any],
                 observer: Observer | None = None) -> None:
        from starlette.routing import Route

        self.get_runtime, self.check_model, self.observer = (
            get_runtime, check_model, observer)
        self.routes = [
            Route("/v1/messages", self._guard(self.messages), methods=["POST"]),
            Route("/v1/messages/count_tokens", self._guard(self.count_tokens),
                  methods=["POST"]),
        ]

    @staticmethod
    def _guard(handler: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """Any failure before the response starts becomes Anthropic's error body."""

        async def guarded(request: Any) -> Any:
            try:
                return await handler(request)
            except ClientGone:  # no one to answer (logged and counted as 499)
                return NO_RESPONSE
            except Exception as err:  # noqa: BLE001 - every error gets a body, none a crash
                e = as_api_error(err)
                return anthropic_error(e.status, e.message)

        return guarded

    async def _build(self, req: CountTokensRequest) -> tuple[Context, str | None, bool]:
        """The request's context (not flushed), its tool choice and parallel flag."""
        check_refused(req)
        adapter = self.check_model(req.model)
        turns = turns_of(req)
        tools = tools_of(req)
        choice, parallel = tool_choice_of(req, tools)
        rendering = None
        if req.messages[-1].role == "assistant":  # a prefill: continue it
            if tools:
                raise ApiError(400, "a last assistant message (a prefill) cannot be combined "
                                    "with 'tools' here", param="messages")
            rendering = Rendering({}, generation_prompt=False, continue_final=True)
        ctx = await build_context(self.get_runtime(), turns, tools, None, adapter, rendering)
        return ctx, choice, parallel

    async def count_tokens(self, request: Any) -> Any:
        from starlette.responses import JSONResponse

        req = await decode_body(request, CountTokensRequest, ACCEPTS)
        ctx, _, _ = await self._build(req)
        try:
            return JSONResponse({"input_tokens": len(ctx.pending_tokens)})
        finally:
            await ctx.release()

    async def messages(self, request: Any) -> Any:
        req = await decode_body(request, MessagesRequest, ACCEPTS)
        ctx, choice, parallel = await self._build(req)
        turn = _Turn(self, req, ctx, choice, parallel)
        if not req.stream:
            async def answer() -> None:
                await turn.prefill()
                await turn.run(None)

            try:
                await unless_disconnected(request, answer)
            finally:
                await turn.close()
            from starlette.responses import JSONResponse

            return JSONResponse(turn.message(final=True))
        try:
            await turn.prefill()
        except BaseException:
            await turn.close()
            raise
        from sse_starlette.sse import EventSourceResponse

        return EventSourceResponse(turn.events(), ping=15)


class _Turn:
    """One request's generation: its context, its output, its events."""

    def __init__(self, service: MessagesService, req: MessagesRequest, ctx: Context,
                 choice: str | None, parallel: bool) -> None:
        self.service, self.req, self.ctx = service, req, ctx
        self.choice, self.parallel = choice, parallel
        self.id = "msg_" + secrets.token_hex(12)
        self.arrived = time.perf_counter()
        self.text: list[str] = []
        self.calls: list[Any] = []
        self.num_tokens = 0
        self.prompt_tokens = self.cached_tokens = 0
        self.finish: str | None = None
        self.raw = ""

    async def prefill(self) -> None:
        report = await self.ctx.flush()
        self.prompt_tokens = self.ctx.seq_len
        self.cached_tokens = max(0, self.ctx.seq_len - report.tokens_computed)

    def _sampler(self) -> SamplerSpec:
        r = self.req
        temperature = 1.0 if r.temperature is None else float(r.temperature)
        if temperature == 0:
            return SamplerSpec()
        return SamplerSpec(temperature=temperature, top_k=r.top_k or 0,
                           top_p=1.0 if not r.top_p else float(r.top_p))

    async def run(self, on_delta: Callable[[Any], Any] | None) -> None:
        """Generate; ``on_delta(delta)`` hears each delta (streaming)."""
        tools = {} if self.choice is None else {"tool_choice": self.choice,
                                                "parallel_tool_calls": self.parallel}
        fmt = self.req.output_config.format if self.req.output_config else None
        try:
            constrain = None if fmt is None else JsonSchema(fmt.schema)
        except InvalidArgument as err:
            raise ApiError(400, f"output_config.format: {err}") from None
        gen = self.ctx.generate(self._sampler(), max_tokens=self.req.max_tokens,
                                stop=self.req.stop_sequences or None, cue=False,
                                constrain=constrain, **tools)
        observer = self.service.observer
        async for delta in gen:
            if observer is not None and not self.num_tokens:
                observer.first_token(time.perf_counter() - self.arrived)
            self.num_tokens += len(delta.tokens)
            self.raw += delta.text
            self.text.append(delta.content)
            self.calls.extend(delta.tool_calls)
            if on_delta is not None:
                await on_delta(delta)
        self.finish = gen.finish_reason
        if self.finish == "stop_string":
            self.raw = self.service.get_runtime().tokenizer.decode(gen.tokens_out,
                                                                  skip_special_tokens=True)

    async def close(self) -> None:
        with anyio.CancelScope(shield=True):
            try:
                await self.ctx.release()
            except PieError:
                pass
        note_tokens(self.prompt_tokens, self.num_tokens)
        if self.service.observer is not None and self.finish is not None:
            self.service.observer.tokens(self.prompt_tokens, self.cached_tokens,
                                         self.num_tokens)

    def _stop(self) -> tuple[str | None, str | None]:
        """``(stop_reason, stop_sequence)``."""
        if self.finish is None:
            return None, None
        reason = _STOP.get(self.finish, "end_turn")
        if self.calls and reason != "max_tokens":
            reason = "tool_use"
        sequence = None
        if reason == "stop_sequence":  # the one that ends the text (the latest match)
            found = [(self.raw.rfind(s), s) for s in self.req.stop_sequences or ()]
            sequence = max(found)[1] if found and max(found)[0] >= 0 else None
        return reason, sequence

    def usage(self) -> dict[str, Any]:
        return {"input_tokens": self.prompt_tokens - self.cached_tokens,
                "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": self.cached_tokens,
                "output_tokens": self.num_tokens}

    def message(self, final: bool) -> dict[str, Any]:
        """The Message object (``final``: with its content and stop reason)."""
        content: list[dict[str, Any]] = []
        if final:
            text = "".join(self.text)
            if text or not self.calls:
                content.append({"type": "text", "text": text})
            content.extend(_tool_use(c) for c in self.calls)
        reason, sequence = self._stop() if final else (None, None)
        return {"id": self.id, "type": "message", "role": "assistant", "content": content,
                "model": self.req.model, "stop_reason": reason, "stop_sequence": sequence,
                "usage": self.usage()}

    async def events(self) -> AsyncIterator[dict[str, str]]:
        """Anthropic's SSE events. Leaving early (the client went away) cancels the
        generation and releases the context."""
        send, receive = anyio.create_memory_object_stream[tuple[str, dict[str, Any]]](256)
        blocks = {"index": -1, "open": ""}  # the current block: its index and its type

        async def event(kind: str, data: dict[str, Any]) -> None:
            await send.send((kind, {"type": kind, **data}))

        async def close_block() -> None:
            if blocks["open"]:
                await event("content_block_stop", {"index": blocks["index"]})
                blocks["open"] = ""

        async def open_text() -> None:
            await close_block()
            blocks["index"] += 1
            blocks["open"] = "text"
            await event("content_block_start", {
                "index": blocks["index"], "content_block": {"type": "text", "text": ""}})

        async def on_delta(delta: Any) -> None:
            if delta.content:
                if blocks["open"] != "text":
                    await open_text()
                await event("content_block_delta", {
                    "index": blocks["index"], "delta": {"type": "text_delta",
                                                        "text": delta.content}})
            for call in delta.tool_calls:  # each call whole, the moment it is complete
                await close_block()
                blocks["index"] += 1
                await event("content_block_start", {
                    "index": blocks["index"],
                    "content_block": {**_tool_use(call), "input": {}}})
                await event("content_block_delta", {
                    "index": blocks["index"],
                    "delta": {"type": "input_json_delta",
                              "partial_json": json.dumps(call.arguments,
                                                         ensure_ascii=False)}})
                await event("content_block_stop", {"index": blocks["index"]})

        scope = anyio.CancelScope()

        async def produce() -> None:
            # In the runtime's task group, not in this generator: a task group must not
            # stay open across a generator's yields.
            with scope:
                async with send:
                    try:
                        await event("message_start", {"message": self.message(final=False)})
                        await self.run(on_delta)
                        if blocks["index"] < 0:  # no content at all: one empty text block
                            await open_text()
                        await close_block()
                        reason, sequence = self._stop()
                        await event("message_delta", {
                            "delta": {"stop_reason": reason, "stop_sequence": sequence},
                            "usage": {"output_tokens": self.num_tokens}})
                        await event("message_stop", {})
                    except Exception as err:  # noqa: BLE001 - after the headers: an event
                        e = as_api_error(err)
                        await send.send(("error", error_body(e.status, e.message)))

        self.service.get_runtime().start_soon(produce)
        try:
            async with receive:
                async for kind, data in receive:
                    yield {"event": kind, "data": json.dumps(data)}
        finally:  # done, or the client went away: stop generating, release the context
            scope.cancel()
            await self.close()


def _tool_use(call: Any) -> dict[str, Any]:
    return {"type": "tool_use", "id": call.id, "name": call.name, "input": call.arguments}
