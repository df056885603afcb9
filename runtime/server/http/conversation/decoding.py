"""What a generation runs with, whatever API asked: its sampler, its tool choice, its
JSON constraint.

Owner: the rules the three APIs share, so that one request means the same on each:

* **Greedy.** A temperature of exactly 0 is greedy decoding (the most likely token; the
  other sampling fields are ignored), as the engine's ``SamplerSpec.is_greedy`` says; any
  positive temperature is sampled at, however small (the engine's sampler clamps it at
  ``runtime.sampling.MIN_TEMPERATURE``, where the draw is already the greedy one-hot). No
  temperature given is 1. A ``top_p`` of 0 is 1 (no nucleus), a ``top_k`` of 0 or less is
  no limit. A seed is taken modulo 2**63 (the sampler's range).
* **Tool choice.** ``"auto"``, ``"none"``, ``"required"`` or a tool's name, as the SDK's
  ``generate()`` takes it; a choice needs tools, a named tool must be among them.
* **JSON constraint.** ``json_object`` is any object; ``json_schema`` needs its schema,
  which must compile.

Written against the public SDK only.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from pie_ctx.constrain import JsonSchema
from pie_ctx.proto.errors import InvalidArgument
from pie_ctx.proto.messages import SamplerSpec
from pie_ctx.tools import Tool
from runtime.server.http.conversation.errors import ApiError

__all__ = ["DEFAULT_TEMPERATURE", "json_constraint", "sampler_of", "tool_choice_of",
           "tool_options"]

DEFAULT_TEMPERATURE = 1.0  # OpenAI's and Anthropic's default


def sampler_of(temperature: float | None, *, top_p: float | None = None,
               top_k: int | None = None, min_p: float | None = None,
               seed: int | None = None) -> SamplerSpec:
    """The sampler of a request's fields (None: the field's default); greedy at a
    temperature of exactly 0 (see the module docstring)."""
    t = DEFAULT_TEMPERATURE if temperature is None else float(temperature)
    if t == 0:
        return SamplerSpec()
    return SamplerSpec(temperature=t, top_k=max(0, top_k or 0), top_p=float(top_p or 1.0),
                       min_p=float(min_p or 0.0),
                       seed=None if seed is None else seed % (1 << 63))


def tool_choice_of(kind: str | None, tools: Sequence[Tool], *, name: str | None = None,
                   among: Collection[str] | None = None, what: str = "tools",
                   quiet_without_tools: Collection[str] = (),
                   without_tools: str = "'tool_choice' needs 'tools'") -> str | None:
    """A request's tool choice as the SDK takes it.

    Args:
        kind: ``"auto"``, ``"none"``, ``"required"``, ``"named"`` (then ``name``), or None
            (not given: None).
        tools: the tools the request offers.
        among: the names a named choice may take (default: every tool's); ``what`` names
            them in the error.
        quiet_without_tools: the kinds that mean nothing without tools (None, no error).
        without_tools: the error's message for any other kind without tools.

    Raises:
        ApiError: a choice without tools, or a named tool that is not among them.
    """
    if kind is None:
        return None
    if not tools:
        if kind in quiet_without_tools:
            return None
        raise ApiError(400, without_tools, param="tool_choice")
    if kind != "named":
        return kind
    if name not in (among if among is not None else {t.name for t in tools}):
        raise ApiError(400, f"tool_choice names {name!r}, which is not one of the {what}",
                       param="tool_choice")
    return name


def tool_options(tools: Sequence[Tool], choice: str | None, parallel: bool
                 ) -> dict[str, object]:
    """``generate()``'s tool arguments: none without tools (nothing is offered)."""
    if not tools:
        return {}
    return {"tool_choice": choice, "parallel_tool_calls": parallel}


def json_constraint(kind: str, schema: dict[str, object] | None, *, where: str,
                    param: str | None, missing: str) -> JsonSchema | None:
    """The constraint of a JSON output format: None for ``text``, any object for
    ``json_object``, ``schema`` for ``json_schema``.

    Raises:
        ApiError: ``missing`` when a ``json_schema`` has no schema; a schema that does not
            compile (``where: why``).
    """
    if kind == "text":
        return None
    if kind == "json_object":
        return JsonSchema({"type": "object"})
    if schema is None:
        raise ApiError(400, missing, param=param)
    try:
        return JsonSchema(schema)
    except InvalidArgument as err:
        raise ApiError(400, f"{where}: {err}", param=param) from None
