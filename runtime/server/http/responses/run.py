"""One ``/v1/responses`` request's generation: the model, its calls, the server-side tool
loop, and the output items and stream events they make.

Owner: a response while it is produced. Written against the public SDK only. The context
comes in built (``api``); :meth:`Run.go` then

1. flushes what is pending (the new items: a follow-up computes only them) and generates
   with the request's tools, prompt-lookup drafts (verified in the engine, lossless) and
   jump-forward over the tokens a constraint forces (the SDK's default);
2. emits the text as an assistant ``message`` item, and each call the moment it is
   complete: a ``function_call`` item for the client's tools, an ``mcp_call`` item for a
   configured MCP server's, whose run starts at once, beside the generation;
3. after the generation, if every call was server-side and the budget of calls
   (``max_tool_calls``) allows, adds their results to the context and generates again, in
   the same request. Once the budget is spent the next generation may not call
   (``tool_choice`` ``"none"``), so a loop always ends.

Items and events are the typed objects of ``items`` (OpenAI's shapes). ``sink`` hears each
event the moment it is made (the SSE stream encodes it then, so an item changing later
does not change an event already sent), or nothing (a plain response).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio

from pie_ctx import Context, Delta
from pie_ctx.proto.errors import InvalidArgument, single_exception
from pie_ctx.proto.messages import SamplerSpec
from pie_ctx.tools import Tool, ToolCall
from runtime.server.http.conversation.decoding import tool_options
from runtime.server.http.conversation.errors import ApiError
from runtime.server.http.conversation.generation import Exchange
from runtime.server.http.responses.items import (
    ArgumentsDelta,
    Event,
    FunctionArgumentsDone,
    FunctionCall,
    ItemEvent,
    ItemRef,
    McpArgumentsDone,
    McpCall,
    McpListTools,
    McpToolInfo,
    Message,
    OutputItem,
    OutputText,
    PartEvent,
    TextDelta,
    TextDone,
    Usage,
)
from runtime.server.http.responses.mcp import McpServers, ServerTools
from runtime.server.http.responses.schema import item_id

__all__ = ["Plan", "Run", "DEFAULT_MAX_TOOL_CALLS", "usage_body"]

log = logging.getLogger("pie_ctx.http")

DEFAULT_MAX_TOOL_CALLS = 16  # server-side calls of one response when max_tool_calls is not


@dataclass(slots=True)
class Plan:
    """What a request generates with (checked by ``api``)."""

    tools: list[Tool]  # declared in the context: the client's functions, then MCP tools
    mcp: dict[str, str]  # tool name -> server label, for the server-side tools
    listed: list[ServerTools]  # servers whose tools this response lists (mcp_list_tools)
    choice: str | None  # "auto" | "none" | "required" | a tool's name | None
    parallel: bool
    constrain: Any  # text.format's constraint, or None
    sampler: SamplerSpec
    max_output: int  # every generation of the response together
    max_calls: int
    max_seq_len: int  # the model's context: no generation runs past it
    ignore_eos: bool = False


def usage_body(exchange: Exchange) -> Usage:
    """A response's ``usage``: every generation of it together."""
    prompt, cached = exchange.prompt_tokens, exchange.cached_tokens
    return Usage(input_tokens=prompt,
                 input_tokens_details={"cached_tokens": cached,
                                       "cache_write_tokens": prompt - cached},
                 output_tokens=exchange.completion_tokens,
                 output_tokens_details={"reasoning_tokens": 0},
                 total_tokens=prompt + exchange.completion_tokens)


Sink = Callable[[Event], Awaitable[None]]


async def _quiet(event: Event) -> None:
    return None


@dataclass(slots=True)
class _Open:
    """The assistant message being written: its item, its place in the output, its part."""

    item: Message
    index: int
    part: OutputText


