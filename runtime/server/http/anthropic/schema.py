"""Anthropic's Messages API request bodies as typed msgspec Structs, and their mapping onto
the conversation the OpenAI API builds.

Owner: the shape of a request to ``/v1/messages`` (and ``/v1/messages/count_tokens``), and
its translation into the shared conversation's ``Turn`` values, SDK tools and a tool
choice (``conversation.turns`` builds the context, as for every API):

* ``system`` (a string or text blocks) is the system turn;
* a user message's ``tool_result`` blocks are tool turns (in their order), its text blocks
  one user turn after them; an ``is_error`` result's text is prefixed with ``Error: ``;
* an assistant message's text blocks and ``tool_use`` blocks are one assistant turn with
  its calls (the client's ids kept);
* ``tool_choice`` ``auto``/``any``/``tool``/``none`` is ``"auto"``/``"required"``/the
  tool's name/``"none"``; ``disable_parallel_tool_use`` turns parallel calls off.

``cache_control`` breakpoints (``{"type": "ephemeral", "ttl": "5m" or "1h"}``, at most
four) on tools, system blocks, message blocks or the request itself become
:func:`cache_points`: the prefix up to each one is held in the engine's cache for its time
to live (``api``). ``output_config.format`` (a JSON Schema) constrains the answer, beside
tools too. A field this server does not serve is refused by name (``thinking`` unless
disabled, ``mcp_servers``, ``container``, image and document blocks); fields that change
nothing here are accepted and ignored (``metadata``, ``service_tier``,
``output_config.effort``, ``speed``, ``inference_geo``...); an unknown field is refused.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from pie_ctx.tools import Tool, ToolCall
from runtime.server.http.conversation.body import MAX_STOP, MAX_TOKENS, Body, Refused
from runtime.server.http.conversation.decoding import tool_choice_of as checked_choice
from runtime.server.http.conversation.errors import ApiError
from runtime.server.http.conversation.turns import Turn, join_text

__all__ = ["MessagesRequest", "CountTokensRequest", "ACCEPTS", "REFUSED", "turns_of",
           "tool_choice_of", "cache_points", "MAX_BREAKPOINTS", "TOOLS"]

MAX_BREAKPOINTS = 4  # cache_control blocks in one request (Anthropic's limit)
TTL_S = {"5m": 300.0, "1h": 3600.0}
TOOLS = -2  # cache_points' index of a breakpoint on the tools (before the system turn)


class CacheControl(Body, kw_only=True):
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlock(Body, kw_only=True, tag_field="type", tag="text"):
    text: str
    cache_control: CacheControl | None = None
    citations: Any = None  # ignored


class _Refused(msgspec.Struct, kw_only=True, tag_field="type"):
    """A block this server does not serve, declared so that it is refused by its type (its
    fields are not read)."""


class ImageBlock(_Refused, tag="image"):
    pass


class DocumentBlock(_Refused, tag="document"):
    pass


class ThinkingBlock(Body, kw_only=True, tag_field="type", tag="thinking"):
    thinking: str = ""
    signature: str | None = None


class ToolUseBlock(Body, kw_only=True, tag_field="type", tag="tool_use"):
    id: str
    name: str
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolResultBlock(Body, kw_only=True, tag_field="type", tag="tool_result"):
    tool_use_id: str
    content: str | list[TextBlock | ImageBlock | DocumentBlock] | None = None
    is_error: bool | None = None
    cache_control: CacheControl | None = None


Block = TextBlock | ImageBlock | DocumentBlock | ThinkingBlock | ToolUseBlock | ToolResultBlock


class InputMessage(Body, kw_only=True):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class ToolSpec(Body, kw_only=True):
    name: str
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: CacheControl | None = None


class ToolChoice(Body, kw_only=True):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(msgspec.Struct, kw_only=True):
    type: str
    budget_tokens: int | None = None


class JsonOutputFormat(Body, kw_only=True):
    type: Literal["json_schema"]
    schema: dict[str, Any]


class OutputConfig(Body, kw_only=True):
    format: JsonOutputFormat | None = None  # the answer's JSON Schema
    effort: str | None = None  # ignored: this model does not reason


class CountTokensRequest(Body, kw_only=True):
    model: str
    messages: Annotated[list[InputMessage], msgspec.Meta(min_length=1)]
    system: str | list[TextBlock] | None = None
    tools: list[ToolSpec] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    cache_control: CacheControl | None = None  # a breakpoint after the last message


class MessagesRequest(CountTokensRequest, kw_only=True):
    max_tokens: Annotated[int, msgspec.Meta(ge=1, le=MAX_TOKENS)]
    stop_sequences: Annotated[list[Annotated[str, msgspec.Meta(min_length=1)]],
                              msgspec.Meta(max_length=MAX_STOP)] | None = None
    stream: bool | None = None
    temperature: Annotated[float, msgspec.Meta(ge=0, le=1)] | None = None
    top_p: Annotated[float, msgspec.Meta(ge=0, le=1)] | None = None
    top_k: Annotated[int, msgspec.Meta(ge=0)] | None = None
    ignore_eos: bool | None = None  # an extension, as on the chat API: only the budget ends it
    metadata: dict[str, Any] | None = None  # ignored
    service_tier: str | None = None  # ignored
    inference_geo: str | None = None  # ignored
    speed: str | None = None  # ignored
    diagnostics: Any = None  # ignored
    user_profile_id: str | None = None  # ignored
    workspace_id: str | None = None  # ignored
    mcp_servers: Any = None  # refused unless null
    container: Any = None  # refused unless null


_BLOCKS = ('a string, or a list of content blocks ({"type": "text", "text": "..."}, '
           '{"type": "tool_use", ...}, {"type": "tool_result", ...})')
_CACHE = '{"type": "ephemeral", "ttl": "5m" or "1h"}, or null'
ACCEPTS: dict[str, str] = {
    "model": "a string, the model's id (GET /v1/models lists it)",
    "max_tokens": f"an integer from 1 to {MAX_TOKENS} (required)",
    "messages": 'a non-empty list of messages, each {"role": "user" or "assistant", '
                '"content": ...}',
    "messages[]": '{"role": "user" or "assistant", "content": ...}',
    "messages[].role": '"user" or "assistant"',
    "messages[].content": _BLOCKS,
    "messages[].content[]": 'a content block: "text", "tool_use" or "tool_result"',
    "messages[].content[].input": "an object (the tool's arguments)",
    "messages[].content[].content": "a string or a list of text blocks",
    "system": 'a string or a list of text blocks {"type": "text", "text": "..."}',
    "system[]": '{"type": "text", "text": "..."}',
    "stop_sequences": f"a list of up to {MAX_STOP} non-empty strings",
    "stream": "true or false",
    "temperature": "a number from 0 to 1",
    "top_p": "a number from 0 to 1",
    "top_k": "an integer >= 0",
    "ignore_eos": "true or false, or null",
    "metadata": "an object",
    "tools": 'a list of tools, each {"name": "...", "description": "...", '
             '"input_schema": {JSON Schema}}',
    "tools[]": '{"name": "...", "description": "...", "input_schema": {JSON Schema}}',
    "tools[].input_schema": "a JSON Schema of an object",
    "tool_choice": '{"type": "auto", "any", "tool" or "none", "name": "..." (for "tool")}',
    "tool_choice.type": '"auto", "any", "tool" or "none"',
    "thinking": '{"type": "disabled"} (this model does not think)',
    "output_config": '{"format": {"type": "json_schema", "schema": {JSON Schema}}}',
    "output_config.format": '{"type": "json_schema", "schema": {JSON Schema}}',
    **{f"{where}cache_control": _CACHE for where in (
        "", "system[].", "tools[].", "messages[].content[].",
        "messages[].content[].content[].")},
    **{f"{where}cache_control.{field}": text for where in (
        "", "system[].", "tools[].", "messages[].content[].",
        "messages[].content[].content[].") for field, text in (
        ("type", '"ephemeral"'), ("ttl", '"5m" or "1h" (default "5m")'))},
}


REFUSED: Refused = {  # field -> (used?, why)
    "thinking": (lambda v: v is not None and v.type != "disabled", "this model does not think"),
    "mcp_servers": (lambda v: v is not None, ""),
    "container": (lambda v: v is not None, ""),
}


def _text(blocks: str | list[Any] | None, where: str) -> str:
    def refuse(j: int, block: Any) -> ApiError:
        return ApiError(400, f"{where}: only text blocks are supported here (got a "
                             f"{block.__struct_config__.tag!r} block)", param="messages")

    return join_text(blocks, lambda b: b.text if isinstance(b, TextBlock) else None, refuse)


def turns_of(req: CountTokensRequest) -> list[Turn]:
    """The request's system prompt and messages as the shared builder's turns.

    Raises:
        ApiError: a block this server does not serve, or one in the wrong role.
    """
    turns: list[Turn] = []
    system = _text(req.system, "system")
    if system:
        turns.append(Turn(-1, "system", system))
    for i, m in enumerate(req.messages):
        where = f"messages[{i}]"
        blocks = [TextBlock(text=m.content)] if isinstance(m.content, str) else m.content
        texts: list[str] = []
        calls: list[ToolCall] = []
        for j, block in enumerate(blocks):
            at = f"{where}.content[{j}]"
            if isinstance(block, TextBlock):
                texts.append(block.text)
            elif isinstance(block, ToolResultBlock) and m.role == "user":
                text = _text(block.content, at)
                if block.is_error and not text.startswith("Error"):
                    text = f"Error: {text}"
                turns.append(Turn(i, "tool", text, call_id=block.tool_use_id))
            elif isinstance(block, ToolUseBlock) and m.role == "assistant":
                calls.append(ToolCall(id=block.id, name=block.name, arguments=block.input))
            elif isinstance(block, ThinkingBlock) and m.role == "assistant":
                continue  # a past turn's thinking is not part of the prompt
            else:
                kind = block.__struct_config__.tag
                raise ApiError(400, f"{at}: a {kind!r} block is not supported in a "
                                    f"{m.role} message here", param="messages")
        if len({c.id for c in calls}) != len(calls):
            raise ApiError(400, f"{where}: two tool_use blocks share an id", param="messages")
        if texts or calls or m.role == "assistant":
            turns.append(Turn(i, m.role, "".join(texts), calls))
    return turns


def tool_choice_of(req: CountTokensRequest, tools: list[Tool]) -> tuple[str | None, bool]:
    """``(tool_choice, parallel)`` as the SDK takes them.

    Raises:
        ApiError: a choice without tools, or a ``tool`` choice naming no tool.
    """
    choice = req.tool_choice
    if choice is None:
        return ("auto" if tools else None), True
    kind = {"auto": "auto", "any": "required", "none": "none", "tool": "named"}[choice.type]
    picked = checked_choice(kind, tools, name=choice.name, quiet_without_tools=("none",))
    return picked, (not choice.disable_parallel_tool_use) if tools else True


def cache_points(req: CountTokensRequest) -> list[tuple[int, float]]:
    """The request's ``cache_control`` breakpoints as ``(index, ttl seconds)``, in prompt
    order: ``index`` is the message whose end the breakpoint holds up to (``-1``: the
    system prompt's, :data:`TOOLS`: the tools'; a block's breakpoint holds its whole
    message, the request's own the last message).

    Raises:
        ApiError: more than :data:`MAX_BREAKPOINTS` breakpoints.
    """
    points: list[tuple[int, CacheControl]] = []
    points += [(TOOLS, t.cache_control) for t in req.tools or () if t.cache_control]
    if isinstance(req.system, list):
        points += [(-1, b.cache_control) for b in req.system if b.cache_control]
    for i, m in enumerate(req.messages):
        for block in m.content if isinstance(m.content, list) else ():
            marked = [getattr(block, "cache_control", None)]
            if isinstance(block, ToolResultBlock) and isinstance(block.content, list):
                marked += [b.cache_control for b in block.content]
            points += [(i, c) for c in marked if c is not None]
    if req.cache_control is not None:
        points.append((len(req.messages) - 1, req.cache_control))
    if len(points) > MAX_BREAKPOINTS:
        raise ApiError(400, f"A maximum of {MAX_BREAKPOINTS} blocks with cache_control may "
                            f"be provided. Found {len(points)}.", param="cache_control")
    return [(i, TTL_S[c.ttl or "5m"]) for i, c in points]
