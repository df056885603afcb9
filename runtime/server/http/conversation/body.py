"""Request bodies: reading them, and decoding them into typed msgspec Structs.

Owner: what every API does with a body before it reads a field: :func:`read_body` refuses
one over :data:`MAX_BODY_BYTES` (413) without reading more; :func:`decode` checks it
against its Struct in one pass (types, ranges, lengths, unknown fields) and turns any
failure into an :class:`ApiError` (400) that names the field and says what the field
accepts (the API's ``accepts`` table, one line per field path, indices written ``[]``);
:func:`check_refused` refuses the declared fields a request may not use. The field types
the APIs share (ranges of probabilities, temperatures, seeds, token counts) live here too.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Annotated, Any, Literal, TypeVar

import msgspec

from runtime.server.http.conversation.errors import ApiError

__all__ = ["Body", "COMMON_ACCEPTS", "FormatType", "FunctionFields", "JsonSchemaFields", "OpenAIFields", "MAX_BODY_BYTES", "MAX_STOP", "MAX_TOKENS", "Probability", "Seed",
           "Temperature", "TokenCount", "check_refused", "decode", "decode_body",
           "read_body", "field_range"]

MAX_STOP = 16
MAX_TOKENS = 1 << 20
MAX_BODY_BYTES = 4 << 20

T = TypeVar("T")


def field_range(kind: Any, low: float, high: float) -> Any:
    """``kind`` limited to ``[low, high]`` (checked when the body is decoded)."""
    return Annotated[kind, msgspec.Meta(ge=low, le=high)]


Probability = field_range(float, 0, 1)
Temperature = field_range(float, 0, 2)
TokenCount = field_range(int, 1, MAX_TOKENS)
# OpenAI's prompt_cache_retention: how long the prompt is held in the cache
# (conversation.holds.RETENTION_S).
Retention = Literal["in_memory", "24h"]
Seed = field_range(int, -(1 << 62), 1 << 62)


# What the fields OpenAI's bodies (chat, completions, responses) share accept, by path.
COMMON_ACCEPTS: dict[str, str] = {
    "model": "a string, the model's id (GET /v1/models lists it)",
    "temperature": "a number from 0 to 2 (0 = greedy), or null for the default 1",
    "top_p": "a number from 0 to 1, or null",
    "seed": "an integer, or null",
    "max_tokens": f"an integer from 1 to {MAX_TOKENS}, or null",
    "stream": "true or false",
    "parallel_tool_calls": "true or false",
    "user": "a string", "service_tier": "a string", "safety_identifier": "a string",
    "prompt_cache_key": "a string", "store": "true or false",
    "prompt_cache_retention": '"in_memory" or "24h", or null',
    "metadata": "an object whose values are strings, or null",
}


class Body(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, omit_defaults=True):
    """A part of a request: unknown fields are refused."""


class OpenAIFields(Body, kw_only=True):
    """The fields every OpenAI-shaped body (chat, completions, responses) has; an optional
    one may be null: it then takes its default (OpenAI's)."""

    model: str
    temperature: Temperature | None = None
    top_p: Probability | None = None
    seed: Seed | None = None  # pie-ctx's (and vLLM's) extension on responses
    stream: bool | None = None
    ignore_eos: bool | None = None  # an extension: the text ends at its budget
    user: str | None = None  # ignored


class FunctionFields(Body, kw_only=True):
    """A function tool's declaration, as OpenAI's bodies spell it."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # every call is generated under its schema anyway


FormatType = Literal["text", "json_object", "json_schema"]


class JsonSchemaFields(Body, kw_only=True):
    """A JSON Schema output format, as OpenAI's bodies spell it."""

    name: str | None = None
    description: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None


# field -> (is it used in this request?, why it is refused, if more is to be said)
Refused = Mapping[str, tuple[Callable[[Any], bool], str]]


def check_refused(request: Any, refused: Refused) -> None:
    """Refuse the first field of ``refused`` the request uses.

    Raises:
        ApiError: 400 naming the field (``unsupported_parameter``).
    """
    for name, (used, why) in refused.items():
        if hasattr(request, name) and used(getattr(request, name)):
            raise ApiError(400, f"'{name}' is not supported by this server"
                                + (f": {why}" if why else ""),
                           param=name, code="unsupported_parameter")


async def read_body(request: Any) -> bytes:
    """A request's body, refused past :data:`MAX_BODY_BYTES` (413) without reading more."""
    raw = b""
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > MAX_BODY_BYTES:
            raise ApiError(413, f"the request body is over {MAX_BODY_BYTES} bytes")
    return raw


async def decode_body(request: Any, kind: type[T], accepts: Mapping[str, str],
                      shape: str | None = None) -> T:
    """:func:`decode` of a request's body."""
    return decode(await read_body(request), kind, accepts, shape)


def decode(raw: bytes, kind: type[T], accepts: Mapping[str, str],
           shape: str | None = None) -> T:
    """``raw`` decoded as ``kind`` (a request Struct); ``accepts`` says what each field
    takes, ``shape`` what a whole body looks like (for a body that is not an object).

    Raises:
        ApiError: 400 naming the first field that is wrong or unknown.
    """
    try:
        return msgspec.json.decode(raw, type=kind)
    except msgspec.ValidationError as err:
        raise _invalid(str(err), accepts, shape) from None
    except (msgspec.DecodeError, RecursionError):
        raise ApiError(400, "the request body is not valid JSON") from None


_AT = re.compile(r"^(.*?) - at `\$(.*)`$", re.S)
_FIELD = re.compile(r"field `([^`]+)`")
_GOT_TYPE = re.compile(r"got `(\w+)`")
_GOT_VALUE = re.compile(r"Invalid (?:enum )?value (.+)$")
_JSON_TYPES = {"str": "a string", "int": "an integer", "float": "a number", "bool": "a boolean",
               "null": "null", "array": "an array", "object": "an object"}


def _invalid(text: str, accepts: Mapping[str, str], shape: str | None) -> ApiError:
    """The 400 of a msgspec validation message (``... - at `$.path` ``): it names the
    field and says what the field accepts."""
    m = _AT.match(text)
    what, path = (m.group(1), m.group(2).lstrip(".")) if m else (text, "")
    field = _FIELD.search(what)
    name = field.group(1) if field else None
    if not path and what.startswith("Expected `object`"):
        return ApiError(400, "the request body must be a JSON object"
                        + (f": {shape}" if shape else ""))
    if name and "unknown field" in what:
        if not path:
            return ApiError(400, f"Unrecognized request argument supplied: {name}",
                            param=name, code="unsupported_parameter")
        where, described = _described(path, accepts)
        return ApiError(400, f"'{path}' has an unknown field '{name}': '{where}' must be "
                             f"{described}", param=_top(path))
    if name and "missing" in what:
        child = f"{path}.{name}" if path else name
        where, described = _described(child, accepts)
        return ApiError(400, f"'{child}' is required" + (
            f": {described}" if where == child else f": '{where}' must be {described}"),
            param=_top(child))
    where, described = _described(path, accepts)
    got = _GOT_TYPE.search(what) or _GOT_VALUE.search(what)
    if got is None:
        detail = ""  # a range or length: what it accepts says it
    elif got.re is _GOT_TYPE:
        detail = f", not {_JSON_TYPES.get(got.group(1), got.group(1))}"
    else:
        detail = f", not {got.group(1)}"
    if not described:
        return ApiError(400, f"'{path}': {what}", param=_top(path) or None)
    if where == path:
        return ApiError(400, f"'{path}' must be {described}{detail}", param=_top(path))
    return ApiError(400, f"'{path}': {what}; '{where}' must be {described}", param=_top(path))


def _top(path: str) -> str:
    return re.split(r"[.\[]", path, maxsplit=1)[0]


def _described(path: str, accepts: Mapping[str, str]) -> tuple[str, str]:
    """The nearest field at or above ``path`` that ``accepts`` describes: its path as
    written, and what it accepts (``("", "")`` for none)."""
    parts = re.findall(r"\.?([^.\[]+)|(\[[^\]]*\])", path)
    prefixes, written, key = [], "", ""
    for name, index in parts:
        written += f"[{index[1:-1]}]" if index else (f".{name}" if written else name)
        key += "[]" if index else (f".{name}" if key else name)
        prefixes.append((written, key))
    for written, key in reversed(prefixes):
        if key in accepts:
            return written, accepts[key]
    return "", ""
