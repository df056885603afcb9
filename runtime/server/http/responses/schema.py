"""The body of ``POST /v1/responses`` as typed msgspec Structs, and its input items.

Owner: the shape of a Responses request. :func:`decode_request` checks the body in one pass
(types, ranges, unknown fields: refused by name as the chat API does, through
``conversation.body.decode``); :func:`input_items` turns ``input`` (a string, or a list of
items) into the typed items (``items``) this server stores and lists back (``GET
/v1/responses/{id}/input_items``), each with an ``id``.

Items served: messages (``user``, ``system``, ``developer``, ``assistant``; content a
string or ``input_text``/``output_text`` parts), ``function_call``,
``function_call_output``, and ``mcp_call``/``mcp_list_tools`` and ``compaction`` items a
client sends back from an earlier response (or ``/v1/responses/compact``). Any other item type (images, files, reasoning, computer calls...)
is a 400 naming it.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable
from typing import Annotated, Any, Literal

import msgspec

import runtime.server.http.conversation.body as body
from runtime.server.http.conversation.errors import ApiError
from runtime.server.http.conversation.turns import join_text, parse_arguments
from runtime.server.http.responses.items import (
    Compaction,
    FunctionCall,
    FunctionCallOutput,
    InputText,
    Item,
    McpCall,
    Message,
    OutputText,
)

__all__ = ["ResponsesRequest", "CompactRequest", "FunctionTool", "McpTool", "decode_request",
           "decode_compact", "input_items",
           "item_id", "MAX_ITEMS", "MAX_METADATA"]

MAX_ITEMS = 4096  # input items in one request
MAX_METADATA = 16  # OpenAI's limit: 16 keys of <= 64 characters, values of <= 512
MAX_TOOL_CALLS = 64  # the most server-side (MCP) calls one request may ask for


class FunctionTool(body.FunctionFields, kw_only=True, tag_field="type", tag="function"):
    """A function tool: its fields at the top level, beside ``type``."""


class McpAllowed(body.Body, kw_only=True):
    tool_names: list[str] | None = None
    read_only: bool | None = None  # refused when true (no tool is known to be read-only)


class McpTool(body.Body, kw_only=True, tag_field="type", tag="mcp"):
    server_label: str
    allowed_tools: list[str] | McpAllowed | None = None
    require_approval: Any = None  # only "never" (or null) is served: no approval round trip
    server_description: str | None = None  # ignored (the server's own descriptions are used)
    # Refused unless null: a request names only servers the operator configured
    # (``serve --mcp``).
    server_url: Any = None
    connector_id: Any = None
    headers: dict[str, Any] | None = None
    authorization: Any = None


Tool = FunctionTool | McpTool
IgnoredText = str | None  # a string field accepted and ignored: it changes no output


class NamedFunctionChoice(body.Body, kw_only=True, tag_field="type", tag="function"):
    name: str


class McpChoice(body.Body, kw_only=True, tag_field="type", tag="mcp"):
    server_label: str
    name: str | None = None


class TextFormat(body.JsonSchemaFields, kw_only=True):
    type: body.FormatType


class TextConfig(body.Body, kw_only=True):
    format: TextFormat | None = None
    verbosity: str | None = None  # ignored


class ConversationRef(body.Body, kw_only=True):
    id: str


class StreamOptions(body.Body, kw_only=True):
    include_obfuscation: bool | None = None  # ignored: nothing is obfuscated


class ResponsesRequest(body.OpenAIFields, kw_only=True):
    input: str | Annotated[list[Any], msgspec.Meta(max_length=MAX_ITEMS)]
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: list[Tool] | None = None
    tool_choice: (Literal["auto", "none", "required"] | NamedFunctionChoice | McpChoice
                  | None) = None
    parallel_tool_calls: bool | None = None
    max_tool_calls: Annotated[int, msgspec.Meta(ge=1, le=MAX_TOOL_CALLS)] | None = None
    text: TextConfig | None = None
    max_output_tokens: body.TokenCount | None = None
    stream_options: StreamOptions | None = None
    store: bool | None = None
    metadata: Annotated[dict[Annotated[str, msgspec.Meta(max_length=64)],
                             Annotated[str, msgspec.Meta(max_length=512)]],
                        msgspec.Meta(max_length=MAX_METADATA)] | None = None
    # ignored: they change nothing about the output
    safety_identifier: IgnoredText = None
    truncation: Literal["auto", "disabled"] | None = None
    # the fleet routes by the key (runtime.fleet.sessions); the retention holds the prompt
    prompt_cache_key: str | None = None
    prompt_cache_retention: body.Retention | None = None
    service_tier: IgnoredText = None
    include: list[str] | None = None
    top_logprobs: Annotated[int, msgspec.Meta(ge=0, le=20)] | None = None  # refused unless 0
    conversation: str | ConversationRef | None = None  # the conversation it runs in
    # refused unless null (or false)
    reasoning: Any = None
    background: bool | None = None
    prompt: Any = None


_REFUSED_HERE: body.Refused = {
    "reasoning": (lambda v: v is not None and any(x is not None for x in (
        v.values() if isinstance(v, dict) else [v])), "this model does not reason"),
    "background": (lambda v: bool(v), "background responses are not supported"),
    "prompt": (lambda v: v is not None, "stored prompt templates are not supported"),
    "top_logprobs": (lambda v: v not in (None, 0), "logprobs are not served by "
                                                   "/v1/responses (use /v1/chat/completions)"),
}

_ITEM = ('{"role": "user", "content": "..."}, {"type": "function_call_output", "call_id": '
         '"...", "output": "..."} or {"type": "function_call", "call_id": "...", "name": '
         '"...", "arguments": "{...}"}')
RESPONSES_ACCEPTS: dict[str, str] = {
    **body.COMMON_ACCEPTS,
    "input": f"a string, or a list of at most {MAX_ITEMS} items, each {_ITEM}",
    "instructions": "a string (the system message), or null",
    "previous_response_id": "the id of a stored response (resp_...), or null",
    "tools": ('a list of tools, each {"type": "function", "name": "...", "parameters": {...}}'
              ' or {"type": "mcp", "server_label": "..."} (a server configured with '
              '`pie-ctx serve --mcp`), or null'),
    "tools[]": ('{"type": "function", "name": "...", "parameters": {JSON Schema}} or '
                '{"type": "mcp", "server_label": "..."}'),
    "tool_choice": ('"auto", "none", "required", {"type": "function", "name": "..."} or '
                    '{"type": "mcp", "server_label": "...", "name": "..."}, or null'),
    "max_tool_calls": f"an integer from 1 to {MAX_TOOL_CALLS}, or null",
    "text": '{"format": {"type": "text"}, {"type": "json_object"} or {"type": '
            '"json_schema", "name": "...", "schema": {JSON Schema}}}, or null',
    "text.format": '{"type": "text"}, {"type": "json_object"} or {"type": "json_schema", '
                   '"name": "...", "schema": {JSON Schema}}',
    "max_output_tokens": body.COMMON_ACCEPTS["max_tokens"],
    "metadata": f"an object of at most {MAX_METADATA} string values (keys of at most 64 "
                "characters, values of at most 512), or null",
    "truncation": '"auto" or "disabled", or null',
    "include": "a list of strings (ignored), or null",
    "stream_options": '{"include_obfuscation": true or false}, or null',
    "top_logprobs": "0 or null",
    "conversation": 'the id of a conversation (conv_...) or {"id": "conv_..."}, or null',
    "ignore_eos": "true or false, or null",
}


def decode_request(raw: bytes, *, need_input: bool = True) -> ResponsesRequest:
    """The request body, checked (see the module docstring); ``need_input``: an empty
    ``input`` is refused (a count of input tokens may have none).

    Raises:
        ApiError: 400 naming the first field that is wrong, unknown or refused.
    """
    req = body.decode(raw, ResponsesRequest, RESPONSES_ACCEPTS)
    body.check_refused(req, _REFUSED_HERE)
    if need_input and not req.input:
        raise ApiError(400, "'input' must not be empty", param="input")
    return req


class CompactionOptions(body.Body, kw_only=True):
    """pie-ctx's extension of ``/v1/responses/compact``: how the context is compacted."""

    budget: Annotated[int, msgspec.Meta(ge=16)] | None = None  # tokens kept
    window: Annotated[int, msgspec.Meta(ge=1, le=256)] = 32  # the observation window
    policy: Literal["snapkv", "streaming"] = "snapkv"


