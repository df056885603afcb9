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
from runtime.server.http.conversation.keys import key_scope
from runtime.server.http.conversation.sse import event_stream, sse_response
from runtime.server.http.conversation.turns import Turn, fill_turns, make_tools
from runtime.server.http.disconnect import unless_disconnected
from runtime.server.http.limits import DEFAULT_MAX_OUTPUT_TOKENS
from runtime.server.http.responses.items import (
    Event,
    FunctionCall,
    FunctionCallOutput,
    Item,
    McpCall,
    Message,
    ResponseBody,
    ResponseEvent,
    encode,
)
from runtime.server.http.responses.mcp import McpServers, ServerTools
from runtime.server.http.responses.run import DEFAULT_MAX_TOOL_CALLS, Plan, Run, usage_body
from runtime.server.http.responses.schema import (
    FunctionTool,
    McpTool,
    NamedFunctionChoice,
    ResponsesRequest,
    decode_request,
    input_items,
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
    continued: bool  # the previous response's snapshot is used as it is


class ResponsesService:
    """The Responses routes over the engine.

    Args:
        engine: the running engine (each API key gets a runtime of its own over it).
        get_runtime: the app's runtime (its task group holds the per-key runtimes and the
            MCP connections).
        model_name: the base model's name (a count of input tokens may leave it out).
        check_model: the LoRA adapter a request's ``model`` names (None: the base model).
        mcp: the configured MCP servers, name -> command or URL (``serve --mcp``).
    """

    def __init__(self, engine: Any, get_runtime: Callable[[], Runtime], model_name: str,
                 check_model: Callable[[Any], str | None], observer: Observer | None = None,
                 mcp: Mapping[str, str] | None = None) -> None:
        from starlette.routing import Route

        self.get_runtime, self.model_name, self.check_model = (
            get_runtime, model_name, check_model)
        self.observer = observer
        self.namespaces = Namespaces(engine, get_runtime)
        self.mcp = McpServers(mcp or {}, get_runtime)
        self.routes = [
            Route("/v1/responses", guard(self.create), methods=["POST"]),
            Route("/v1/responses/input_tokens", guard(self.count_input_tokens),
                  methods=["POST"]),
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
        return _json((await records.load(request.path_params["rid"])).response)

    async def delete(self, request: Any) -> Any:
        from starlette.responses import JSONResponse

        rid = request.path_params["rid"]
        records = await self._records(request)
        await records.load(rid)  # 404 unless it is this key's, alive
        await records.delete(rid)
        return JSONResponse({"id": rid, "object": "response.deleted", "deleted": True})

    async def input_items(self, request: Any) -> Any:
        q = request.query_params
        records = await self._records(request)
        items = list((await records.load(request.path_params["rid"])).input_items)
        order = q.get("order", "desc")
        if order not in ("asc", "desc"):
            raise ApiError(400, "'order' is 'asc' or 'desc'", param="order")
        try:
            limit = int(q.get("limit", "20"))
        except ValueError:
            limit = 0
        if not 1 <= limit <= 100:
            raise ApiError(400, "'limit' is an integer from 1 to 100", param="limit")
        if order == "desc":
            items.reverse()
        ids = [i.id for i in items]
        for cursor, step in (("after", 1), ("before", 0)):
            if cursor in q:
                if q[cursor] not in ids:
                    raise ApiError(400, f"'{cursor}' names no item of this response",
                                   param=cursor)
                k = ids.index(q[cursor])
                items = items[k + 1:] if step else items[:k]
                ids = [i.id for i in items]
        page = items[:limit]
        return _json({"object": "list", "data": page,
                      "first_id": page[0].id if page else None,
                      "last_id": page[-1].id if page else None,
                      "has_more": len(items) > limit})

    # ----------------------------------------------------------------------- create

    async def _setup(self, request: Any, req: ResponsesRequest) -> _Setup:
        """What a request's conversation is built from (checked; no context yet)."""
        adapter = self.check_model(req.model)
        items = input_items(req.input)
        records = await self._records(request)
        prev = None
        if req.previous_response_id is not None:
            prev = await records.load(req.previous_response_id, param="previous_response_id")
        functions = _function_tools(req)
        mcp_tools, mcp_names, servers = await self._mcp_tools(req, {t.name for t in functions})
        tools = functions + mcp_tools
        header = {"model": req.model, "instructions": req.instructions,
                  "tools": [t.to_openai() for t in tools]}
        continued = prev is not None and prev.header == header
        return _Setup(adapter, items, records, prev, tools, mcp_names, servers, header,
                      continued)

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
        req = decode_request(json.dumps(body).encode())
        s = await self._setup(request, req)
        ctx = await self._context(s.records, s.prev, s.continued, req, s.items, s.tools,
                                  s.adapter)
        try:
            count = ctx.seq_len + len(ctx.pending_tokens)
        finally:
            await release(ctx)
        return JSONResponse({"object": "response.input_tokens", "input_tokens": count})

    async def create(self, request: Any) -> Any:
        req = decode_request(await read_body(request))
        s = await self._setup(request, req)
        records, prev, tools, continued = s.records, s.prev, s.tools, s.continued
        plan = Plan(tools=tools, mcp=s.mcp_names, listed=[] if continued else s.servers,
                    choice=_choice(req, tools, s.mcp_names), parallel=req.parallel_tool_calls
                    is not False, constrain=_constraint(req),
                    sampler=sampler_of(req.temperature, top_p=req.top_p, seed=req.seed),
                    max_output=req.max_output_tokens or DEFAULT_MAX_OUTPUT_TOKENS,
                    max_calls=req.max_tool_calls or DEFAULT_MAX_TOOL_CALLS,
                    max_seq_len=records.rt.info.max_seq_len,
                    ignore_eos=bool(req.ignore_eos))
        rid = new_response_id()
        ctx = await self._context(records, prev, continued, req, s.items, tools, s.adapter)
        response = self._body(rid, req, tools)
        store = req.store is not False
        record = Record(id=rid, response=response, input_items=s.items,
                        previous=req.previous_response_id, header=s.header,
                        created=time.time())
        exchange = Exchange(self.observer)
        exchange.hold(ctx)
        run = Run(ctx, plan, self.mcp, exchange)
        if req.stream:
            return sse_response(self._stream(run, record, records, store))

        async def answer() -> None:
            await run.go()
            self._finish(run, record)
            if store:
                await records.save(ctx, record)

        try:
            await unless_disconnected(request, answer)
        finally:
            await exchange.close(finished=exchange.completion_tokens > 0)
        return _json(record.response)

    def _stream(self, run: Run, record: Record, records: Records, store: bool) -> Any:
        """The SSE events of one response (OpenAI's ``event:`` names, JSON data)."""
        exchange = run.exchange

        async def produce(send: Callable[[dict[str, str]], Awaitable[None]]) -> None:
            async def sink(event: Event) -> None:  # encoded now: items change later
                await send({"event": event.type, "data": encode(event).decode()})

            run.sink = sink
            for kind in ("response.created", "response.in_progress"):
                await run.emit(ResponseEvent(type=kind, response=record.response))
            await run.go()
            self._finish(run, record)
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

    async def _context(self, records: Records, prev: Record | None, continued: bool,
                       req: ResponsesRequest, items: list[Item], tools: list[Tool],
                       adapter: str | None) -> Context:
        """The context holding the conversation with its assistant turn opened."""
        rt = records.rt
        ctx = None
        if continued and prev is not None:
            try:
                ctx = await Context.open(rt, prev.snapshot)
            except SnapshotNotFound:  # saved by a server without a snapshot directory
                raise not_found(prev.id, "previous_response_id") from None
            turns = turns_of_items(items)
        else:
            history: list[Item] = []
            if prev is not None:
                for r in await records.chain(prev):
                    history.extend(r.conversation_items())
            turns = turns_of_items(history + items, offset=len(history))
            if req.instructions:
                turns.insert(0, Turn(-1, "system", req.instructions))
            ctx = Context(rt, adapter=adapter)
        try:
            fill_turns(ctx, turns, tools)
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
            metadata=dict(req.metadata or {}), store=req.store is not False, user=req.user)

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


def _json(value: Any) -> Any:
    """A JSON response of typed objects (``items``) or plain data holding them."""
    from starlette.responses import Response

    return Response(encode(value), media_type="application/json")


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