@dataclass(slots=True)
class Run:
    """One response being produced on ``ctx`` (``exchange`` counts its tokens and
    releases it)."""

    ctx: Context
    plan: Plan
    mcp: McpServers
    exchange: Exchange
    sink: Sink = _quiet
    output: list[OutputItem] = field(default_factory=list)
    status: str = "in_progress"
    incomplete: str | None = None
    awaits_client: bool = False  # it ended in calls of the client's functions
    _seq: int = 0

    async def emit(self, event: Event) -> None:
        """Number ``event`` and hand it to the sink."""
        event.sequence_number = self._seq
        self._seq += 1
        await self.sink(event)

    # -------------------------------------------------------------------------- items

    async def _add(self, item: OutputItem) -> int:
        self.output.append(item)
        index = len(self.output) - 1
        await self.emit(ItemEvent(type="response.output_item.added", output_index=index,
                                  item=item))
        return index

    async def _done(self, index: int) -> None:
        await self.emit(ItemEvent(type="response.output_item.done", output_index=index,
                                  item=self.output[index]))

    async def _progress(self, kind: str, item: OutputItem, index: int) -> None:
        await self.emit(ItemRef(type=kind, item_id=item.id, output_index=index))

    async def list_tools(self) -> None:
        """The ``mcp_list_tools`` items (one per server this response lists)."""
        for server in self.plan.listed:
            item = McpListTools(id=item_id("mcpl"), server_label=server.label)
            index = await self._add(item)
            await self._progress("response.mcp_list_tools.in_progress", item, index)
            item.tools = [McpToolInfo(name=t.name, description=t.description,
                                      input_schema=t.parameters) for t in server.tools]
            await self._progress("response.mcp_list_tools.completed", item, index)
            await self._done(index)

    # ------------------------------------------------------------------------- rounds

    async def go(self) -> None:
        """Generate until an answer, a client-side call, or the output budget."""
        await self.list_tools()
        calls_made = 0
        while True:
            await self.exchange.prefill(self.ctx)
            may_call = calls_made < self.plan.max_calls
            server_calls, client_calls, finish = await self._round(may_call)
            if finish == "length":
                self.status, self.incomplete = "incomplete", "max_output_tokens"
                if calls_made:
                    log.warning("a response ran out of max_output_tokens after %d "
                                "server-side tool calls (max_tool_calls %d): pass a smaller "
                                "max_tool_calls, so that the model must answer once they "
                                "are spent", calls_made, self.plan.max_calls)
                break
            if client_calls or not server_calls:
                self.awaits_client = bool(client_calls)
                break
            for call, text in server_calls:
                self.ctx.tool_result(call.id, text)
            calls_made += len(server_calls)
        if self.status == "in_progress":
            self.status = "completed"

    async def _round(self, may_call: bool
                     ) -> tuple[list[tuple[ToolCall, str]], list[ToolCall], str]:
        """One generation: ``(server calls with their results, client calls, finish)``."""
        plan = self.plan
        options = tool_options(plan.tools, plan.choice if may_call else "none",
                               plan.parallel)
        budget = min(plan.max_output - self.exchange.completion_tokens,
                     plan.max_seq_len - self.ctx.seq_len - len(self.ctx.pending_tokens))
        gen = self._generate(max(1, budget), options)
        message: _Open | None = None
        running: list[tuple[ToolCall, McpCall, int, dict[str, Any]]] = []
        client_calls: list[ToolCall] = []
        try:
            async with anyio.create_task_group() as tg:
                async for delta in gen:
                    self.exchange.heard(len(delta.tokens))
                    if delta.content:
                        if message is None:
                            message = await self._open_message()
                        await self._text(message, delta)
                    for call in delta.tool_calls:
                        if message is not None:
                            await self._close_message(message)
                            message = None
                        if call.name in plan.mcp:
                            running.append(await self._start_mcp(tg, call))
                        else:
                            client_calls.append(call)
                            await self._function_call(call)
                if message is not None:
                    await self._close_message(message)
        except BaseExceptionGroup as group:  # the generation's own error, unwrapped
            raise single_exception(group) from None
        server_calls = []
        for call, item, index, box in running:  # every run has finished (the task group)
            text, failed = box["result"]
            item.status = "failed" if failed else "completed"
            item.output, item.error = (None, text) if failed else (text, None)
            await self._progress("response.mcp_call.failed" if failed
                                 else "response.mcp_call.completed", item, index)
            await self._done(index)
            server_calls.append((call, text))
        return server_calls, client_calls, gen.finish_reason or "stop"

    def _generate(self, max_tokens: int, options: dict[str, Any]) -> Any:
        """The round's generator. ``text.format`` with tools: the SDK's tool format takes
        the schema for its answer where it can; where it cannot (it refuses a constraint
        beside tools), a round that must call is served without it (the call's schema
        rules), and one that may answer is refused."""
        plan = self.plan
        kw = dict(sampler=plan.sampler, max_tokens=max_tokens, speculator="prompt_lookup",
                  ignore_eos=plan.ignore_eos, **options)
        try:
            return self.ctx.generate(constrain=plan.constrain, **kw)
        except InvalidArgument:
            choice = options.get("tool_choice")
            if plan.constrain is None or not options or choice in ("auto", "none", None):
                if plan.constrain is not None and options:
                    raise ApiError(400, "'text.format' together with tools is served here "
                                        "only while a call is required (tool_choice "
                                        "'required' or a named tool): this server's tool "
                                        "format cannot yet constrain its answer",
                                   param="text") from None
                raise
            return self.ctx.generate(**kw)

    # ------------------------------------------------------------------------- output

    async def _open_message(self) -> _Open:
        item = Message(id=item_id("msg"), role="assistant", status="in_progress")
        index = await self._add(item)
        part = OutputText()
        item.content.append(part)
        await self.emit(PartEvent(type="response.content_part.added", item_id=item.id,
                                  output_index=index, part=part))
        return _Open(item, index, part)

    async def _text(self, message: _Open, delta: Delta) -> None:
        message.part.text += delta.content
        await self.emit(TextDelta(type="response.output_text.delta", item_id=message.item.id,
                                  output_index=message.index, delta=delta.content))

    async def _close_message(self, message: _Open) -> None:
        item, index, part = message.item, message.index, message.part
        await self.emit(TextDone(type="response.output_text.done", item_id=item.id,
                                 output_index=index, text=part.text))
        await self.emit(PartEvent(type="response.content_part.done", item_id=item.id,
                                  output_index=index, part=part))
        item.status = "completed"
        await self._done(index)

    async def _function_call(self, call: ToolCall) -> None:
        args = json.dumps(call.arguments)
        item = FunctionCall(id=item_id("fc"), status="in_progress", call_id=call.id,
                            name=call.name, arguments="")
        index = await self._add(item)
        await self.emit(ArgumentsDelta(type="response.function_call_arguments.delta",
                                       item_id=item.id, output_index=index, delta=args))
        item.arguments, item.status = args, "completed"
        await self.emit(FunctionArgumentsDone(type="response.function_call_arguments.done",
                                              item_id=item.id, output_index=index,
                                              name=call.name, arguments=args))
        await self._done(index)

    async def _start_mcp(self, tg: Any, call: ToolCall
                         ) -> tuple[ToolCall, McpCall, int, dict[str, Any]]:
        """Emit an ``mcp_call`` item and start its run (it goes on beside the generation)."""
        label = self.plan.mcp[call.name]
        args = json.dumps(call.arguments)
        item = McpCall(id=item_id("mcp"), server_label=label, name=call.name,
                       status="in_progress")
        index = await self._add(item)
        await self.emit(ArgumentsDelta(type="response.mcp_call_arguments.delta",
                                       item_id=item.id, output_index=index, delta=args))
        item.arguments = args
        await self.emit(McpArgumentsDone(type="response.mcp_call_arguments.done",
                                         item_id=item.id, output_index=index, arguments=args))
        await self._progress("response.mcp_call.in_progress", item, index)
        box: dict[str, Any] = {}

        async def run() -> None:
            box["result"] = await self.mcp.call(label, call.name, dict(call.arguments))

        tg.start_soon(run)
        return call, item, index, box