class CompactRequest(body.Body, kw_only=True):
    """The body of ``POST /v1/responses/compact`` (OpenAI's fields this server reads)."""

    model: str
    input: str | Annotated[list[Any], msgspec.Meta(max_length=MAX_ITEMS)] | None = None
    instructions: str | None = None
    previous_response_id: str | None = None
    prompt_cache_key: str | None = None  # the fleet routes by it
    compaction: CompactionOptions | None = None


COMPACT_ACCEPTS: dict[str, str] = {
    "model": RESPONSES_ACCEPTS["model"], "input": RESPONSES_ACCEPTS["input"],
    "instructions": RESPONSES_ACCEPTS["instructions"],
    "previous_response_id": RESPONSES_ACCEPTS["previous_response_id"],
    "compaction": '{"budget": tokens kept (>= 16), "window": 1-256, "policy": "snapkv" or '
                  '"streaming"}, or null',
}


def decode_compact(raw: bytes) -> CompactRequest:
    """The body of a compaction request, checked.

    Raises:
        ApiError: 400 naming the first field that is wrong or unknown, or a body that names
            no context (neither ``input`` nor ``previous_response_id``).
    """
    req = body.decode(raw, CompactRequest, COMPACT_ACCEPTS)
    if not req.input and req.previous_response_id is None:
        raise ApiError(400, "give 'input', 'previous_response_id' or both: the context to "
                            "compact", param="input")
    return req


