"""OpenAI's request bodies as typed msgspec Structs, and the error the API answers with.

Owner: the shape of a request to ``/v1/chat/completions`` and ``/v1/completions``.
:func:`decode` checks a body against its Struct in one pass (types, ranges, lengths,
unknown fields) and turns any failure into an :class:`ApiError` (400) that names the field;
the handlers (``openai_api``) then read typed attributes and check only what the schema
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

import re
from typing import Annotated, Any, Literal, TypeVar

import msgspec

__all__ = ["ApiError", "error_response", "error_body", "decode", "ChatRequest",
           "CompletionRequest", "ContentPart", "Message", "AssistantMessage", "ToolMessage",
           "ToolSpec", "NamedToolChoice", "ResponseFormat", "IGNORED", "REFUSED"]

MAX_N = 16
MAX_STOP = 16
MAX_TOKENS = 1 << 20
MAX_LOGIT_BIAS = 1024

T = TypeVar("T")


class ApiError(Exception):
    """A request the API refuses, with OpenAI's error fields."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, type: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = (
            status, message, param, code, type)


def error_body(err: ApiError) -> dict[str, Any]:
    """OpenAI's error body ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": err.message, "type": err.type, "param": err.param,
                      "code": err.code}}


def error_response(status: int, message: str, type: str, param: str | None = None,
                   code: str | None = None) -> Any:
    """OpenAI's error body with ``status``."""
    from starlette.responses import JSONResponse

    return JSONResponse(error_body(ApiError(status, message, param=param, code=code,
                                            type=type)), status_code=status)


# --------------------------------------------------------------------------- types


def _range(kind: Any, low: float, high: float) -> Any:
    return Annotated[kind, msgspec.Meta(ge=low, le=high)]


Probability = _range(float, 0, 1)
Temperature = _range(float, 0, 2)
Penalty = _range(float, -2, 2)
Choices = _range(int, 1, MAX_N)
TokenCount = _range(int, 1, MAX_TOKENS)
MinTokens = _range(int, 0, MAX_TOKENS)
TopK = _range(int, -1, MAX_TOKENS)
TopLogprobs = _range(int, 0, 20)
CompletionLogprobs = _range(int, 0, 5)
Seed = _range(int, -(1 << 62), 1 << 62)
StopString = Annotated[str, msgspec.Meta(min_length=1)]
Stop = StopString | Annotated[list[StopString], msgspec.Meta(max_length=MAX_STOP)]
LogitBias = Annotated[dict[str, _range(float, -100, 100)],
                      msgspec.Meta(max_length=MAX_LOGIT_BIAS)]


class _Body(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, omit_defaults=True):
    """A part of a request: unknown fields are refused."""


class ContentPart(msgspec.Struct, kw_only=True):
    """One part of a message's content; only ``{"type": "text", "text": ...}`` is served
    (the handler refuses the others by their type, so their fields are not checked)."""

    type: str
    text: str | None = None


Content = str | list[ContentPart]


class SystemMessage(_Body, kw_only=True, tag_field="role", tag="system"):
    content: Content
    name: str | None = None  # ignored


class DeveloperMessage(_Body, kw_only=True, tag_field="role", tag="developer"):
    content: Content
    name: str | None = None  # ignored


class UserMessage(_Body, kw_only=True, tag_field="role", tag="user"):
    content: Content
    name: str | None = None  # ignored


class FunctionCall(_Body, kw_only=True):
    name: str
    arguments: str | dict[str, Any]  # OpenAI sends a JSON string; an object is taken too


class ToolCallIn(_Body, kw_only=True):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(_Body, kw_only=True, tag_field="role", tag="assistant"):
    content: Content | None = None
    tool_calls: list[ToolCallIn] | None = None
    name: str | None = None  # ignored
    refusal: str | None = None  # ignored (what a response's message carries back)
    annotations: list[Any] | None = None  # ignored (likewise)
    audio: Any = None  # refused unless null
    function_call: Any = None  # refused unless null


