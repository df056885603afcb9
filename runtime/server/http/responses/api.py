"""OpenAI's Responses API as an inferlet: ``POST /v1/responses``, ``GET`` and ``DELETE
/v1/responses/{id}``, ``GET /v1/responses/{id}/input_items``, ``POST
/v1/responses/input_tokens``.

Owner: the routes and the context a response starts from. Written against the public SDK
only, over the conversation pipeline every API shares (``conversation``): the items become
its turns, filled with the SDK's chat fillers.

**The KV cache is the state.** A stored response is a snapshot of its context after the
answer (``store``). A request with ``previous_response_id`` opens that snapshot
(``Context.open``: no token computed, the pages shared) and fills only its new items, so
it computes only their tokens, across restarts too; any older id works the same (a
fork). The snapshot is used when the request's header (model, ``instructions`` and tools)
is the one it was built with; otherwise the conversation is built again from the stored
items under the new header (as OpenAI, instructions are not carried over), and the
engine's prefix cache finds what it can.

Server-side tools (``{"type": "mcp", "server_label": ...}``) run inside the request
(``run``); the servers are those of ``pie-ctx serve --mcp`` (``mcp``).

Errors are OpenAI's JSON body: 400 for a bad request, 404 for an unknown model or a
response id this key cannot see, 424 when a configured MCP server cannot be reached, 503
when the engine has no room. After a stream has started, an error is a
``response.failed`` event.
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

from pie_ctx import Context, Runtime
from pie_ctx.proto.errors import PieError, SnapshotNotFound
from pie_ctx.tools import Tool, ToolCall
from runtime.server.http.conversation.body import read_body
from runtime.server.http.conversation.decoding import (
    json_constraint,
    sampler_of,
    tool_choice_of,
)
from runtime.server.http.conversation.errors import ApiError, guard
from runtime.server.http.conversation.generation import Exchange, Observer, release
from runtime.server.http.conversation.holds import RETENTION_S, TOOL_WAIT_S, PromptHolds
from runtime.server.http.conversation.keys import key_scope
from runtime.server.http.conversation.sse import event_stream, sse_response
from runtime.server.http.conversation.turns import Turn, fill_turns, make_tools
from runtime.server.http.disconnect import unless_disconnected
from runtime.server.http.limits import DEFAULT_MAX_OUTPUT_TOKENS
from runtime.server.http.responses.compact import compact_context, default_budget
from runtime.server.http.responses.conversations import (
    Conversation,
    ConversationRoutes,
    Conversations,
    page,
)
from runtime.server.http.responses.items import (
    Compaction,
    Event,
    FunctionCall,
    FunctionCallOutput,
    Item,
    McpCall,
    Message,
    ResponseBody,
    ResponseEvent,
    encode,
    json_response,
)
from runtime.server.http.responses.mcp import McpServers, ServerTools
from runtime.server.http.responses.run import DEFAULT_MAX_TOOL_CALLS, Plan, Run, usage_body
from runtime.server.http.responses.schema import (
    CompactionOptions,
    FunctionTool,
    McpTool,
    NamedFunctionChoice,
    ResponsesRequest,
    decode_compact,
    decode_request,
    input_items,
    item_id,
)
from runtime.server.http.responses.store import (
    Namespaces,
    Record,
    Records,
    new_response_id,
    not_found,
)

__all__ = ["ResponsesService", "turns_of_items"]


@dataclass(slots=True)
class _Setup:
    """A request's checked parts that its conversation is built from."""

    adapter: str | None  # the LoRA adapter ``model`` names (None: the base model)
    items: list[Item]  # the request's input items
    records: Records  # the stored responses of the caller's key
    prev: Record | None  # the response it continues
    tools: list[Tool]  # the client's functions, then the MCP servers' tools
    mcp_names: dict[str, str]  # tool name -> MCP server label
    servers: list[ServerTools]  # the MCP servers the request names
    header: dict[str, Any]  # model, instructions and tools: the snapshot's key
    continued: bool  # the previous response's (or the conversation's) snapshot is used
    conv: Conversation | None = None  # the conversation the response runs in


