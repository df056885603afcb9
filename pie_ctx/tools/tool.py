"""``Tool`` and ``ToolCall``: what a model may call, and a call it made.

Owns nothing at run time: a ``Tool`` is an immutable description (a name, a description,
a JSON Schema of its parameters) plus, optionally, the Python function that runs it. The
chat formats (``pie_ctx.tools.formats``) put tools into prompts and turn a model's output
back into ``ToolCall`` values; the engine only ever sees the grammar built from them.

Usage::

    from pie_ctx.tools import Tool

    async def get_weather(city: str, unit: Literal["celsius", "fahrenheit"] = "celsius") -> str:
        \"\"\"Current weather in a city.

        Args:
            city: the city's name, e.g. "Paris".
            unit: the temperature unit.
        \"\"\"
        ...

    weather = Tool.from_function(get_weather)   # name, description, parameters from the code
    result = await weather.run({"city": "Paris"})  # always a str: the tool turn's content
"""

from __future__ import annotations

import enum
import inspect
import json
import re
import secrets
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pie_ctx.proto.errors import InvalidArgument

__all__ = ["Tool", "ToolCall", "new_call_id"]

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_SECTION = re.compile(r"^\s*(Args|Arguments|Parameters|Params|Returns|Return|Yields|Raises|"
                      r"Examples?|Notes?|Usage)\s*:\s*$")
_PARAM_LINE = re.compile(r"^\s*(\*{0,2}\w+)\s*(\([^)]*\))?\s*:\s*(.*)$")


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One call the model made: run ``name`` with ``arguments``, then answer it with
    ``ctx.tool_result(call.id, content)``.

    Attributes:
        id: a unique id for this call (``call_`` + hex), which the tool's result names.
        name: the tool's name.
        arguments: the arguments, parsed from the model's JSON (valid for the tool's
            schema whenever the call was generated under a constraint).
    """

    id: str
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)

    def to_openai(self) -> dict[str, Any]:
        """OpenAI's ``tool_calls`` entry (``arguments`` as a JSON string)."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.name,
                             "arguments": json.dumps(self.arguments, ensure_ascii=False)}}


def new_call_id() -> str:
    """A fresh tool-call id, in OpenAI's shape."""
    return "call_" + secrets.token_hex(12)