class ToolMessage(_Body, kw_only=True, tag_field="role", tag="tool"):
    content: Content
    tool_call_id: str
    name: str | None = None  # ignored


class FunctionMessage(_Body, kw_only=True, tag_field="role", tag="function"):
    """The deprecated function role: declared so that it is refused by name."""

    content: Any = None
    name: Any = None


Message = (SystemMessage | DeveloperMessage | UserMessage | AssistantMessage | ToolMessage
           | FunctionMessage)


class FunctionSpec(_Body, kw_only=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # every call is constrained to its schema anyway


class ToolSpec(_Body, kw_only=True):
    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(_Body, kw_only=True):
    name: str


class NamedToolChoice(_Body, kw_only=True):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(_Body, kw_only=True):
    name: str | None = None
    description: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None


class ResponseFormat(_Body, kw_only=True):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StreamOptions(_Body, kw_only=True):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None  # ignored: nothing is obfuscated


class _Request(_Body, kw_only=True):
    """The fields both endpoints share, with pie-ctx's extensions. An optional field may be
    null: it then takes its default (OpenAI's)."""

    model: str
    n: Choices | None = None
    temperature: Temperature | None = None
    top_p: Probability | None = None
    seed: Seed | None = None
    stop: Stop | None = None
    max_tokens: TokenCount | None = None
    presence_penalty: Penalty | None = None  # refused unless 0
    frequency_penalty: Penalty | None = None  # refused unless 0
    logit_bias: LogitBias | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None  # ignored
    # extensions (vLLM has the same names)
    top_k: TopK | None = None  # 0 or -1: off
    min_p: Probability | None = None
    min_tokens: MinTokens | None = None
    ignore_eos: bool | None = None
    snapshot: str | None = None  # start from this saved snapshot (Context.open)


class ChatRequest(_Request, kw_only=True):
    messages: Annotated[list[Message], msgspec.Meta(min_length=1)]
    max_completion_tokens: TokenCount | None = None
    logprobs: bool | None = None
    top_logprobs: TopLogprobs | None = None
    response_format: ResponseFormat | None = None
    tools: list[ToolSpec] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # ignored
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
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
           "messages[].name", "messages[].refusal", "messages[].annotations")

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
}


# --------------------------------------------------------------------------- decode


_AT = re.compile(r"^(.*?) - at `\$(.*)`$", re.S)
_FIELD = re.compile(r"field `([^`]+)`")


def decode(raw: bytes, kind: type[T]) -> T:
    """``raw`` decoded as ``kind`` (a request Struct), with the refused fields checked.

    Raises:
        ApiError: 400 naming the first field that is wrong, unknown or refused.
    """
    try:
        request = msgspec.json.decode(raw, type=kind)
    except msgspec.ValidationError as err:
        raise _invalid(str(err)) from None
    except (msgspec.DecodeError, RecursionError):
        raise ApiError(400, "the request body is not valid JSON") from None
    for name, (used, why) in REFUSED.items():
        if hasattr(request, name) and used(getattr(request, name)):
            raise ApiError(400, f"'{name}' is not supported by this server"
                                + (f": {why}" if why else ""),
                           param=name, code="unsupported_parameter")
    for i, m in enumerate(getattr(request, "messages", ())):
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


def _invalid(text: str) -> ApiError:
    """The 400 of a msgspec validation message (``... - at `$.path` ``)."""
    m = _AT.match(text)
    what, path = (m.group(1), m.group(2).lstrip(".")) if m else (text, "")
    field = _FIELD.search(what)
    if not path:
        if what.startswith("Expected `object`"):
            return ApiError(400, "the request body must be a JSON object")
        name = field.group(1) if field else None
        if "unknown field" in what and name:
            return ApiError(400, f"Unrecognized request argument supplied: {name}", param=name,
                            code="unsupported_parameter")
        return ApiError(400, f"'{name}' is required" if name and "missing" in what
                        else what, param=name)
    param = re.split(r"[.\[]", path, maxsplit=1)[0]
    return ApiError(400, f"'{path}': {what}", param=param)