# --------------------------------------------------------------------------------- items


def item_id(prefix: str) -> str:
    """A new item id (``msg_...``, ``fc_...``): unique, never reused."""
    return f"{prefix}_{secrets.token_hex(12)}"


def _bad(i: int, message: str) -> ApiError:
    return ApiError(400, f"input[{i}]: {message}", param="input")


def _string(item: dict[str, Any], key: str, i: int, *, required: bool = True) -> str:
    value = item.get(key)
    if value is None and not required:
        return ""
    if not isinstance(value, str):
        raise _bad(i, f"'{key}' must be a string")
    return value


def _text_parts(content: Any, i: int, role: str) -> str:
    """A message's text: a string, or text parts (``input_text``, ``output_text``,
    ``refusal``)."""
    if not isinstance(content, str | list):
        raise _bad(i, "'content' must be a string or a list of text parts")

    def kind(part: Any) -> Any:
        return part.get("type") if isinstance(part, dict) else None

    def text_of(part: Any) -> str | None:
        key = {"input_text": "text", "output_text": "text", "text": "text",
               "refusal": "refusal"}.get(kind(part))
        value = part.get(key) if key else None
        return value if isinstance(value, str) else None

    def refuse(j: int, part: Any) -> ApiError:
        return _bad(i, f"content[{j}]: only text parts are supported ({{\"type\": "
                       f"\"input_text\", \"text\": \"...\"}}), got {str(kind(part))[:40]!r}")

    return join_text(content, text_of, refuse)


def _message(item: dict[str, Any], i: int, new_id: Callable[[str], str]) -> Message:
    role = item.get("role")
    if role not in ("user", "system", "developer", "assistant"):
        raise _bad(i, "a message's 'role' is 'user', 'system', 'developer' or 'assistant'")
    text = _text_parts(item.get("content"), i, role)
    part = OutputText(text=text) if role == "assistant" else InputText(text=text)
    return Message(id=new_id("msg"), role=role, content=[part])


def _arguments(item: dict[str, Any], i: int) -> str:
    args = item.get("arguments")
    if isinstance(args, dict):
        return json.dumps(args)
    if not isinstance(args, str) or parse_arguments(args) is None:
        raise _bad(i, "'arguments' must be a JSON object as a string")
    return args


def _item(item: Any, i: int, keep_ids: bool) -> Item | None:
    """One input item in its stored shape (None: an item that adds nothing to the
    conversation, as an ``mcp_list_tools`` the client echoes back)."""
    if not isinstance(item, dict):
        raise _bad(i, f"an item is an object, e.g. {_ITEM}")
    given = item.get("id")

    def new_id(prefix: str) -> str:  # the client's id, kept when asked (a valid string)
        keep = keep_ids and isinstance(given, str) and 0 < len(given) <= 128
        return given if keep else item_id(prefix)

    kind = item.get("type", "message")
    if kind == "message":
        return _message(item, i, new_id)
    if kind == "function_call":
        return FunctionCall(id=new_id("fc"), call_id=_string(item, "call_id", i),
                            name=_string(item, "name", i), arguments=_arguments(item, i))
    if kind == "function_call_output":
        out = item.get("output")
        text = out if isinstance(out, str) else _text_parts(out, i, "tool")
        return FunctionCallOutput(id=new_id("fco"), call_id=_string(item, "call_id", i),
                                  output=text)
    if kind == "mcp_call":
        error = item.get("error")
        return McpCall(id=_string(item, "id", i), server_label=_string(item, "server_label", i),
                       name=_string(item, "name", i), arguments=_arguments(item, i),
                       output=_string(item, "output", i, required=False),
                       error=error if isinstance(error, str) else None)
    if kind == "mcp_list_tools":
        return None
    if kind == "compaction":
        return Compaction(id=new_id("cmp"),
                          encrypted_content=_string(item, "encrypted_content", i))
    raise _bad(i, f"items of type {str(kind)[:40]!r} are not supported (served: message, "
                  "function_call, function_call_output, mcp_call, mcp_list_tools, "
                  "compaction)")


def input_items(value: str | list[Any], *, keep_ids: bool = False) -> list[Item]:
    """``input`` as stored items (a string is one user message); ``keep_ids``: an item
    keeps the ``id`` it carries (items added to a conversation), else each gets a new one.

    Raises:
        ApiError: an item this server cannot read (400 naming ``input[i]``).
    """
    if isinstance(value, str):
        value = [{"role": "user", "content": value}]
    items = []
    for i, raw in enumerate(value):
        item = _item(raw, i, keep_ids)
        if item is not None:
            items.append(item)
    return items

