"""OpenAI's request bodies as typed msgspec Structs, and what each field accepts.

Owner: the shape of a request to ``/v1/chat/completions`` and ``/v1/completions``.
:func:`decode` checks a body against its Struct in one pass (types, ranges, lengths,
unknown fields) and turns any failure into an :class:`ApiError` (400) that names the field
and says what it accepts (:data:`ACCEPTS`, one line per field);
the handlers (``openai.api``) then read typed attributes and check only what the schema
cannot say (one field against another).

Three kinds of field, listed in docs/http.md:

* supported: declared with their types and ranges;
* ignored (:data:`IGNORED`): accepted and dropped, because they change nothing about the
  output (``user``, ``metadata``, ``store``...);
* refused (:data:`REFUSED`): they would change what the answer means and this server does
  not implement them (``functions``, ``audio``, ``prediction``...): declared so that the
  400 names them instead of a silently different answer.

A field nobody declared is refused as OpenAI does ("Unrecognized request argument").
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

import msgspec

from runtime.server.http.conversation.body import (
    COMMON_ACCEPTS,
    MAX_BODY_BYTES,
    MAX_STOP,
    MAX_TOKENS,
    Body,
    FormatType,
    FunctionFields,
    JsonSchemaFields,
    OpenAIFields,
    Probability,
    Retention,
    TokenCount,
    check_refused,
    field_range,
    read_body,
)
from runtime.server.http.conversation.body import (
    decode as decode_struct,
)
from runtime.server.http.conversation.errors import ApiError, error_body, error_response

__all__ = ["ApiError", "error_response", "error_body", "decode", "decode_body", "read_body",
           "MAX_BODY_BYTES", "ChatRequest",
           "CompletionRequest", "ContentPart", "Message", "AssistantMessage", "ToolMessage",
           "ToolSpec", "NamedToolChoice", "ResponseFormat", "StructuredOutputs", "IGNORED",
           "REFUSED", "ACCEPTS", "COMPLETION_ACCEPTS"]

MAX_N = 16
MAX_LOGIT_BIAS = 1024

T = TypeVar("T")


# --------------------------------------------------------------------------- types


_range = field_range
Penalty = _range(float, -2, 2)
Choices = _range(int, 1, MAX_N)
MinTokens = _range(int, 0, MAX_TOKENS)
TopK = _range(int, -1, MAX_TOKENS)
TopLogprobs = _range(int, 0, 20)
CompletionLogprobs = _range(int, 0, 5)
StopString = Annotated[str, msgspec.Meta(min_length=1)]
Stop = StopString | Annotated[list[StopString], msgspec.Meta(max_length=MAX_STOP)]
LogitBias = Annotated[dict[str, _range(float, -100, 100)],
                      msgspec.Meta(max_length=MAX_LOGIT_BIAS)]


class ContentPart(msgspec.Struct, kw_only=True):
    """One part of a message's content; only ``{"type": "text", "text": ...}`` is served
    (the handler refuses the others by their type, so their fields are not checked)."""

    type: str
    text: str | None = None


Content = str | list[ContentPart]


class SystemMessage(Body, kw_only=True, tag_field="role", tag="system"):
    content: Content
    name: str | None = None  # ignored


class DeveloperMessage(Body, kw_only=True, tag_field="role", tag="developer"):
    content: Content
    name: str | None = None  # ignored


class UserMessage(Body, kw_only=True, tag_field="role", tag="user"):
    content: Content
    name: str | None = None  # ignored


class FunctionCall(Body, kw_only=True):
    name: str
    arguments: str | dict[str, Any]  # OpenAI sends a JSON string; an object is taken too


class ToolCallIn(Body, kw_only=True):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(Body, kw_only=True, tag_field="role", tag="assistant"):
    content: Content | None = None
    tool_calls: list[ToolCallIn] | None = None
    name: str | None = None  # ignored
    refusal: str | None = None  # ignored (what a response's message carries back)
    annotations: list[Any] | None = None  # ignored (likewise)
    # ignored, as vLLM ignores them: a reasoning model's thinking stays out of the prompt
    reasoning_content: str | None = None
    reasoning: str | None = None
    audio: Any = None  # refused unless null
    function_call: Any = None  # refused unless null


class ToolMessage(Body, kw_only=True, tag_field="role", tag="tool"):
    content: Content
    tool_call_id: str
    name: str | None = None  # ignored


class FunctionMessage(Body, kw_only=True, tag_field="role", tag="function"):
    """The deprecated function role: declared so that it is refused by name."""

    content: Any = None
    name: Any = None


Message = (SystemMessage | DeveloperMessage | UserMessage | AssistantMessage | ToolMessage
           | FunctionMessage)


FunctionSpec = FunctionFields


class ToolSpec(Body, kw_only=True):
    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(Body, kw_only=True):
    name: str


class NamedToolChoice(Body, kw_only=True):
    type: Literal["function"]
    function: NamedFunction


class ResponseFormat(Body, kw_only=True):
    type: FormatType
    json_schema: JsonSchemaFields | None = None


class StreamOptions(Body, kw_only=True):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None  # ignored: nothing is obfuscated


class StructuredOutputs(Body, kw_only=True):
    """vLLM's ``structured_outputs``: one constraint of the generation."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_fallback: bool | None = None  # ignored: there is one grammar library
    disable_any_whitespace: bool | None = None  # ignored: JSON is always written on one line
    disable_additional_properties: bool | None = None  # ignored
    whitespace_pattern: str | None = None  # refused unless null


