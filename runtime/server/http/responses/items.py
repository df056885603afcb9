"""The Responses API's objects as typed msgspec Structs: items, the response, its events.

Owner: the shapes ``/v1/responses`` answers with and stores. Each encodes to OpenAI's JSON
(``openai.types.responses``), so the official client and the frameworks built on it parse
them; nothing else in the package builds one of these objects as a dict.

* **Items** are tagged by ``type`` (``message``, ``function_call``,
  ``function_call_output``, ``mcp_call``, ``mcp_list_tools``, ``compaction``), so a stored record decodes
  back into them in one pass (``Item``). A record written before the items were typed
  holds the same JSON, and fields this module leaves out or has since added are filled
  with their defaults: old records decode as they are.
* **The response** (``ResponseBody``) is the object ``GET /v1/responses/{id}`` returns and
  every ``response.*`` event carries.
* **Events** carry their ``type`` as a field (the SSE ``event:`` name) and a
  ``sequence_number`` the producer sets; one class per shape.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

__all__ = ["InputText", "OutputText", "Message", "FunctionCall", "FunctionCallOutput",
           "McpToolInfo", "McpListTools", "McpCall", "Compaction", "Item", "OutputItem", "Usage",
           "ResponseBody", "Event", "ResponseEvent", "ItemEvent", "ItemRef", "PartEvent",
           "TextDelta", "TextDone", "ArgumentsDelta", "FunctionArgumentsDone",
           "McpArgumentsDone", "encode", "json_response"]


class _Shape(msgspec.Struct, kw_only=True):
    """An object of the API (encoded with every field, as OpenAI's are)."""


# ----------------------------------------------------------------------------- items


class InputText(_Shape, tag_field="type", tag="input_text", kw_only=True):
    text: str


class OutputText(_Shape, tag_field="type", tag="output_text", kw_only=True):
    text: str = ""
    annotations: list[Any] = msgspec.field(default_factory=list)
    logprobs: list[Any] = msgspec.field(default_factory=list)


Part = InputText | OutputText


class Message(_Shape, tag_field="type", tag="message", kw_only=True):
    id: str
    role: Literal["user", "system", "developer", "assistant"]
    status: str = "completed"
    content: list[Part] = msgspec.field(default_factory=list)


class FunctionCall(_Shape, tag_field="type", tag="function_call", kw_only=True):
    id: str
    status: str = "completed"
    call_id: str
    name: str
    arguments: str


class FunctionCallOutput(_Shape, tag_field="type", tag="function_call_output", kw_only=True):
    id: str
    status: str = "completed"
    call_id: str
    output: str


class McpToolInfo(_Shape, kw_only=True):
    name: str
    description: str | None = None
    input_schema: Any = None
    annotations: Any = None


class McpListTools(_Shape, tag_field="type", tag="mcp_list_tools", kw_only=True):
    id: str
    server_label: str
    tools: list[McpToolInfo] = msgspec.field(default_factory=list)
    error: str | None = None


class McpCall(_Shape, tag_field="type", tag="mcp_call", kw_only=True):
    id: str
    server_label: str
    name: str
    arguments: str = ""
    output: str | None = None
    error: str | None = None
    status: str = "completed"


class Compaction(_Shape, tag_field="type", tag="compaction", kw_only=True):
    """The output of ``/v1/responses/compact``: ``encrypted_content`` is opaque to the
    client (here: the id of the stored response that holds the compacted context)."""

    id: str
    encrypted_content: str
    created_by: str | None = None


Item = Message | FunctionCall | FunctionCallOutput | McpCall | McpListTools | Compaction
OutputItem = Item  # what a response's ``output`` lists


# -------------------------------------------------------------------------- response


class Usage(_Shape, kw_only=True):
    input_tokens: int
    input_tokens_details: dict[str, int]
    output_tokens: int
    output_tokens_details: dict[str, int]
    total_tokens: int


class ResponseBody(_Shape, kw_only=True):
    """A response object (``object: "response"``); ``completed_at`` appears once it ended."""

    id: str
    object: str = "response"
    created_at: int
    status: str = "in_progress"
    model: str
    output: list[OutputItem] = msgspec.field(default_factory=list)
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: list[Any] = msgspec.field(default_factory=list)
    tool_choice: Any = "auto"
    parallel_tool_calls: bool = True
    max_output_tokens: int | None = None
    max_tool_calls: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    text: dict[str, Any] = msgspec.field(default_factory=lambda: {"format": {"type": "text"}})
    truncation: str = "disabled"
    metadata: dict[str, str] = msgspec.field(default_factory=dict)
    store: bool = True
    background: bool = False
    usage: Usage | None = None
    error: dict[str, Any] | None = None
    incomplete_details: dict[str, Any] | None = None
    reasoning: dict[str, Any] = msgspec.field(
        default_factory=lambda: {"effort": None, "summary": None})
    user: str | None = None
    service_tier: str = "default"
    conversation: dict[str, str] | None = None  # {"id": "conv_..."}: the one it ran in
    completed_at: int | msgspec.UnsetType = msgspec.UNSET


# ---------------------------------------------------------------------------- events


class Event(_Shape, kw_only=True):
    """A stream event: its ``type`` is the SSE ``event:`` name."""

    type: str
    sequence_number: int = 0


class ResponseEvent(Event, kw_only=True):
    """``response.created``, ``.in_progress``, ``.completed``, ``.incomplete``,
    ``.failed``."""

    response: ResponseBody


class ItemEvent(Event, kw_only=True):
    """``response.output_item.added`` and ``.done``."""

    output_index: int
    item: OutputItem


class ItemRef(Event, kw_only=True):
    """An item's progress: ``response.mcp_call.in_progress``/``.completed``/``.failed``,
    ``response.mcp_list_tools.in_progress``/``.completed``."""

    item_id: str
    output_index: int


class PartEvent(ItemRef, kw_only=True):
    """``response.content_part.added`` and ``.done``."""

    content_index: int = 0
    part: OutputText


class TextDelta(ItemRef, kw_only=True):
    """``response.output_text.delta``."""

    content_index: int = 0
    delta: str
    logprobs: list[Any] = msgspec.field(default_factory=list)


class TextDone(ItemRef, kw_only=True):
    """``response.output_text.done``."""

    content_index: int = 0
    text: str
    logprobs: list[Any] = msgspec.field(default_factory=list)


class ArgumentsDelta(ItemRef, kw_only=True):
    """``response.function_call_arguments.delta``, ``response.mcp_call_arguments.delta``."""

    delta: str


class FunctionArgumentsDone(ItemRef, kw_only=True):
    """``response.function_call_arguments.done``."""

    name: str
    arguments: str


class McpArgumentsDone(ItemRef, kw_only=True):
    """``response.mcp_call_arguments.done``."""

    arguments: str


# ---------------------------------------------------------------------------- coding

_encoder = msgspec.json.Encoder()


def encode(value: Any) -> bytes:
    """JSON of an object of this module (or of plain data holding them)."""
    return _encoder.encode(value)


def json_response(value: Any) -> Any:
    """A JSON response (Starlette's) of objects of this module or plain data holding them."""
    from starlette.responses import Response

    return Response(encode(value), media_type="application/json")