@dataclass(frozen=True, slots=True)
class Tool:
    """A tool the model may call.

    Args:
        name: 1-64 characters from ``A-Z a-z 0-9 _ -`` (OpenAI's rule).
        description: what the tool does, for the model.
        parameters: a JSON Schema of the arguments object (``{"type": "object",
            "properties": {...}, "required": [...]}``); ``{}`` or None for no arguments.
        fn: the Python function (sync or async) that runs it, if any: ``run()`` calls it
            with the arguments as keywords. Tools from MCP servers carry their own runner.

    Raises:
        InvalidArgument: a bad name, or parameters that are not a JSON object schema.
    """

    name: str
    description: str = ""
    parameters: dict[str, Any] = field(default_factory=dict)
    fn: Callable[..., Any] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.fullmatch(self.name):
            raise InvalidArgument(f"a tool name is 1-64 characters from A-Z a-z 0-9 _ -, "
                                  f"got {self.name!r}")
        if not isinstance(self.description, str):
            raise InvalidArgument(f"tool {self.name}: description must be a str")
        params = {"type": "object", "properties": {}} if not self.parameters \
            else self.parameters
        if not isinstance(params, dict) or params.get("type", "object") != "object":
            raise InvalidArgument(f"tool {self.name}: parameters must be a JSON Schema of an "
                                  f"object (type 'object'), got {self.parameters!r}")
        try:
            json.dumps(params)
        except (TypeError, ValueError) as err:
            raise InvalidArgument(f"tool {self.name}: parameters are not JSON: {err}") from None
        object.__setattr__(self, "parameters", params)
        if self.fn is not None and not callable(self.fn):
            raise InvalidArgument(f"tool {self.name}: fn must be callable")

    # ------------------------------------------------------------------ constructors

    @classmethod
    def from_function(cls, fn: Callable[..., Any], *, name: str | None = None,
                      description: str | None = None) -> Tool:
        """A tool built from a typed Python function and its docstring.

        The name is the function's; the description is the docstring up to its first
        section (``Args:``, ``Returns:``...); each parameter's schema comes from its type
        hint (str, int, float, bool, None, list[...], tuple[...], dict[str, ...],
        ``Literal[...]``, an ``Enum``, unions and ``X | None``, ``Annotated[X, "text"]``)
        and its description from the ``Args:`` section. A parameter without a default is
        required, and no other key is allowed.

        Raises:
            InvalidArgument: ``*args``/``**kwargs``, or a type hint with no JSON Schema.
        """
        if not callable(fn):
            raise InvalidArgument(f"Tool.from_function takes a function, got {fn!r}")
        doc = inspect.getdoc(fn) or ""
        summary, arg_docs = _parse_docstring(doc)
        try:
            hints = typing.get_type_hints(fn, include_extras=True)
        except Exception as err:  # unresolvable forward references and the like
            raise InvalidArgument(f"Tool.from_function({getattr(fn, '__name__', fn)!r}): "
                                  f"cannot read its type hints: {err}") from None
        properties: dict[str, Any] = {}
        required: list[str] = []
        for p in inspect.signature(fn).parameters.values():
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                raise InvalidArgument(f"tool function {fn.__name__}: *args and **kwargs "
                                      f"have no JSON Schema; name every parameter")
            schema = _schema(hints.get(p.name, Any), f"{fn.__name__}({p.name})")
            if p.name in arg_docs and "description" not in schema:
                schema = {**schema, "description": arg_docs[p.name]}
            if p.default is p.empty:
                required.append(p.name)
            elif _jsonable(p.default):
                schema = {**schema, "default": p.default}
            properties[p.name] = schema
        # Exactly the function's parameters: an extra key could not be passed to it.
        params: dict[str, Any] = {"type": "object", "properties": properties,
                                  "additionalProperties": False}
        if required:
            params["required"] = required
        return cls(name=name or fn.__name__, description=summary if description is None
                   else description, parameters=params, fn=fn)

    @classmethod
    def from_openai(cls, spec: Mapping[str, Any]) -> Tool:
        """A tool from OpenAI's ``{"type": "function", "function": {...}}`` (or the inner
        ``function`` object).

        Raises:
            InvalidArgument: not of that shape.
        """
        inner = spec.get("function", spec) if isinstance(spec, Mapping) else None
        if not isinstance(inner, Mapping) or not isinstance(inner.get("name"), str):
            raise InvalidArgument("a tool is {'type': 'function', 'function': {'name': ..., "
                                  "'description': ..., 'parameters': {...}}}")
        return cls(name=inner["name"], description=inner.get("description") or "",
                   parameters=dict(inner.get("parameters") or {}))

    # ---------------------------------------------------------------------- views

    def to_openai(self) -> dict[str, Any]:
        """OpenAI's tool entry; also what chat templates receive as ``tools``."""
        return {"type": "function", "function": {"name": self.name,
                                                 "description": self.description,
                                                 "parameters": self.parameters}}

    # ------------------------------------------------------------------------ run

    async def run(self, arguments: Mapping[str, Any] | None = None) -> str:
        """Run the tool's function with ``arguments`` as keywords; return its result as the
        text of the tool turn (a str as it is, anything else as JSON).

        A sync function runs in a worker thread, so a slow tool never blocks the event
        loop (and the other agents on it).

        Raises:
            InvalidArgument: the tool has no function, or the arguments do not fit it.
        """
        if self.fn is None:
            raise InvalidArgument(f"tool {self.name} has no function to run; answer its "
                                  f"calls yourself with ctx.tool_result(call.id, text)")
        args = dict(arguments or {})
        try:
            inspect.signature(self.fn).bind(**args)
        except TypeError as err:
            raise InvalidArgument(f"tool {self.name}: the arguments do not fit the "
                                  f"function: {err}") from None
        if inspect.iscoroutinefunction(self.fn):
            result = await self.fn(**args)
        else:
            import anyio

            result = await anyio.to_thread.run_sync(lambda: self.fn(**args))
            if inspect.isawaitable(result):
                result = await result
        return result_text(result)