class ResponsesService:
    """The Responses routes over the engine.

    Args:
        engine: the running engine (each API key gets a runtime of its own over it).
        get_runtime: the app's runtime (its task group holds the per-key runtimes and the
            MCP connections).
        model_name: the base model's name (a count of input tokens may leave it out).
        check_model: the LoRA adapter a request's ``model`` names (None: the base model).
        mcp: the configured MCP servers, name -> command or URL (``serve --mcp``).
        holds: the holds HTTP requests took (``prompt_cache_retention``, tool waits).
        tool_wait_s: how long a response that ends in function calls is held.
    """

    def __init__(self, engine: Any, get_runtime: Callable[[], Runtime], model_name: str,
                 check_model: Callable[[Any], str | None], observer: Observer | None = None,
                 mcp: Mapping[str, str] | None = None, holds: PromptHolds | None = None,
                 tool_wait_s: float = TOOL_WAIT_S) -> None:
        from starlette.routing import Route

        self.holds, self.tool_wait_s = holds or PromptHolds(), tool_wait_s

        self.get_runtime, self.model_name, self.check_model = (
            get_runtime, model_name, check_model)
        self.observer = observer
        self.namespaces = Namespaces(engine, get_runtime)
        self.mcp = McpServers(mcp or {}, get_runtime)
        self.routes = [
            *ConversationRoutes(self.namespaces).routes,
            Route("/v1/responses", guard(self.create), methods=["POST"]),
            Route("/v1/responses/input_tokens", guard(self.count_input_tokens),
                  methods=["POST"]),
            Route("/v1/responses/compact", guard(self.compact), methods=["POST"]),
            Route("/v1/responses/{rid}", guard(self.get), methods=["GET"]),
            Route("/v1/responses/{rid}", guard(self.delete), methods=["DELETE"]),
            Route("/v1/responses/{rid}/input_items", guard(self.input_items),
                  methods=["GET"]),
        ]

    def close(self) -> None:
        """Close the per-key runtimes and the MCP connections (the app is stopping)."""
        self.mcp.close()
        self.namespaces.close()

    async def _records(self, request: Any) -> Records:
        return Records(await self.namespaces.runtime(key_scope(request.headers)))

    # ------------------------------------------------------------------ stored ones

    async def get(self, request: Any) -> Any:
        records = await self._records(request)
        return json_response((await records.load(request.path_params["rid"])).response)

    async def delete(self, request: Any) -> Any:
        from starlette.responses import JSONResponse

        rid = request.path_params["rid"]
        records = await self._records(request)
        await records.load(rid)  # 404 unless it is this key's, alive
        await records.delete(rid)
        return JSONResponse({"id": rid, "object": "response.deleted", "deleted": True})

    async def input_items(self, request: Any) -> Any:
        records = await self._records(request)
        record = await records.load(request.path_params["rid"])
        return json_response(page(record.input_items, request.query_params))

    # ----------------------------------------------------------------------- create

    async def _setup(self, request: Any, req: ResponsesRequest,
                     prev_record: Record | None = None) -> _Setup:
        """What a request's conversation is built from (checked; no context yet);
        ``prev_record``: ``req.previous_response_id``'s record, when the caller read it."""
        adapter = self.check_model(req.model)
        items = input_items(req.input)
        records = await self._records(request)
        prev = conv = None
        if req.previous_response_id is not None:
            if req.conversation is not None:
                raise ApiError(400, "'previous_response_id' and 'conversation' cannot be used "
                                    "together: a conversation holds its own history",
                               param="conversation")
            prev = prev_record or await records.load(req.previous_response_id,
                                                     param="previous_response_id")
        if req.conversation is not None:
            cid = req.conversation if isinstance(req.conversation, str) else \
                req.conversation.id
            conv = await Conversations(records.rt).load(cid, param="conversation")
        for k in range(len(items) - 1, -1, -1):  # a compaction item: its stored context
            item = items[k]
            if isinstance(item, Compaction):
                if prev is not None or req.conversation is not None:
                    raise ApiError(400, "a 'compaction' item in 'input' continues its "
                                        "compacted context: give no previous_response_id "
                                        "or conversation with it", param="input")
                prev = await records.load(item.encrypted_content, param="input")
                items = items[k + 1:]  # those before it are in the compacted context
                break
        functions = _function_tools(req)
        mcp_tools, mcp_names, servers = await self._mcp_tools(req, {t.name for t in functions})
        tools = functions + mcp_tools
        header = {"model": req.model, "instructions": req.instructions,
                  "tools": [t.to_openai() for t in tools]}
        continued = (prev is not None and prev.header == header) or (
            conv is not None and conv.fresh(header))
        return _Setup(adapter, items, records, prev, tools, mcp_names, servers, header,
                      continued, conv)

    async def count_input_tokens(self, request: Any) -> Any:
        """``POST /v1/responses/input_tokens``: the input tokens a response to this body
        would start from (its whole context: a previous response's tokens included), as
        OpenAI's ``client.responses.input_tokens.count`` reads it. Nothing is computed;
        ``model`` and ``input`` may be left out, as OpenAI allows."""
        from starlette.responses import JSONResponse

        raw = await read_body(request)
        try:
            body = json.loads(raw or b"{}")
        except ValueError:
            raise ApiError(400, "the request body is not valid JSON") from None
        if isinstance(body, dict):
            body.setdefault("model", self.model_name)
            body.setdefault("input", [])
        req = decode_request(json.dumps(body).encode(), need_input=False)
        s = await self._setup(request, req)
        ctx = await self._context(s, req)
        try:
            count = ctx.seq_len + len(ctx.pending_tokens)
        finally:
            await release(ctx)
        return JSONResponse({"object": "response.input_tokens", "input_tokens": count})

    async def compact(self, request: Any) -> Any:
        """``POST /v1/responses/compact``: the context a response to this body would start
        from (without its answer), compacted by KV compaction (``compact``), stored as a
        response. Answers OpenAI's compacted response: the conversation's user messages,
        then a ``compaction`` item whose ``encrypted_content`` names that stored context;
        sent back as input (or its id as ``previous_response_id``), it is continued with
        no prefill of what it holds. The instructions and tools are the previous
        response's (unless ``instructions`` is given), so that its follow-ups, sent with
        them, continue the compacted context."""
        req = decode_compact(await read_body(request))
        instructions, tools, prev = req.instructions, None, None
        if req.previous_response_id is not None:
            prev = await (await self._records(request)).load(
                req.previous_response_id, param="previous_response_id")
            header = prev.header
            instructions = header["instructions"] if instructions is None else instructions
            tools = [FunctionTool(name=t["function"]["name"],
                                  description=t["function"]["description"] or None,
                                  parameters=t["function"]["parameters"])
                     for t in header["tools"]] or None
        as_response = ResponsesRequest(model=req.model, input=req.input or [],
                                       instructions=instructions, tools=tools,
                                       previous_response_id=req.previous_response_id,
                                       prompt_cache_key=req.prompt_cache_key)
        s = await self._setup(request, as_response, prev)
        ctx = await self._context(s, as_response, cue=False)
        exchange = Exchange(self.observer)
        exchange.hold(ctx)
        opts = req.compaction or CompactionOptions()
        rid = new_response_id()
        item = Compaction(id=item_id("cmp"), encrypted_content=rid)
        response = self._body(rid, as_response, s.tools)
        try:
            await exchange.prefill(ctx)
            budget = opts.budget or default_budget(ctx.seq_len, opts.window)
            await compact_context(ctx, budget, opts.window, opts.policy)
            response.status, response.output = "completed", [item]
            response.usage, response.completed_at = usage_body(exchange), int(time.time())
            history = [] if s.prev is None else [
                i for r in await s.records.chain(s.prev) for i in r.conversation_items()]
            await s.records.save(ctx, Record(
                id=rid, response=response, input_items=s.items,
                previous=None if s.prev is None else s.prev.id, header=s.header,
                created=time.time()))
        finally:
            await exchange.close(finished=True)
        users = [i for i in history + s.items if isinstance(i, Message) and i.role == "user"]
        return json_response({"id": rid, "object": "response.compaction",
                              "created_at": response.created_at, "output": [*users, item],
                              "usage": response.usage})

    async def create(self, request: Any) -> Any:
        req = decode_request(await read_body(request))
        s = await self._setup(request, req)
        records, tools, continued = s.records, s.tools, s.continued
        plan = Plan(tools=tools, mcp=s.mcp_names, listed=[] if continued else s.servers,
                    choice=_choice(req, tools, s.mcp_names), parallel=req.parallel_tool_calls
                    is not False, constrain=_constraint(req),
                    sampler=sampler_of(req.temperature, top_p=req.top_p, seed=req.seed),
                    max_output=req.max_output_tokens or DEFAULT_MAX_OUTPUT_TOKENS,
                    max_calls=req.max_tool_calls or DEFAULT_MAX_TOOL_CALLS,
                    max_seq_len=records.rt.info.max_seq_len,
                    ignore_eos=bool(req.ignore_eos))
        rid = new_response_id()
        ctx = await self._context(s, req)
        response = self._body(rid, req, tools)
        store = req.store is not False
        record = Record(id=rid, response=response, input_items=s.items,
                        previous=req.previous_response_id, header=s.header,
                        created=time.time())
        exchange = Exchange(self.observer)
        exchange.hold(ctx)
        run = Run(ctx, plan, self.mcp, exchange)
        key = key_scope(request.headers)
        if req.stream:
            return sse_response(self._stream(run, record, s, store, key, req))

        async def answer() -> None:
            await run.go()
            await self._hold(run, records, key, req)
            self._finish(run, record)
            await self._record_turn(s, run, record)
            if store:
                await records.save(ctx, record)

        try:
            await unless_disconnected(request, answer)
        finally:
            await exchange.close(finished=exchange.completion_tokens > 0)
        return json_response(record.response)

    def _stream(self, run: Run, record: Record, s: _Setup, store: bool, key: str,
                req: ResponsesRequest) -> Any:
        """The SSE events of one response (OpenAI's ``event:`` names, JSON data)."""
        exchange, records = run.exchange, s.records

        async def produce(send: Callable[[dict[str, str]], Awaitable[None]]) -> None:
            async def sink(event: Event) -> None:  # encoded now: items change later
                await send({"event": event.type, "data": encode(event).decode()})

            run.sink = sink
            for kind in ("response.created", "response.in_progress"):
                await run.emit(ResponseEvent(type=kind, response=record.response))
            await run.go()
            await self._hold(run, records, key, req)
            self._finish(run, record)
            await self._record_turn(s, run, record)
            if store:
                await records.save(run.ctx, record)
            kind = ("response.completed" if run.status == "completed"
                    else "response.incomplete")
            await run.emit(ResponseEvent(type=kind, response=record.response))

        async def failed(err: ApiError, send: Callable[[dict[str, str]], Awaitable[None]]
                         ) -> None:
            response = record.response
            response.status, response.output = "failed", run.output
            response.error = {"code": err.code or "server_error", "message": err.message}
            await run.emit(ResponseEvent(type="response.failed", response=response))

        async def finish() -> None:
            await exchange.close(finished=exchange.completion_tokens > 0)

        return event_stream(self.get_runtime(), produce, failed, lambda m: m, finish)

    # ----------------------------------------------------------------- the context

    async def _context(self, s: _Setup, req: ResponsesRequest, *, cue: bool = True
                       ) -> Context:
        """The context holding the conversation with its assistant turn opened (unless not
        ``cue``)."""
        rt, prev, conv, items, tools = s.records.rt, s.prev, s.conv, s.items, s.tools
        ctx = None
        snapshot = (prev.snapshot if prev is not None else
                    conv.snapshot if conv is not None else None)
        if s.continued and snapshot is not None:
            try:
                ctx = await Context.open(rt, snapshot)
            except SnapshotNotFound:  # saved by a server without a snapshot directory
                if prev is not None:
                    raise not_found(prev.id, "previous_response_id") from None
            turns = turns_of_items(items)
        if ctx is None:
            history: list[Item] = []
            if prev is not None:
                for r in await s.records.chain(prev):
                    history.extend(r.conversation_items())
            elif conv is not None:
                history = list(conv.items)
            turns = turns_of_items(history + items, offset=len(history))
            if req.instructions:
                turns.insert(0, Turn(-1, "system", req.instructions))
            ctx = Context(rt, adapter=s.adapter)
        try:
            fill_turns(ctx, turns, tools, cue=cue)
        except ApiError as err:
            await release(ctx)
            raise ApiError(400, err.message.replace("messages[", "input["),
                           param="tools" if err.param == "tools" else "input") from None
        except BaseException:
            await release(ctx)
            raise
        return ctx

    async def _mcp_tools(self, req: ResponsesRequest, taken: set[str]
                         ) -> tuple[list[Tool], dict[str, str], list[Any]]:
        """The MCP tools a request names: ``(tools, tool name -> server, servers)``."""
        tools: list[Tool] = []
        names: dict[str, str] = {}
        servers = []
        for i, spec in enumerate(req.tools or ()):
            if not isinstance(spec, McpTool):
                continue
            where = f"tools[{i}]"
            for name in ("server_url", "connector_id", "headers", "authorization"):
                if getattr(spec, name) is not None:
                    raise ApiError(400, f"{where}.{name}: this server reaches only the MCP "
                                        "servers its operator configured (`pie-ctx serve "
                                        "--mcp NAME=...`); name one by server_label",
                                   param="tools", code="unsupported_parameter")
            if spec.require_approval not in (None, "never"):
                raise ApiError(400, f"{where}.require_approval: only 'never' is served (the "
                                    "operator chose these servers)", param="tools",
                               code="unsupported_parameter")
            if spec.server_label not in self.mcp.targets:
                known = ", ".join(sorted(self.mcp.targets)) or "none"
                raise ApiError(400, f"{where}: no MCP server {spec.server_label[:64]!r} is "
                                    f"configured on this server (configured: {known})",
                               param="tools")
            try:
                server = await self.mcp.tools(spec.server_label)
            except PieError as err:
                raise ApiError(424, f"the MCP server {spec.server_label!r} cannot be reached: "
                                    f"{err}", param="tools", code="mcp_server_error",
                               type="server_error") from None
            allowed = spec.allowed_tools
            if allowed is not None and not isinstance(allowed, list):
                if allowed.read_only:
                    raise ApiError(400, f"{where}.allowed_tools.read_only is not served",
                                   param="tools", code="unsupported_parameter")
                allowed = allowed.tool_names
            offered = [t for t in server.tools if allowed is None or t.name in allowed]
            for tool in offered:
                if tool.name in taken or tool.name in names:
                    raise ApiError(400, f"two tools are named {tool.name!r} (the MCP server "
                                        f"{spec.server_label!r} has one)", param="tools")
                names[tool.name] = spec.server_label
                tools.append(tool)
            servers.append(ServerTools(server.label, offered, server.client, server.scope))
        return tools, names, servers

    # ------------------------------------------------------------------------ bodies

    def _body(self, rid: str, req: ResponsesRequest, tools: list[Tool]) -> ResponseBody:
        """The response object before its output (``response.created``'s)."""
        choice: Any = req.tool_choice if req.tool_choice is not None else "auto"
        fmt = req.text.format if req.text is not None and req.text.format else None
        return ResponseBody(
            id=rid, created_at=int(time.time()), model=req.model,
            instructions=req.instructions, previous_response_id=req.previous_response_id,
            tools=[msgspec.to_builtins(t) for t in req.tools or ()],
            tool_choice=msgspec.to_builtins(choice),
            parallel_tool_calls=req.parallel_tool_calls is not False,
            max_output_tokens=req.max_output_tokens, max_tool_calls=req.max_tool_calls,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            text={"format": msgspec.to_builtins(fmt) if fmt else {"type": "text"}},
            metadata=dict(req.metadata or {}), store=req.store is not False, user=req.user,
            conversation=None if req.conversation is None else {"id": (
                req.conversation if isinstance(req.conversation, str)
                else req.conversation.id)})

    async def _hold(self, run: Run, records: Records, key: str, req: ResponsesRequest
                    ) -> None:
        """Hold the response's context (its prompt and answer, what a follow-up continues)
        for ``prompt_cache_retention``'s time, or while the client runs the functions it
        called, whichever is longer."""
        ttl = max(RETENTION_S.get(req.prompt_cache_retention or "", 0.0),
                  self.tool_wait_s if run.awaits_client else 0.0)
        if ttl > 0:
            await self.holds.hold(records.rt, run.ctx, key, ttl)

    @staticmethod
    async def _record_turn(s: _Setup, run: Run, record: Record) -> None:
        """Append the response's items to its conversation (when it has one and did not
        fail), with its context as the conversation's snapshot."""
        if s.conv is None or run.status not in ("completed", "incomplete"):
            return
        await Conversations(s.records.rt).record_turn(
            s.conv.id, s.conv.version, s.header, run.ctx, s.items + list(record.response.output))

    @staticmethod
    def _finish(run: Run, record: Record) -> None:
        response = record.response
        response.status, response.output = run.status, run.output
        response.usage, response.completed_at = usage_body(run.exchange), int(time.time())
        response.incomplete_details = {"reason": run.incomplete} if run.incomplete else None


