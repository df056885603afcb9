"""OpenAI's Responses API as an inferlet: ``POST /v1/responses``, ``GET`` and ``DELETE
/v1/responses/{id}``, ``GET /v1/responses/{id}/input_items``, ``POST
/v1/responses/input_tokens``.

Owner: the routes and the context a response starts from. Written against the public SDK
only, like the chat API (``openai_api``), whose conversation builder it reuses
(``openai_chat``): the items become chat turns, filled with the SDK's chat fillers.

**The KV cache is the state.** A stored response is a snapshot of its context after the
answer (``responses_store``). A request with ``previous_response_id`` opens that snapshot
(``Context.open``: no token computed, the pages shared) and fills only its new items, so
it computes only their tokens, across restarts too; any older id works the same (a
fork). The snapshot is used when the request's header (model, ``instructions`` and tools)
is the one it was built with; otherwise the conversation is built again from the stored
items under the new header (as OpenAI, instructions are not carried over), and the
engine's prefix cache finds what it can.

Server-side tools (``{"type": "mcp", "server_label": ...}``) run inside the request
(``responses_run``); the servers are those of ``pie-ctx serve --mcp``
(``responses_mcp``).

Errors are OpenAI's JSON body: 400 for a bad request, 404 for an unknown model or a
response id this key cannot see, 424 when a configured MCP server cannot be reached, 503
when the engine has no room. After a stream has started, an error is a
``response.failed`` event.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import anyio
import msgspec

from pie_ctx import Context, Runtime
from pie_ctx.constrain import JsonSchema
from pie_ctx.proto.errors import InvalidArgument, PieError, SnapshotNotFound
from pie_ctx.proto.messages import SamplerSpec
from pie_ctx.tools import Tool, ToolCall
from runtime.server.http.access_log import note_tokens
from runtime.server.http.disconnect import unless_disconnected
from runtime.server.http.limits import DEFAULT_MAX_OUTPUT_TOKENS
from runtime.server.http.openai_api import Observer, OpenAIService, as_api_error
from runtime.server.http.openai_chat import Turn, fill_turns, make_tools
from runtime.server.http.openai_schema import ApiError, read_body
from runtime.server.http.responses_mcp import McpServers, ServerTools
from runtime.server.http.responses_run import DEFAULT_MAX_TOOL_CALLS, Plan, Run
from runtime.server.http.responses_schema import (
    FunctionTool,
    McpTool,
    NamedFunctionChoice,
    ResponsesRequest,
    decode_request,
    input_items,
)
from runtime.server.http.responses_store import (
    Namespaces,
    Record,
    Records,
    new_response_id,
    not_found,
)

__all__ = ["ResponsesService", "turns_of_items"]

MIN_TEMPERATURE = 1e-5  # below it, sampling is greedy decoding


@dataclass(slots=True)
class _Setup:
    """A request's checked parts that its conversation is built from."""

    adapter: str | None
    items: list[dict[str, Any]]
    records: Records
    prev: Record | None
    tools: list[Tool]
    mcp_names: dict[str, str]  # tool name -> MCP server label
    servers: list[ServerTools]
    header: dict[str, Any]
    continued: bool  # the previous response's snapshot is used as it is


