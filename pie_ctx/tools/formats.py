"""Tool-call formats: how tools reach a prompt, how a call is constrained, how it is read.

Owns: the two formats pie-ctx speaks (docs/agents.md explains the choice):

* ``hermes``: the model's own chat template describes the tools (it is rendered with
  ``tools=``) and the model writes ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n
  </tool_call>`` blocks, as Qwen2.5, Qwen3, Hermes and SmolLM3 do. Chosen when the chat
  template mentions ``<tool_call>``.
* ``generic``: for every other template (SmolLM2's has no tool format). The tools and an
  instruction go into the system turn, and the whole answer is one JSON object:
  ``{"tool_call": {"name": ..., "arguments": {...}}}`` (``{"tool_calls": [...]}`` when
  parallel calls are allowed) or ``{"response": "..."}``. llama.cpp's server answered
  templates without a tool format the same way. Under ``tool_choice="none"`` the answer
  is constrained to ``{"response": ...}`` alone: the prompt asked for one JSON object, so
  free text would invite a call written as text.

The rules every offer follows (docs/agents.md, "The rules of a call"):

* ``"none"`` never yields a call: the reader of such a generation reads no calls, and the
  generic constraint admits only the answer branch;
* a call's arguments have no key its schema does not declare, unless the schema allows
  it: every object schema with ``properties`` and no ``additionalProperties`` is closed
  (llama.cpp's grammar converter and vLLM's strict mode do the same), an object without
  ``properties`` stays free-form;
* one answer holds at most :func:`max_calls` calls (one without parallel calls), and an
  output cut by ``max_tokens`` keeps the calls completed before the cut and shows no call
  markup;
* an answer schema (``response_format``) constrains the answer branch: the generic
  format's ``{"response": <schema>}``, the hermes format's text.

A call is always generated under a constraint built here (a Lark grammar or a JSON
Schema that the engine compiles): it is valid JSON for its tool's schema. The JSON is
written on one line with ``", "`` and ``": "``, exactly as chat templates' ``tojson``
renders arguments, so the context holds what the template would have written, and the
engine can jump over every forced token (keys, names, punctuation) in one pass.

Each format also reads a model's output back, all at once (``parse``) or as it streams
(``stream``), into visible content and :class:`~pie_ctx.tools.tool.ToolCall` values.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pie_ctx.proto.errors import InvalidArgument
from pie_ctx.proto.messages import ConstraintSpec
from pie_ctx.tools.tool import Tool, ToolCall, new_call_id

__all__ = ["ToolFormat", "HermesFormat", "GenericFormat", "tool_format", "format_named",
           "CHOICES", "Parsed", "ToolOffer", "check_choice", "max_calls", "closed_schema"]

CHOICES = ("auto", "none", "required")
# The JSON style of every generated call (llguidance's options; json.dumps's separators).
_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_OPEN, _CLOSE = "<tool_call>", "</tool_call>"


@dataclass(slots=True)
class Parsed:
    """A model's output read back: the visible content and the calls it made."""

    content: str
    calls: list[ToolCall] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class ToolOffer:
    """What one generation offers the model: the tools, ``tool_choice``, and the
    constraint that makes every call valid (None: free text, under ``"none"``)."""

    format: ToolFormat
    tools: list[Tool]
    choice: str
    constraint: ConstraintSpec | None

    def reader(self) -> OutputStream:
        """A reader of this generation's output (one that reads no call under ``"none"``)."""
        return self.format.stream(calls=self.choice != "none")


def max_calls(tools: Sequence[Tool], parallel: bool) -> int:
    """The most calls one answer may hold: 1 without parallel calls; else one per tool
    offered, and at least 2 (one tool may be called twice at once: two cities)."""
    return max(2, len(tools)) if parallel else 1