def result_text(result: Any) -> str:
    """What a tool's return value becomes in the tool turn: a str as it is, else JSON."""
    if isinstance(result, str):
        return result
    try:
        return json.dumps(result, ensure_ascii=False, default=str)
    except (TypeError, ValueError):
        return str(result)


# ------------------------------------------------------------------- type hints -> schema


def _schema(hint: Any, where: str) -> dict[str, Any]:
    """The JSON Schema of one type hint."""
    if hint is Any or hint is inspect.Parameter.empty:
        return {}
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin is typing.Annotated:
        schema = _schema(args[0], where)
        texts = [a for a in args[1:] if isinstance(a, str)]
        return {**schema, "description": " ".join(texts)} if texts else schema
    if hint is None or hint is type(None):
        return {"type": "null"}
    simple = {str: "string", int: "integer", float: "number", bool: "boolean"}
    if hint in simple:
        return {"type": simple[hint]}
    if hint in (list, tuple, set, frozenset, Sequence):
        return {"type": "array"}
    if hint in (dict, Mapping):
        return {"type": "object"}
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        values = [m.value for m in hint]
        if not all(_jsonable(v) for v in values):
            raise InvalidArgument(f"{where}: enum {hint.__name__} has values JSON cannot hold")
        return {"enum": values}
    if origin is typing.Literal:
        if not all(_jsonable(v) for v in args):
            raise InvalidArgument(f"{where}: Literal values must be str, int, float, bool "
                                  f"or None")
        return {"enum": list(args)}
    if origin in (typing.Union, types.UnionType):
        options = [_schema(a, where) for a in args]
        return options[0] if len(options) == 1 else {"anyOf": options}
    if origin in (list, set, frozenset, Sequence):
        return {"type": "array", "items": _schema(args[0], where)} if args else {"type": "array"}
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return {"type": "array", "items": _schema(args[0], where)}
        return {"type": "array", "prefixItems": [_schema(a, where) for a in args],
                "minItems": len(args), "maxItems": len(args)}
    if origin in (dict, Mapping):
        if args and args[0] is not str:
            raise InvalidArgument(f"{where}: JSON object keys are strings; use dict[str, ...]")
        return {"type": "object", "additionalProperties": _schema(args[1], where)} if args \
            else {"type": "object"}
    raise InvalidArgument(f"{where}: no JSON Schema for the type {hint!r}; use str, int, "
                          f"float, bool, list, dict, Literal, an Enum, or Annotated")


def _jsonable(value: Any) -> bool:
    return value is None or isinstance(value, str | int | float | bool)


def _parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """The summary (text before the first section) and ``Args:`` descriptions."""
    lines = doc.splitlines()
    summary: list[str] = []
    args: dict[str, str] = {}
    section: str | None = None
    current: str | None = None
    for line in lines:
        m = _SECTION.match(line)
        if m:
            section = m.group(1).lower()
            current = None
            continue
        if section is None:
            summary.append(line)
        elif section in ("args", "arguments", "parameters", "params"):
            pm = _PARAM_LINE.match(line)
            if pm and (len(line) - len(line.lstrip())) <= 4:
                current = pm.group(1).lstrip("*")
                args[current] = pm.group(3).strip()
            elif current is not None and line.strip():
                args[current] = (args[current] + " " + line.strip()).strip()
    return "\n".join(summary).strip(), args

