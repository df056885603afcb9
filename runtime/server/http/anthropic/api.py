"""Anthropic's Messages API as an inferlet: ``POST /v1/messages`` and
``POST /v1/messages/count_tokens``.

Owner: the routes and Anthropic's rendering (the Message object, its events, its errors).
Written against the public ``pie_ctx`` SDK only, over the conversation pipeline every API
shares (``conversation``): a request's system prompt, messages, ``tool_use`` and
``tool_result`` blocks become the same turns a chat completion's messages do (``schema``),
the context is flushed once and one ``generate()`` answers. Its text becomes a ``text`` block, its calls ``tool_use``
blocks; streamed, they are Anthropic's events (``message_start``, ``content_block_start``,
``content_block_delta`` with ``text_delta`` or ``input_json_delta``,
``content_block_stop``, ``message_delta``, ``message_stop``).

``stop_reason``: ``end_turn`` (an end-of-turn token, or a finished constraint),
``max_tokens``, ``stop_sequence`` (with the one that matched) or ``tool_use``.

Caching: the engine's prefix cache is automatic; a ``cache_control`` breakpoint
(``schema.cache_points``) also holds the prompt up to the end of its message (its tools,
its system prompt) in the cache for the breakpoint's ``ttl``, ``5m`` or ``1h``
(``conversation.holds``: per key, refreshed when asked again). ``usage`` splits the prompt
exactly, as the pass computed it: ``cache_read_input_tokens`` were found in the cache,
``cache_creation_input_tokens`` were computed up to the last breakpoint (and are now
held), ``input_tokens`` were computed after it; ``output_tokens`` are the generated ones.

A last message from the assistant (a prefill) is continued, as Anthropic does: its text is
written without the end of its turn (not with tools). Errors use Anthropic's body
``{"type": "error", "error": {"type", "message"}}`` on these routes (401, 404 and 405
included).
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Awaitable, Callable
from typing import Any

from pie_ctx import Context, Runtime
from pie_ctx.tools import Tool
from runtime.server.http.anthropic.schema import (
    ACCEPTS,
    REFUSED,
    TOOLS,
    CountTokensRequest,
    MessagesRequest,
    cache_points,
    tool_choice_of,
    turns_of,
)
from runtime.server.http.conversation.body import check_refused, decode_body
from runtime.server.http.conversation.decoding import json_constraint, sampler_of, tool_options
from runtime.server.http.conversation.errors import ApiError, guard
from runtime.server.http.conversation.generation import Exchange, Observer
from runtime.server.http.conversation.holds import PromptHolds
from runtime.server.http.conversation.keys import key_scope
from runtime.server.http.conversation.sse import event_stream, sse_response
from runtime.server.http.conversation.turns import Rendering, build_context, make_tools
from runtime.server.http.disconnect import unless_disconnected

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


_Tools = tuple[list[Tool], str | None, bool]  # the tools, their choice, parallel calls


class MessagesService:
    """The Messages API's routes over one runtime (``get_runtime()`` per request)."""

    def __init__(self, get_runtime: Callable[[], Runtime], check_model: Callable[[Any], Any],
                 observer: Observer | None = None, holds: PromptHolds | None = None) -> None:
        from starlette.routing import Route

        self.get_runtime, self.check_model, self.observer = (
            get_runtime, check_model, observer)
        self.holds = holds or PromptHolds()
        self.routes = [
            Route("/v1/messages", guard(self.messages, _render), methods=["POST"]),
            Route("/v1/messages/count_tokens", guard(self.count_tokens, _render),
                  methods=["POST"]),
        ]

    async def _build(self, req: CountTokensRequest
                     ) -> tuple[Context, _Tools, list[tuple[int, float]]]:
        """The request's context (not flushed), its tools with their choice and parallel
        flag, and its cache breakpoints as ``(prompt tokens before it, ttl seconds)``."""
        check_refused(req, REFUSED)
        adapter = self.check_model(req.model)
        turns = turns_of(req)
        points = cache_points(req)
        tools = make_tools((s.name, s.description, s.input_schema) for s in req.tools or ())
        choice, parallel = tool_choice_of(req, tools)
        rendering = None
        if req.messages[-1].role == "assistant":  # a prefill: continue it
            if tools:
                raise ApiError(400, "a last assistant message (a prefill) cannot be combined "
                                    "with 'tools' here", param="messages")
            rendering = Rendering({}, generation_prompt=False, continue_final=True)
        marks: dict[int, int] = {}
        ctx = await build_context(self.get_runtime(), turns, tools, None, adapter, rendering,
                                  marks)
        size = len(ctx.pending_tokens)
        ends = sorted(marks.items())

        def end_of(index: int) -> int:  # where the prompt up to message ``index`` ends
            if index == TOOLS and turns:
                index = turns[0].index
            return next((n for i, n in ends if i >= index), size)

        return ctx, (tools, choice, parallel), [(end_of(i), ttl) for i, ttl in points]

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
        ctx, tools, breaks = await self._build(req)
        turn = _Turn(self, req, ctx, tools, breaks, key_scope(request.headers))
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
        return sse_response(turn.events())