def closed_schema(schema: Any, close: bool = True) -> Any:
    """``schema`` with every object that declares ``properties`` and says nothing of
    ``additionalProperties`` closed (``"additionalProperties": false``): the keys a call
    may write are the declared ones, unless the schema allows more. The parts of an
    ``allOf`` are left open themselves (each would refuse the others' keys)."""
    if isinstance(schema, list):
        return [closed_schema(s, close) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in ("properties", "patternProperties", "$defs", "definitions",
                   "dependentSchemas") and isinstance(value, dict):
            out[key] = {k: closed_schema(v) for k, v in value.items()}
        elif key in ("items", "additionalItems", "additionalProperties", "anyOf", "oneOf",
                     "prefixItems", "not", "if", "then", "else", "contains",
                     "unevaluatedProperties", "propertyNames"):
            out[key] = closed_schema(value)
        elif key == "allOf":
            out[key] = closed_schema(value, close=False)
        else:
            out[key] = value
    if close and isinstance(out.get("properties"), dict) and "allOf" not in out \
            and "additionalProperties" not in out and "unevaluatedProperties" not in out:
        out["additionalProperties"] = False
    return out


def check_choice(choice: Any, tools: Sequence[Tool]) -> str:
    """``tool_choice`` checked against the tools: ``"auto"``, ``"none"``, ``"required"`` or
    one tool's name.

    Raises:
        InvalidArgument: anything else.
    """
    if not isinstance(choice, str):
        raise InvalidArgument(f"tool_choice is 'auto', 'none', 'required' or a tool's name, "
                              f"got {choice!r}")
    if choice in CHOICES or any(t.name == choice for t in tools):
        return choice
    names = ", ".join(t.name for t in tools) or "(none declared)"
    raise InvalidArgument(f"tool_choice {choice!r} is not 'auto', 'none', 'required' nor one "
                          f"of the tools: {names}")


def _call_schema(tools: Sequence[Tool]) -> dict[str, Any]:
    """One call of any of ``tools``: ``{"name": <const>, "arguments": <its schema>}``."""
    options = [{"type": "object",
                "properties": {"name": {"const": t.name},
                               "arguments": closed_schema(t.parameters)},
                "required": ["name", "arguments"], "additionalProperties": False}
               for t in tools]
    return options[0] if len(options) == 1 else {"anyOf": options}


def _json(schema: dict[str, Any]) -> str:
    """A schema for a Lark ``%json`` rule, with the one-line JSON style."""
    return json.dumps({**schema, "x-guidance": _STYLE})


def _lark_string(text: str) -> str:
    return json.dumps(text)


class ToolFormat:
    """How one chat template speaks tools (see the module docstring)."""

    name = ""

    def system_text(self, text: str, tools: Sequence[Tool]) -> str:
        """The system turn's text once ``tools`` are declared."""
        raise NotImplementedError

    def template_vars(self, tools: Sequence[dict[str, Any]]) -> dict[str, Any]:
        """Variables every rendering of the conversation passes to the chat template."""
        raise NotImplementedError

    def constraint(self, tools: Sequence[Tool], choice: str, parallel: bool,
                   answer: dict[str, Any] | None = None) -> ConstraintSpec | None:
        """The constraint of one generation under ``tool_choice=choice``; ``answer``: a
        JSON Schema the answer (the branch that is not a call) must follow, if any."""
        raise NotImplementedError

    def model_text(self, content: str, calls: Sequence[ToolCall]) -> str:
        """What the model writes to say ``content`` and make ``calls`` (``parse``'s
        inverse: a conversation replayed from elsewhere)."""
        raise NotImplementedError

    def parse(self, raw: str) -> Parsed:
        """The content and calls of a whole output."""
        stream = self.stream()
        content = stream.feed(raw)
        calls = stream.calls_done
        return Parsed(content + stream.finish(), list(calls))

    def stream(self, calls: bool = True) -> OutputStream:
        """An incremental reader of one output (``calls=False``: all of it is content)."""
        raise NotImplementedError

    def assistant_message(self, raw: str, parsed: Parsed) -> dict[str, Any]:
        """The assistant message a generation adds to the conversation."""
        raise NotImplementedError

    def tool_message(self, call_id: str, name: str, content: str) -> dict[str, Any]:
        """The message of one tool result."""
        raise NotImplementedError


class OutputStream:
    """Reads one output as it streams: visible content out, completed calls collected."""

    def __init__(self) -> None:
        self.raw = ""
        self.calls_done: list[ToolCall] = []

    def feed(self, text: str) -> str:
        """Add raw model text; return the new visible content (may be empty). Calls that
        this text completed are appended to ``calls_done``."""
        raise NotImplementedError

    def finish(self) -> str:
        """The output ended: return whatever content was held back."""
        raise NotImplementedError


# ----------------------------------------------------------------------------- hermes


class HermesFormat(ToolFormat):
    """``<tool_call>`` blocks; the template renders the tools (Qwen2.5 and its kin)."""

    name = "hermes"

    def system_text(self, text: str, tools: Sequence[Tool]) -> str:
        return text

    def template_vars(self, tools: Sequence[dict[str, Any]]) -> dict[str, Any]:
        return {"tools": list(tools)} if tools else {}

    def constraint(self, tools: Sequence[Tool], choice: str, parallel: bool,
                   answer: dict[str, Any] | None = None) -> ConstraintSpec | None:
        if choice == "none" or not tools:
            return None if answer is None else ConstraintSpec(kind="json_schema",
                                                              source=json.dumps(answer))
        chosen = [t for t in tools if t.name == choice] or list(tools)
        body = f'"\\n" %json {_json(_call_schema(chosen))} "\\n{_CLOSE}"'
        more = ""
        for _ in range(max_calls(chosen, parallel) - 1):  # at most max_calls blocks
            more = f' ("\\n{_OPEN}" {body}{more})?'
        calls = f"{_lark_string(_OPEN)} {body}{more}"
        if choice == "auto" and answer is not None:
            lark = f"%llguidance {{}}\nstart: %json {_json(answer)} | {calls}\n"
        elif choice == "auto":
            # Free text; a call starts at the first "<tool_call>" and is constrained.
            lark = (f"%llguidance {{}}\nstart: TEXT | head {body}{more}\n"
                    f"head[lazy]: TEXT {_lark_string(_OPEN)}\nTEXT: /(.|\\n)*/\n")
        else:
            lark = f"%llguidance {{}}\nstart: {calls}\n"
        return ConstraintSpec(kind="lark", source=lark)

    def stream(self, calls: bool = True) -> OutputStream:
        return _HermesStream() if calls else _TextStream()

    def model_text(self, content: str, calls: Sequence[ToolCall]) -> str:
        blocks = "\n".join(f"{_OPEN}\n{_call_json(c)}\n{_CLOSE}" for c in calls)
        return f"{content}\n{blocks}" if content and blocks else content or blocks

    def assistant_message(self, raw: str, parsed: Parsed) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
        if parsed.calls:
            message["tool_calls"] = [
                {"id": c.id, "type": "function",
                 "function": {"name": c.name, "arguments": c.arguments}}
                for c in parsed.calls]
        return message

    def tool_message(self, call_id: str, name: str, content: str) -> dict[str, Any]:
        return {"role": "tool", "tool_call_id": call_id, "name": name, "content": content}


class _HermesStream(OutputStream):
    def __init__(self) -> None:
        super().__init__()
        self._pos = 0  # raw[:_pos] is consumed (shown as content, or inside a block)

    def feed(self, text: str) -> str:
        # Whitespace is held back until what follows is known: before a call (or between
        # two) it belongs to neither, as the template writes it itself.
        self.raw += text
        out = []
        while True:
            rest = self.raw[self._pos:]
            start = rest.find(_OPEN)
            if start < 0:
                # Hold back a tail that may be the start of "<tool_call>".
                shown = rest[: len(rest) - _partial_suffix(rest, _OPEN)].rstrip()
                out.append(shown)
                self._pos += len(shown)
                return "".join(out)
            out.append(rest[:start].rstrip())
            end = rest.find(_CLOSE, start)
            if end < 0:
                self._pos += start
                return "".join(out)
            self.calls_done.extend(_read_calls(rest[start + len(_OPEN): end]))
            self._pos += end + len(_CLOSE)

    def finish(self) -> str:
        rest = self.raw[self._pos:]
        self._pos = len(self.raw)
        head = rest.lstrip()
        if head.startswith(_OPEN):  # a call cut by max_tokens: no markup shown
            return ""
        cut = _partial_suffix(rest, _OPEN)
        if cut >= 2:  # "<tool_c" cut by max_tokens: the start of a call, not text
            rest = rest[: len(rest) - cut].rstrip()
        return rest.rstrip() if self.calls_done else rest


class _TextStream(OutputStream):
    """Everything is content (``tool_choice="none"``: what looks like a call is text)."""

    def feed(self, text: str) -> str:
        self.raw += text
        return text

    def finish(self) -> str:
        return ""


def _call_json(call: ToolCall) -> str:
    """A call as the model writes it (one line, json.dumps' separators)."""
    return json.dumps({"name": call.name, "arguments": call.arguments}, ensure_ascii=False)


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _read_calls(block: str) -> list[ToolCall]:
    """The call in one ``<tool_call>`` block (nothing if it is not a call)."""
    try:
        data = json.loads(block)
    except ValueError:
        return []
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return []
    args = data.get("arguments", data.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return []
    if not isinstance(args, dict):
        return []
    return [ToolCall(id=new_call_id(), name=data["name"], arguments=args)]


# ---------------------------------------------------------------------------- generic


_GENERIC_INSTRUCTIONS = (
    "You can call these tools (JSON Schema of each one's arguments):\n{tools}\n\n"
    "Answer with one JSON object on one line: {call} to call a tool, or "
    '{{"response": "..."}} to answer directly.')


class GenericFormat(ToolFormat):
    """One JSON object per answer, for templates without a tool format."""

    name = "generic"

    def system_text(self, text: str, tools: Sequence[Tool]) -> str:
        listing = "\n".join(json.dumps(t.to_openai()["function"], ensure_ascii=False)
                            for t in tools)
        call = ('{"tool_call": {"name": "<tool name>", "arguments": {...}}} '
                '(or {"tool_calls": [...]} for several)')
        instructions = _GENERIC_INSTRUCTIONS.format(tools=listing, call=call)
        return f"{text}\n\n{instructions}" if text else instructions

    def template_vars(self, tools: Sequence[dict[str, Any]]) -> dict[str, Any]:
        return {}

    def constraint(self, tools: Sequence[Tool], choice: str, parallel: bool,
                   answer: dict[str, Any] | None = None) -> ConstraintSpec | None:
        # The answer branch, with the answer's schema in it (llama.cpp's generic format
        # does the same with response_format). Under "none" it is the only branch: the
        # prompt asked for one JSON object, and free text would invite a call as text.
        response = {"type": "object",
                    "properties": {"response": {"type": "string"} if answer is None
                                   else answer},
                    "required": ["response"], "additionalProperties": False}
        options: list[dict[str, Any]] = []
        if tools and choice != "none":
            chosen = [t for t in tools if t.name == choice] or list(tools)
            call = _call_schema(chosen)
            options.append({"type": "object", "properties": {"tool_call": call},
                            "required": ["tool_call"], "additionalProperties": False})
            most = max_calls(chosen, parallel)
            if most > 1:
                options.append({"type": "object",
                                "properties": {"tool_calls": {"type": "array", "items": call,
                                                              "minItems": 1,
                                                              "maxItems": most}},
                                "required": ["tool_calls"], "additionalProperties": False})
        if choice in ("auto", "none") or not tools:
            options.append(response)
        schema = options[0] if len(options) == 1 else {"anyOf": options}
        return ConstraintSpec(kind="json_schema", source=json.dumps(schema))

    def stream(self, calls: bool = True) -> OutputStream:
        return _GenericStream(calls)

    def model_text(self, content: str, calls: Sequence[ToolCall]) -> str:
        # One JSON object: a call leaves no room for text beside it.
        if not calls:
            return json.dumps({"response": content}, ensure_ascii=False)
        if len(calls) == 1:
            return f'{{"tool_call": {_call_json(calls[0])}}}'
        return f'{{"tool_calls": [{", ".join(_call_json(c) for c in calls)}]}}'

    def assistant_message(self, raw: str, parsed: Parsed) -> dict[str, Any]:
        # The template knows nothing of calls: the message is the JSON the model wrote.
        return {"role": "assistant", "content": raw}

    def tool_message(self, call_id: str, name: str, content: str) -> dict[str, Any]:
        return {"role": "tool", "content": content}


_RESPONSE = '{"response": '
_CALL = '{"tool_call": '
_CALLS = '{"tool_calls": ['


class _GenericStream(OutputStream):
    """Reads one JSON object as it is written (the engine writes it on one line, with
    json.dumps's separators): the response's text is shown as it comes, each call is
    collected the moment its JSON is complete, and an object cut by ``max_tokens`` shows
    nothing of its markup (the calls completed before the cut are kept)."""

    def __init__(self, calls: bool = True) -> None:
        super().__init__()
        self._calls = calls  # False (tool_choice="none"): nothing is read as a call
        self._shown = 0  # characters of the response's text already returned
        self._read = 0  # elements of a tool_calls array already read
        self._done = False
        self._text = False  # the output is not a JSON object: all of it is text

    def feed(self, text: str) -> str:
        self.raw += text
        if self._done:
            return ""
        head = self.raw.lstrip()
        calls_off = not self._calls and not _RESPONSE.startswith(head[:len(_RESPONSE)])
        if self._text or calls_off or (head and not head.startswith("{")):
            self._text = True  # under "none", an object that is no answer is text too
            return self._show(self.raw)
        try:
            data = json.loads(self.raw)
        except ValueError:
            data = None
        if isinstance(data, dict):  # the object is complete
            self._done = True
            if self._calls:
                found = _generic_calls(data)
                self.calls_done.extend(found[len(self.calls_done):])
            if "response" in data:
                return self._show(self._response_text(complete=True))
            return ""
        if head.startswith(_RESPONSE):
            return self._show(self._response_text(complete=False))
        if self._calls and head.startswith(_CALLS):
            self._read_elements(head[len(_CALLS):])
        elif self._calls and head.startswith(_CALL) and not self.calls_done:
            self._read_elements(head[len(_CALL):], one=True)
        return ""

    def _show(self, text: str) -> str:
        new = text[self._shown:]
        self._shown = max(self._shown, len(text))
        return new

    def _response_text(self, complete: bool) -> str:
        """The response's text so far: a string's decoded characters, any other value's
        JSON (its last character held back until the object ends)."""
        body = self.raw.lstrip()[len(_RESPONSE):]
        if body.startswith('"'):
            return _partial_json_string(body[1:])
        body = body.rstrip()
        return body[:-1].rstrip() if body else ""

    def _read_elements(self, body: str, one: bool = False) -> None:
        """Collect the calls of an array (or the one call) whose JSON is complete."""
        decoder = json.JSONDecoder()
        pos, index = 0, 0
        while pos < len(body):
            try:
                value, end = decoder.raw_decode(body, pos)
            except ValueError:
                return
            if index >= self._read:
                self._read = index + 1
                self.calls_done.extend(_generic_calls({"tool_calls": [value]}))
            if one:
                return
            index += 1
            pos = end
            while pos < len(body) and body[pos] in ", ":
                pos += 1
            if pos < len(body) and body[pos] == "]":
                return

    def finish(self) -> str:
        if self._text:
            return self._show(self.raw)
        # An object that did not end (max_tokens): its complete calls are kept, its
        # response's text was shown as it came, and no markup is shown.
        return ""


def _generic_calls(data: dict[str, Any]) -> list[ToolCall]:
    calls = data.get("tool_calls")
    if not isinstance(calls, list):
        calls = [data["tool_call"]] if "tool_call" in data else []
    out = []
    for c in calls:
        if isinstance(c, dict) and isinstance(c.get("name"), str) and \
                isinstance(c.get("arguments", {}), dict):
            out.append(ToolCall(id=new_call_id(), name=c["name"],
                                arguments=c.get("arguments", {})))
    return out


def _partial_json_string(body: str) -> str:
    """The decoded prefix of a JSON string's body (no opening quote), stopping at its
    closing quote or before an escape that is not complete yet."""
    out: list[str] = []
    i = 0
    while i < len(body):
        ch = body[i]
        if ch == '"':
            break
        if ch != "\\":
            out.append(ch)
            i += 1
            continue
        if i + 1 >= len(body):
            break
        if body[i + 1] == "u":
            if i + 6 > len(body):
                break
            code = body[i: i + 6]
            # A surrogate pair needs its second half before it can be shown.
            if "\\ud800" <= code.lower() <= "\\udbff":
                if i + 12 > len(body):
                    break
                code = body[i: i + 12]
            try:
                out.append(json.loads(f'"{code}"'))
            except ValueError:
                break
            i += len(code)
            continue
        try:
            out.append(json.loads(f'"{body[i:i + 2]}"'))
        except ValueError:
            break
        i += 2
    return "".join(out)


# ------------------------------------------------------------------------- choosing


_FORMATS: dict[str, ToolFormat] = {"hermes": HermesFormat(), "generic": GenericFormat()}


def tool_format(tokenizer: Any) -> ToolFormat:
    """The format of this model's chat template (see the module docstring)."""
    source = getattr(tokenizer, "chat_template", None) or ""
    return _FORMATS["hermes" if _OPEN in source else "generic"]


def format_named(name: str) -> ToolFormat:
    """A format by name (what a saved conversation records)."""
    return _FORMATS[name]