class ResponsesService:
    """The Responses routes over the engine.

    Args:
        engine: the running engine (each API key gets a runtime of its own over it).
        get_runtime: the app's runtime (its task group holds the per-key runtimes and the
            MCP connections).
        chat: the chat API's service (model names and adapters, body reading).
        mcp: the configured MCP servers, name -> command or URL (``serve --mcp``).
    """

    def __init__(self, engine: Any, get_runtime: Callable[[], Runtime], chat: OpenAIService,
                 observer: Observer | None = None, mcp: Mapping[str, str] | None = None
                 ) -> None:
        from starlette.routing import Route

        self.chat, self.observer = chat, observer
        self.namespaces = Namespaces(engine, get_runtime)
        self.mcp = McpServers(mcp or {}, get_runtime)
        self.routes = [
            Route("/v1/responses", self.chat.guard(self.create), methods=["POST"]),
            Route("/v1/responses/input_tokens", self.chat.guard(self.count_input_tokens),
                  methods=["POST"]),
            Route("/v1/responses/{rid}", self.chat.guard(self.get), methods=["GET"]),
            Route("/v1/responses/{rid}", self.chat.guard(self.delete), methods=["DELETE"]),
            Route("/v1/responses/{rid}/input_items", self.chat.guard(self.input_items),
                  methods=["GET"]),
        ]

    def close(self) -> None:
        """Close the per-key runtimes and the MCP connections (the app is stopping)."""
        self.mcp.close()
        self.namespaces.close()

    async def _records(self, request: Any) -> Records:
        ns = Namespaces.of(request.headers)
        return Records(await self.namespaces.runtime(ns))

    # ------------------------------------------------------------------ stored ones

    async def get(self, request: Any) -> Any:
        from starlette.responses import JSONResponse

        records = await self._records(request)
        return JSONResponse((await records.load(request.path_params["rid"])).response)

    async def delete(self, request: Any) -> Any:
        from starlette.responses import JSONResponse

        rid = request.path_params["rid"]
        records = await self._records(request)
        await records.load(rid)  # 404 unless it is this key's, alive
        await records.delete(rid)
        return JSONResponse({"id": rid, "object": "response.deleted", "deleted": True})

    async def input_items(self, request: Any) -> Any:
        from starlette.responses import JSONResponse

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
        ids = [i["id"] for i in items]
        for cursor, step in (("after", 1), ("before", 0)):
            if cursor in q:
                if q[cursor] not in ids:
                    raise ApiError(400, f"'{cursor}' names no item of this response",
                                   param=cursor)
                k = ids.index(q[cursor])
                items = items[k + 1:] if step else items[:k]
                ids = [i["id"] for i in items]
        page = items[:limit]
        return JSONResponse({"object": "list", "data": page,
                             "first_id": page[0]["id"] if page else None,
                             "last_id": page[-1]["id"] if page else None,
                             "has_more": len(items) > limit})

    # ----------------------------------------------------------------------- create

    async def _setup(self, request: Any, req: ResponsesRequest) -> _Setup:
        """What a request's conversation is built from (checked; no context yet)."""
        adapter = self.chat.check_model(req.model)
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
            body.setdefault("model", self.chat.model_name)
            body.setdefault("input", [])
        req = decode_request(json.dumps(body).encode())
        s = await self._setup(request, req)
        ctx = await self._context(s.records, s.prev, s.continued, req, s.items, s.tools,
                                  s.adapter)
        try:
            count = ctx.seq_len + len(ctx.pending_tokens)
        finally:
            await _release(ctx)
        return JSONResponse({"object": "response.input_tokens", "input_tokens": count})

    async def create(self, request: Any) -> Any:
        req = decode_request(await read_body(request))
        s = await self._setup(request, req)
        records, prev, tools, continued = s.records, s.prev, s.tools, s.continued
        plan = Plan(tools=tools, mcp=s.mcp_names, listed=[] if continued else s.servers,
                    choice=_choice(req, tools, s.mcp_names), parallel=req.parallel_tool_calls
                    is not False, constrain=_constraint(req), sampler=_sampler(req),
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
        arrived = time.perf_counter()
        if req.stream:
            from sse_starlette.sse import EventSourceResponse

            return EventSourceResponse(self._stream(ctx, plan, record, records, store,
                                                    arrived), ping=15)
        run = Run(ctx, plan, self.mcp)

        async def answer() -> None:
            await run.go()
            self._finish(run, record)
            if store:
                await records.save(ctx, record)

        try:
            await unless_disconnected(request, answer)
        finally:
            await _release(ctx)
            self._observe(run, arrived)
        from starlette.responses import JSONResponse

        return JSONResponse(record.response)

    async def _stream(self, ctx: Context, plan: Plan, record: Record, records: Records,
                      store: bool, arrived: float) -> AsyncIterator[dict[str, str]]:
        """The SSE events of one response (OpenAI's ``event:`` names, JSON data)."""
        send, receive = anyio.create_memory_object_stream[dict[str, Any]](256)
        run = Run(ctx, plan, self.mcp, sink=send.send)
        scope = anyio.CancelScope()

        async def produce() -> None:
            with scope:
                async with send:
                    try:
                        await run.emit("response.created", response=dict(record.response))
                        await run.emit("response.in_progress",
                                       response=dict(record.response))
                        await run.go()
                        self._finish(run, record)
                        if store:
                            await records.save(ctx, record)
                        kind = ("response.completed" if run.status == "completed"
                                else "response.incomplete")
                        await run.emit(kind, response=record.response)
                    except Exception as err:  # noqa: BLE001 - after the headers: an event
                        e = as_api_error(err)
                        record.response.update(status="failed", output=run.output,
                                               error={"code": e.code or "server_error",
                                                      "message": e.message})
                        await run.emit("response.failed", response=record.response)

        self.chat.get_runtime().start_soon(produce)
        try:
            async with receive:
                async for event in receive:
                    yield {"event": event["type"], "data": json.dumps(event)}
        finally:  # done, or the client went away: stop generating, release the context
            scope.cancel()
            await _release(ctx)
            self._observe(run, arrived)

    def _observe(self, run: Run, arrived: float) -> None:
        note_tokens(run.usage.input, run.usage.output)  # the access log's counts
        if self.observer is None or run.usage.output == 0:
            return
        if run.first_token is not None:
            self.observer.first_token(run.first_token - arrived)
        self.observer.tokens(run.usage.input, run.usage.cached, run.usage.output)

    # ----------------------------------------------------------------- the context

    async def _context(self, records: Records, prev: Record | None, continued: bool,
                       req: ResponsesRequest, items: list[dict[str, Any]], tools: list[Tool],
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
            history: list[dict[str, Any]] = []
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
            await _release(ctx)
            raise ApiError(400, err.message.replace("messages[", "input["),
                           param="tools" if err.param == "tools" else "input") from None
        except BaseException:
            await _release(ctx)
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

    def _body(self, rid: str, req: ResponsesRequest, tools: list[Tool]) -> dict[str, Any]:
        """The response object before its output (``response.created``'s)."""
        choice: Any = req.tool_choice if req.tool_choice is not None else "auto"
        fmt = req.text.format if req.text is not None and req.text.format else None
        return {
            "id": rid, "object": "response", "created_at": int(time.time()),
            "status": "in_progress", "model": req.model, "output": [],
            "instructions": req.instructions, "previous_response_id":
                req.previous_response_id,
            "tools": [msgspec.to_builtins(t) for t in req.tools or ()],
            "tool_choice": msgspec.to_builtins(choice),
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "max_output_tokens": req.max_output_tokens, "max_tool_calls": req.max_tool_calls,
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "top_p": 1.0 if req.top_p is None else req.top_p,
            "text": {"format": msgspec.to_builtins(fmt) if fmt else {"type": "text"}},
            "truncation": "disabled", "metadata": dict(req.metadata or {}),
            "store": req.store is not False, "background": False, "usage": None,
            "error": None, "incomplete_details": None, "reasoning": {"effort": None,
                                                                     "summary": None},
            "user": req.user, "service_tier": "default",
        }

    @staticmethod
    def _finish(run: Run, record: Record) -> None:
        record.response.update(
            status=run.status, output=run.output, usage=run.usage.body(),
            completed_at=int(time.time()),
            incomplete_details={"reason": run.incomplete} if run.incomplete else None)


# ---------------------------------------------------------------------------- helpers


async def _release(ctx: Context) -> None:
    with anyio.CancelScope(shield=True):
        try:
            await ctx.release()
        except PieError:
            pass


def _function_tools(req: ResponsesRequest) -> list[Tool]:
    return make_tools((s.name, s.description, s.parameters) for s in req.tools or ()
                      if isinstance(s, FunctionTool))


def _choice(req: ResponsesRequest, tools: list[Tool], mcp: dict[str, str]) -> str | None:
    choice = req.tool_choice
    if choice is None or not tools and choice in ("auto", "none"):
        return None if not tools else choice
    if not tools:
        raise ApiError(400, "'tool_choice' needs 'tools'", param="tool_choice")
    if isinstance(choice, str):
        return choice
    if isinstance(choice, NamedFunctionChoice):
        if choice.name not in {t.name for t in tools} or choice.name in mcp:
            raise ApiError(400, f"tool_choice names {choice.name!r}, which is not one of the "
                                "function tools", param="tool_choice")
        return choice.name
    if choice.name is None:
        return "required"
    if mcp.get(choice.name) != choice.server_label:
        raise ApiError(400, f"tool_choice names {choice.name!r}, which the MCP server "
                            f"{choice.server_label!r} does not offer here",
                       param="tool_choice")
    return choice.name


def _constraint(req: ResponsesRequest) -> Any:
    fmt = req.text.format if req.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return JsonSchema({"type": "object"})
    if fmt.schema is None:
        raise ApiError(400, "text.format json_schema needs 'schema': {...}",
                       param="text")
    try:
        return JsonSchema(fmt.schema)
    except InvalidArgument as err:
        raise ApiError(400, f"text.format: {err}", param="text") from None


def _sampler(req: ResponsesRequest) -> SamplerSpec:
    temperature = 1.0 if req.temperature is None else float(req.temperature)
    if temperature < MIN_TEMPERATURE:  # its limit; the engine's sampler fails on 1e-100
        return SamplerSpec()
    return SamplerSpec(temperature=temperature, top_p=float(req.top_p or 1.0), seed=req.seed)


def _text(item: dict[str, Any]) -> str:
    content = item.get("content")
    if isinstance(content, str):
        return content
    return "".join(p.get("text") or p.get("refusal") or "" for p in content or ())


def turns_of_items(items: list[dict[str, Any]], offset: int = 0) -> list[Turn]:
    """Stored items as chat turns: messages as their roles (``developer`` is ``system``),
    consecutive calls as one assistant turn (after its text, if any), function outputs as
    tool turns; an ``mcp_call`` is a call and, after its group of calls, its result.

    ``offset``: how many of ``items`` came before the request's own (for error indices).
    """
    turns: list[Turn] = []
    deferred: list[Turn] = []  # results of mcp_call items, after their group of calls

    def flush() -> None:
        turns.extend(deferred)
        deferred.clear()

    for k, item in enumerate(items):
        i = k - offset
        kind = item["type"]
        if kind in ("function_call", "mcp_call"):
            call_id = item["call_id"] if kind == "function_call" else item["id"]
            call = ToolCall(id=call_id, name=item["name"],
                            arguments=json.loads(item["arguments"] or "{}"))
            if not turns or turns[-1].role != "assistant":
                turns.append(Turn(i, "assistant", ""))
            turns[-1].calls.append(call)
            if kind == "mcp_call":
                deferred.append(Turn(i, "tool", item.get("output") or item.get("error") or "",
                                     call_id=call_id))
            continue
        flush()
        if kind == "function_call_output":
            turns.append(Turn(i, "tool", item["output"], call_id=item["call_id"]))
        elif kind == "message":
            role = "system" if item["role"] == "developer" else item["role"]
            turns.append(Turn(i, role, _text(item)))
    flush()
    for turn in turns:
        if len({c.id for c in turn.calls}) != len(turn.calls):
            raise ApiError(400, f"input[{turn.index}]: two calls share a call_id",
                           param="input")
    return turns
