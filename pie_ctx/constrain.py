"""Constraints on generated text: ``ctx.generate(..., constrain=...)``.

The engine compiles each constraint (with llguidance; see docs/decoding.md) and masks the
logits of that generation's rows in the shared batch before sampling, so a constrained
generation costs no round trip. A constraint that is complete ends the generation
(``finish_reason == "constraint"``) without waiting for ``max_tokens``; one that allows no
token at some step fails the generation with ``InvalidArgument`` and changes nothing.

Usage::

    from pie_ctx.constrain import Choice, Grammar, JsonSchema, Regex

    gen = ctx.generate(Sampler.greedy(), max_tokens=200, constrain=JsonSchema(schema))
    obj = json.loads(await gen.text())                  # valid for the schema
    ctx.generate(s, constrain=Regex(r"\\d{3}-\\d{4}"))
    ctx.generate(s, constrain=Choice(["yes", "no", "maybe"]))
    ctx.generate(s, constrain=Grammar('start: "a"+ "b"'))  # Lark; syntax="ebnf" for GBNF

A :class:`Constraint` object of your own runs in the inferlet's process instead: it is
asked for the allowed tokens before every token, which costs one round trip per token.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from pie_ctx.proto.errors import InvalidArgument
from pie_ctx.proto.messages import ConstraintSpec

__all__ = ["Regex", "JsonSchema", "AnyJson", "Grammar", "Choice", "Constraint"]


class _Compiled:
    """A constraint the engine compiles; ``spec()`` is what travels in the request."""

    __slots__ = ("_spec",)

    def __init__(self, kind: str, source: str) -> None:
        self._spec = ConstraintSpec(kind=kind, source=source)

    def spec(self) -> ConstraintSpec:
        """What travels in the generation request for the engine to compile."""
        return self._spec

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._spec.source!r})"


class Regex(_Compiled):
    """Text matching ``pattern`` entirely (Rust ``regex`` syntax: no look-around)."""

    def __init__(self, pattern: str) -> None:
        if not isinstance(pattern, str) or not pattern:
            raise InvalidArgument(f"Regex takes a non-empty pattern str, got {pattern!r}")
        super().__init__("regex", pattern)


class JsonSchema(_Compiled):
    """A JSON document valid for ``schema`` (a dict, or its JSON text)."""

    def __init__(self, schema: dict[str, Any] | str) -> None:
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as err:
                raise InvalidArgument(f"JsonSchema: the schema is not JSON: {err}") from None
        if not isinstance(schema, dict):
            raise InvalidArgument(f"JsonSchema takes a schema object (dict), got {schema!r}")
        try:
            source = json.dumps(schema)
        except (TypeError, ValueError) as err:
            raise InvalidArgument(f"JsonSchema: the schema cannot be written as JSON: {err}") \
                from None
        super().__init__("json_schema", source)


class AnyJson(JsonSchema):
    """Any JSON value (object, array, string, number, true, false or null)."""

    def __init__(self) -> None:
        super().__init__({})

    def __repr__(self) -> str:
        return "AnyJson()"


class Grammar(_Compiled):
    """A context-free grammar: Lark syntax (llguidance's variant), or ``syntax="ebnf"`` for
    GBNF (llama.cpp's EBNF), converted to Lark."""

    def __init__(self, source: str, *, syntax: str = "lark") -> None:
        if not isinstance(source, str) or not source.strip():
            raise InvalidArgument("Grammar takes the grammar's source text")
        kinds = {"lark": "lark", "ebnf": "gbnf", "gbnf": "gbnf"}
        if syntax not in kinds:
            raise InvalidArgument(f"Grammar syntax must be 'lark' or 'ebnf', got {syntax!r}")
        super().__init__(kinds[syntax], source)


class Choice(_Compiled):
    """Exactly one of ``options`` (non-empty strings)."""

    def __init__(self, options: Sequence[str]) -> None:
        opts = list(options) if not isinstance(options, str) else None
        if not opts or any(not isinstance(o, str) or not o for o in opts):
            raise InvalidArgument(f"Choice takes a list of non-empty strings, got {options!r}")
        super().__init__("choice", json.dumps(opts))


@runtime_checkable
class Constraint(Protocol):
    """A constraint that runs in your program, asked before every generated token.

    ``step(accepted)`` receives every token generated so far under the constraint and
    returns the token ids allowed next; ``None`` means the constraint is complete (the
    generation ends with ``finish_reason == "constraint"``); an empty list means no token
    can follow, which fails the generation with ``InvalidArgument``. Each step is one
    round trip to the engine (~tens of microseconds in-process, a fraction of a
    millisecond over a socket, on top of the model step).
    """

    def step(self, accepted: Sequence[int]) -> Sequence[int] | None: ...


def constraint_spec(value: Any) -> ConstraintSpec | Constraint | None:
    """What ``generate(constrain=...)`` was given: a compiled spec, a custom
    :class:`Constraint`, or None.

    Raises:
        InvalidArgument: anything else.
    """
    if value is None:
        return None
    if isinstance(value, _Compiled):
        return value.spec()
    if isinstance(value, ConstraintSpec):
        return value
    if isinstance(value, Constraint):
        return value
    raise InvalidArgument("constrain= takes Regex(...), JsonSchema(...), AnyJson(), "
                          f"Grammar(...), Choice(...) or a Constraint object, got {value!r}")