class _Request(OpenAIFields, kw_only=True):
    """The fields both endpoints share, with pie-ctx's extensions."""

    n: Choices | None = None
    stop: Stop | None = None
    prompt_cache_retention: Retention | None = None  # holds the prompt (holds.py)
    max_tokens: TokenCount | None = None
    presence_penalty: Penalty | None = None  # refused unless 0
    frequency_penalty: Penalty | None = None  # refused unless 0
    logit_bias: LogitBias | None = None
    stream_options: StreamOptions | None = None
    # extensions (vLLM has the same names)
    top_k: TopK | None = None  # 0 or -1: off
    min_p: Probability | None = None
    min_tokens: MinTokens | None = None
    snapshot: str | None = None  # start from this saved snapshot (Context.open)
    # vLLM's extensions (docs/http.md, "vLLM's extension fields")
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], msgspec.Meta(min_length=1)] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputs | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None  # the matched stop string ends the text
    repetition_penalty: Annotated[float, msgspec.Meta(gt=0, le=10)] | None = None  # only 1
    guided_decoding_backend: str | None = None  # ignored: llguidance is the one backend


class ChatRequest(_Request, kw_only=True):
    messages: Annotated[list[Message], msgspec.Meta(min_length=1)]
    max_completion_tokens: TokenCount | None = None
    logprobs: bool | None = None
    top_logprobs: TopLogprobs | None = None
    response_format: ResponseFormat | None = None
    tools: list[ToolSpec] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's extensions: the conversation rendered by the template itself
    chat_template_kwargs: dict[str, Any] | None = None
    continue_final_message: bool | None = None
    add_generation_prompt: bool | None = None
    # ignored
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None  # routes in the fleet (runtime.fleet.sessions)
    # refused unless null (modalities: unless ["text"])
    audio: Any = None
    function_call: Any = None
    functions: Any = None
    modalities: list[str] | None = None
    prediction: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    web_search_options: Any = None


class CompletionRequest(_Request, kw_only=True):
    prompt: str | list[Any]
    logprobs: CompletionLogprobs | None = None
    echo: bool | None = None  # refused when true
    suffix: str | None = None  # refused unless empty
    best_of: int | None = None  # refused unless 1


IGNORED = ("user", "metadata", "store", "service_tier", "safety_identifier",
           "prompt_cache_key", "stream_options.include_obfuscation", "tools[].function.strict",
           "messages[].name", "messages[].refusal", "messages[].annotations",
           "guided_decoding_backend", "structured_outputs.disable_fallback",
           "structured_outputs.disable_any_whitespace",
           "structured_outputs.disable_additional_properties")