class _Turn:
    """One request's generation: its context, its output, its events."""

    def __init__(self, service: MessagesService, req: MessagesRequest, ctx: Context,
                 tools: _Tools, breaks: list[tuple[int, float]], key: str) -> None:
        self.service, self.req, self.ctx = service, req, ctx
        self.tools, self.choice, self.parallel = tools
        self.breaks, self.key = breaks, key
        self.prompt = ctx.pending_tokens if breaks else []
        self.id = "msg_" + secrets.token_hex(12)
        self.exchange = Exchange(service.observer)
        self.exchange.hold(ctx)
        self.text: list[str] = []
        self.calls: list[Any] = []
        self.finish: str | None = None
        self.raw = ""

    async def prefill(self) -> None:
        """Compute the prompt, then hold it up to its breakpoints: up to the last ``1h``
        one for an hour, up to the last one of all for its ttl when that reaches further."""
        await self.exchange.prefill(self.ctx)
        held = 0
        for ttl in sorted({t for _, t in self.breaks}, reverse=True):
            end = max(n for n, t in self.breaks if t >= ttl)
            if end > held:
                await self.service.holds.hold(self.service.get_runtime(), self.ctx, self.key,
                                              ttl, num_tokens=end, prompt=self.prompt,
                                              salt=self.req.model)
                held = end

    async def run(self, on_delta: Callable[[Any], Any] | None) -> None:
        """Generate; ``on_delta(delta)`` hears each delta (streaming)."""
        r = self.req
        tools = tool_options(self.tools, self.choice, self.parallel)
        fmt = r.output_config.format if r.output_config else None
        constrain = None if fmt is None else json_constraint(
            fmt.type, fmt.schema, where="output_config.format", param=None, missing="")
        sampler = sampler_of(r.temperature, top_p=r.top_p, top_k=r.top_k)
        gen = self.ctx.generate(sampler, max_tokens=r.max_tokens,
                                stop=r.stop_sequences or None, cue=False,
                                ignore_eos=bool(r.ignore_eos), constrain=constrain, **tools)
        last = None
        async for delta in gen:
            last = self.exchange.heard(len(delta.tokens), last)
            self.raw += delta.text
            self.text.append(delta.content)
            self.calls.extend(delta.tool_calls)
            if on_delta is not None:
                await on_delta(delta)
        self.finish = gen.finish_reason
        if self.finish == "stop_string":
            self.raw = self.service.get_runtime().tokenizer.decode(gen.tokens_out,
                                                                  skip_special_tokens=True)

    @property
    def num_tokens(self) -> int:
        return self.exchange.completion_tokens

    async def close(self) -> None:
        await self.exchange.close(finished=self.finish is not None)

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
        x = self.exchange
        last = max((n for n, _ in self.breaks), default=0)
        created = max(0, min(last, x.prompt_tokens) - x.cached_tokens)
        return {"input_tokens": x.prompt_tokens - x.cached_tokens - created,
                "cache_creation_input_tokens": created,
                "cache_read_input_tokens": x.cached_tokens,
                "output_tokens": x.completion_tokens}

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

    def events(self) -> Any:
        """Anthropic's SSE events. Leaving early (the client went away) cancels the
        generation and releases the context."""
        blocks = {"index": -1, "open": ""}  # the current block: its index and its type

        async def produce(send: Send) -> None:
            async def event(kind: str, data: dict[str, Any]) -> None:
                await send((kind, {"type": kind, **data}))

            async def close_block() -> None:
                if blocks["open"]:
                    await event("content_block_stop", {"index": blocks["index"]})
                    blocks["open"] = ""

            async def open_block(block: dict[str, Any]) -> None:
                await close_block()
                blocks["index"] += 1
                blocks["open"] = block["type"]
                await event("content_block_start", {"index": blocks["index"],
                                                    "content_block": block})

            async def on_delta(delta: Any) -> None:
                if delta.content:
                    if blocks["open"] != "text":
                        await open_block({"type": "text", "text": ""})
                    await event("content_block_delta", {
                        "index": blocks["index"], "delta": {"type": "text_delta",
                                                            "text": delta.content}})
                for call in delta.tool_calls:  # each call whole, the moment it is complete
                    await open_block({**_tool_use(call), "input": {}})
                    await event("content_block_delta", {
                        "index": blocks["index"],
                        "delta": {"type": "input_json_delta",
                                  "partial_json": json.dumps(call.arguments,
                                                             ensure_ascii=False)}})
                    await close_block()

            await event("message_start", {"message": self.message(final=False)})
            await self.run(on_delta)
            if blocks["index"] < 0:  # no content at all: one empty text block
                await open_block({"type": "text", "text": ""})
            await close_block()
            reason, sequence = self._stop()
            await event("message_delta", {
                "delta": {"stop_reason": reason, "stop_sequence": sequence},
                "usage": {"output_tokens": self.num_tokens}})
            await event("message_stop", {})

        async def failed(err: ApiError, send: Send) -> None:
            await send(("error", error_body(err.status, err.message)))

        def render(item: tuple[str, dict[str, Any]]) -> dict[str, str]:
            return {"event": item[0], "data": json.dumps(item[1])}

        return event_stream(self.service.get_runtime(), produce, failed, render, self.close)


Send = Callable[[tuple[str, dict[str, Any]]], Awaitable[None]]


def _render(err: ApiError) -> Any:
    return anthropic_error(err.status, err.message)


def _tool_use(call: Any) -> dict[str, Any]:
    return {"type": "tool_use", "id": call.id, "name": call.name, "input": call.arguments}