# ---------------------------------------------------------------------------- helpers


def _function_tools(req: ResponsesRequest) -> list[Tool]:
    return make_tools((s.name, s.description, s.parameters) for s in req.tools or ()
                      if isinstance(s, FunctionTool))


def _choice(req: ResponsesRequest, tools: list[Tool], mcp: dict[str, str]) -> str | None:
    """``tool_choice`` as the SDK takes it (an MCP choice: its server's tool, or any)."""
    choice = req.tool_choice
    quiet = {"quiet_without_tools": ("auto", "none")}
    if choice is None or isinstance(choice, str):
        return tool_choice_of(choice, tools, **quiet)
    if isinstance(choice, NamedFunctionChoice):
        return tool_choice_of("named", tools, name=choice.name, what="function tools",
                              among={t.name for t in tools if t.name not in mcp}, **quiet)
    if choice.name is None:
        return tool_choice_of("required", tools, **quiet)
    if tools and mcp.get(choice.name) != choice.server_label:
        raise ApiError(400, f"tool_choice names {choice.name!r}, which the MCP server "
                            f"{choice.server_label!r} does not offer here",
                       param="tool_choice")
    return tool_choice_of("named", tools, name=choice.name, **quiet)


def _constraint(req: ResponsesRequest) -> Any:
    fmt = req.text.format if req.text is not None else None
    if fmt is None:
        return None
    return json_constraint(fmt.type, fmt.schema, where="text.format", param="text",
                           missing="text.format json_schema needs 'schema': {...}")