# field -> (is it used in this request?, why it is refused, if more is to be said)
REFUSED: dict[str, tuple[Any, str]] = {
    "audio": (lambda v: v is not None, "audio output is not supported"),
    "function_call": (lambda v: v is not None,
                      "the deprecated 'function_call' is not supported: use 'tool_choice'"),
    "functions": (lambda v: v is not None,
                  "the deprecated 'functions' is not supported: use 'tools'"),
    "modalities": (lambda v: v is not None and v != ["text"], "only the text modality is "
                                                              "supported"),
    "prediction": (lambda v: v is not None, "predicted outputs are not supported"),
    "reasoning_effort": (lambda v: v is not None, "this model does not reason"),
    "verbosity": (lambda v: v is not None, ""),
    "web_search_options": (lambda v: v is not None, "web search is not supported"),
    "presence_penalty": (lambda v: v not in (None, 0), "only 0 is supported (not "
                                                          "implemented)"),
    "frequency_penalty": (lambda v: v not in (None, 0), "only 0 is supported (not "
                                                           "implemented)"),
    "echo": (lambda v: bool(v), ""),
    "suffix": (lambda v: bool(v), ""),
    "best_of": (lambda v: v not in (None, 1), "only best_of 1 is supported (use n)"),
    "repetition_penalty": (lambda v: v not in (None, 1), "only 1 is supported: the sampler "
                                                         "sees a row of logits, not the "
                                                         "tokens before it"),
}


# --------------------------------------------------------------------------- accepts


_TEXT_PART = '{"type": "text", "text": "..."}'
_TOOL_CALL = '{"id": "...", "type": "function", "function": {"name": "...", "arguments": "{...}"}}'
_TOOL = ('{"type": "function", "function": {"name": "...", "description": "...", '
         '"parameters": {JSON Schema}}}')
_TOOL_CHOICE = ('"auto", "none", "required" or {"type": "function", "function": {"name": '
                '"..."}}')
_RESPONSE_FORMAT = ('{"type": "text"}, {"type": "json_object"} or {"type": "json_schema", '
                    '"json_schema": {"name": "...", "schema": {JSON Schema}}}')

# What each field accepts, by its path with indices as ``[]``: every 400 of ``decode``
# names the field and says this (a field not listed: its nearest listed parent's).
ACCEPTS: dict[str, str] = {
    **COMMON_ACCEPTS,
    "n": f"an integer from 1 to {MAX_N} (choices to generate), or null",
    "min_p": "a number from 0 to 1, or null",
    "top_k": "an integer >= -1 (0 or -1 = no limit), or null",
    "stop": f"a non-empty string or a list of up to {MAX_STOP} of them, or null",
    "stop[]": "a non-empty string",
    "max_completion_tokens": f"an integer from 1 to {MAX_TOKENS}, or null",
    "min_tokens": f"an integer from 0 to {MAX_TOKENS}, or null",
    "presence_penalty": "a number from -2 to 2 (only 0 is served), or null",
    "frequency_penalty": "a number from -2 to 2 (only 0 is served), or null",
    "logit_bias": ("an object mapping token ids (as strings) to numbers from -100 to 100, "
                   f"at most {MAX_LOGIT_BIAS} of them, or null"),
    "logit_bias[]": "a number from -100 to 100",
    "echo": "true or false", "ignore_eos": "true or false",
    "stream_options": '{"include_usage": true or false}, or null',
    "stream_options.include_usage": "true or false, or null",
    "metadata[]": "a string",
    "modalities": '["text"], or null',
    "modalities[]": '"text"',
    "snapshot": "the name of a saved snapshot (a string), or null",
    "messages": ('a non-empty list of messages, each {"role": "system", "developer", "user", '
                 '"assistant" or "tool", "content": ...}'),
    "messages[]": ('a message: {"role": "system", "developer", "user", "assistant" or "tool", '
                   '"content": ...}'),
    "messages[].role": '"system", "developer", "user", "assistant" or "tool"',
    "messages[].content": (f"a string or a list of text parts ({_TEXT_PART}) (an assistant "
                           f"message with tool_calls may have null)"),
    "messages[].content[]": f"a text part {_TEXT_PART}",
    "messages[].name": "a string",
    "messages[].tool_calls": f"a list of tool calls, each {_TOOL_CALL}, or null",
    "messages[].tool_calls[]": f"a tool call {_TOOL_CALL}",
    "messages[].tool_calls[].type": '"function"',
    "messages[].tool_calls[].function": '{"name": "...", "arguments": "{...}"}',
    "messages[].tool_calls[].function.arguments": "a JSON object, or a string holding one",
    "messages[].tool_call_id": "a string, the id of the tool call this message answers",
    "logprobs": "true or false, or null",
    "top_logprobs": "an integer from 0 to 20 (needs logprobs: true), or null",
    "response_format": f"{_RESPONSE_FORMAT}, or null",
    "response_format.type": '"text", "json_object" or "json_schema"',
    "response_format.json_schema": '{"name": "...", "schema": {JSON Schema}, "strict": true}',
    "response_format.json_schema.schema": "a JSON Schema (an object)",
    "tools": f"a list of tools, each {_TOOL}, or null",
    "tools[]": f"a tool {_TOOL}",
    "tools[].type": '"function"',
    "tools[].function": '{"name": "...", "description": "...", "parameters": {JSON Schema}}',
    "tools[].function.parameters": "a JSON Schema (an object), or null",
    "tool_choice": f"{_TOOL_CHOICE}, or null",
    "tool_choice.type": '"function"',
    "tool_choice.function": '{"name": "..."} naming one of the tools',
    "guided_json": "a JSON Schema (an object, or its JSON text), or null",
    "guided_regex": "a regular expression (a string), or null",
    "guided_choice": "a non-empty list of strings, or null",
    "guided_grammar": "a grammar in llama.cpp's GBNF (a string), or null",
    "guided_decoding_backend": "a string (ignored)",
    "structured_outputs": ('{"json": {JSON Schema}} or {"regex": "..."} or {"choice": '
                           '[...]} or {"grammar": "..."} or {"json_object": true}, or null'),
    "structured_outputs.json": "a JSON Schema (an object, or its JSON text), or null",
    "structured_outputs.regex": "a regular expression (a string), or null",
    "structured_outputs.choice": "a list of strings, or null",
    "structured_outputs.grammar": "a grammar in llama.cpp's GBNF (a string), or null",
    "structured_outputs.json_object": "true or false, or null",
    "skip_special_tokens": "true or false, or null",
    "include_stop_str_in_output": "true or false, or null",
    "repetition_penalty": "a number above 0, at most 10 (only 1 is served), or null",
    "chat_template_kwargs": "an object of extra variables for the chat template, or null",
    "continue_final_message": "true or false, or null",
    "add_generation_prompt": "true or false, or null",
}
# The completions endpoint's own meanings of shared names.
COMPLETION_ACCEPTS: dict[str, str] = {
    **ACCEPTS,
    "prompt": "a string, a list of strings, a list of token ids or a list of lists of them",
    "logprobs": "an integer from 0 to 5, or null",
    "suffix": "a string (only empty is served), or null",
    "best_of": "an integer (only 1 is served), or null",
}


async def decode_body(request: Any, kind: type[T], accepts: dict[str, str] | None = None
                      ) -> T:
    """:func:`decode` of a request's body."""
    return decode(await read_body(request), kind, accepts)


def decode(raw: bytes, kind: type[T], accepts: dict[str, str] | None = None) -> T:
    """``raw`` decoded as ``kind`` (a request Struct), with the refused fields checked;
    ``accepts`` says what each field takes (default: the chat's or the completion's).

    Raises:
        ApiError: 400 naming the first field that is wrong, unknown or refused.
    """
    if accepts is None:
        accepts = COMPLETION_ACCEPTS if kind is CompletionRequest else ACCEPTS
    request = decode_struct(raw, kind, accepts, _SHAPES.get(kind))
    check_refused(request, REFUSED)
    for i, m in enumerate(getattr(request, "messages", None) or ()):
        if isinstance(m, FunctionMessage):
            raise ApiError(400, f"messages[{i}]: the deprecated 'function' role is not "
                                f"supported: use 'tool' messages", param="messages",
                           code="unsupported_parameter")
        if isinstance(m, AssistantMessage):
            for name in ("audio", "function_call"):
                if getattr(m, name) is not None:
                    raise ApiError(400, f"messages[{i}].{name} is not supported by this "
                                        f"server", param="messages",
                                   code="unsupported_parameter")
    return request


_SHAPES: dict[type, str] = {ChatRequest: '{"model": ..., "messages": [...], ...}',
                            CompletionRequest: '{"model": ..., "prompt": ..., ...}'}