def _text(item: Message) -> str:
    return "".join(part.text for part in item.content)


def turns_of_items(items: list[Item], offset: int = 0) -> list[Turn]:
    """Stored items as chat turns: messages as their roles (``developer`` is ``system``),
    consecutive calls as one assistant turn (after its text, if any), function outputs as
    tool turns; an ``mcp_call`` is a call and, after its group of calls, its result
    (``mcp_list_tools`` adds nothing).

    ``offset``: how many of ``items`` came before the request's own (for error indices).
    """
    turns: list[Turn] = []
    deferred: list[Turn] = []  # results of mcp_call items, after their group of calls

    def flush() -> None:
        turns.extend(deferred)
        deferred.clear()

    for k, item in enumerate(items):
        i = k - offset
        if isinstance(item, FunctionCall | McpCall):
            call_id = item.call_id if isinstance(item, FunctionCall) else item.id
            call = ToolCall(id=call_id, name=item.name,
                            arguments=json.loads(item.arguments or "{}"))
            if not turns or turns[-1].role != "assistant":
                turns.append(Turn(i, "assistant", ""))
            turns[-1].calls.append(call)
            if isinstance(item, McpCall):
                deferred.append(Turn(i, "tool", item.output or item.error or "",
                                     call_id=call_id))
            continue
        flush()
        if isinstance(item, FunctionCallOutput):
            turns.append(Turn(i, "tool", item.output, call_id=item.call_id))
        elif isinstance(item, Message):
            role = "system" if item.role == "developer" else item.role
            turns.append(Turn(i, role, _text(item)))
    flush()
    for turn in turns:
        if len({c.id for c in turn.calls}) != len(turn.calls):
            raise ApiError(400, f"input[{turn.index}]: two calls share a call_id",
                           param="input")
    return turns
