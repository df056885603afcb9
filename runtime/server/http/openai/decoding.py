"""A request's decoding settings: what every choice of one OpenAI request generates with.

Owner: the mapping from a decoded request (``schema``) to ``generate()``'s
arguments, checking what the schema cannot say (one field against another): the sampler of
each choice (its seed derived from the request's alone), the one constraint a request asks
for (``response_format``, or vLLM's ``guided_*`` / ``structured_outputs``), the tools and
their choice, vLLM's ``skip_special_tokens`` and ``include_stop_str_in_output``. The rules
every API shares (greedy decoding, the tool choice, a JSON format) are
``conversation.decoding``'s. Written against the public SDK only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pie_ctx.constrain import Choice, Grammar, JsonSchema, Regex
from pie_ctx.proto.errors import InvalidArgument
from pie_ctx.proto.messages import SamplerSpec
from pie_ctx.tools import Tool
from runtime.server.http.conversation.decoding import json_constraint, sampler_of, tool_options
from runtime.server.http.conversation.errors import ApiError
from runtime.server.http.limits import DEFAULT_MAX_OUTPUT_TOKENS
from runtime.server.http.openai.chat import tool_choice_of, tools_of
from runtime.server.http.openai.schema import (
    ChatRequest,
    CompletionRequest,
    ResponseFormat,
)

__all__ = ["Decoding", "decoding_of"]


@dataclass(slots=True, kw_only=True)
class Decoding:
    """What every choice of one request generates with."""

    n: int
    max_tokens: int | None  # None: the default output limit (``limits.output_limit``)
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int | None
    stop: list[str]
    logprobs: bool
    top_logprobs: int
    constrain: Any
    logit_bias: dict[int, float] | None
    min_tokens: int
    ignore_eos: bool
    tools: list[Tool] = field(default_factory=list)
    tool_choice: str | None = None
    parallel_tool_calls: bool = True
    skip_special_tokens: bool = True
    include_stop_str: bool = False  # vLLM's include_stop_str_in_output

    def sampler(self, choice: int) -> SamplerSpec:
        """Choice ``choice``'s sampler: its seed is derived from the request's alone (the
        seed plus the choice's index, modulo 2**63), so a request is reproducible."""
        return sampler_of(self.temperature, top_p=self.top_p, top_k=self.top_k,
                          min_p=self.min_p, seed=None if self.seed is None else
                          self.seed + choice)

    def tool_options(self) -> dict[str, Any]:
        """``generate()``'s tool arguments (the declared tools are offered)."""
        return tool_options(self.tools, self.tool_choice, self.parallel_tool_calls)


def decoding_of(req: ChatRequest | CompletionRequest) -> Decoding:
    """The decoding settings of a request the schema accepted (what it cannot check: one
    field against another)."""
    chat = isinstance(req, ChatRequest)
    max_tokens = (req.max_completion_tokens if chat else None) or req.max_tokens
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if chat:
        logprobs, top = bool(req.logprobs), req.top_logprobs or 0
        if top and not logprobs:
            raise ApiError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    else:
        logprobs, top = req.logprobs is not None, req.logprobs or 0
    try:
        bias = {int(k): v for k, v in (req.logit_bias or {}).items()}
    except ValueError:
        raise ApiError(400, "'logit_bias' must map token ids (as strings) to numbers in "
                            "[-100, 100]", param="logit_bias") from None
    min_tokens = req.min_tokens or 0
    if min_tokens > (max_tokens or DEFAULT_MAX_OUTPUT_TOKENS):
        raise ApiError(400, f"'min_tokens' ({min_tokens}) is over the most tokens to "
                            f"generate ({max_tokens or DEFAULT_MAX_OUTPUT_TOKENS})",
                       param="min_tokens")
    d = Decoding(
        n=req.n or 1, max_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else float(req.temperature),
        top_p=float(req.top_p or 1.0), top_k=max(0, req.top_k or 0),
        min_p=float(req.min_p or 0.0), seed=req.seed, stop=stop, logprobs=logprobs,
        top_logprobs=top, constrain=None, logit_bias=bias or None, min_tokens=min_tokens,
        ignore_eos=bool(req.ignore_eos))
    d.constrain = _constraint(req)
    d.skip_special_tokens = req.skip_special_tokens is not False
    d.include_stop_str = bool(req.include_stop_str_in_output)
    if chat:
        d.tools = tools_of(req)
        d.tool_choice = tool_choice_of(req, d.tools)
        d.parallel_tool_calls = req.parallel_tool_calls is not False
        if d.tools and d.constrain is not None and not isinstance(d.constrain, JsonSchema):
            raise ApiError(400, "with 'tools', only a JSON constraint (response_format, "
                                "guided_json, structured_outputs.json) can shape the answer",
                           param="tools")
    if not d.skip_special_tokens and (d.tools or d.constrain is not None):
        raise ApiError(400, "'skip_special_tokens': false is served only for plain text "
                            "(no tools, no constraint)", param="skip_special_tokens")
    return d


def _constraint(req: ChatRequest | CompletionRequest) -> Any:
    """The one constraint a request asks for: ``response_format`` or one of vLLM's
    ``guided_*``/``structured_outputs`` (a ``pie_ctx.constrain`` value), or None."""
    given: list[tuple[str, Callable[[], Any]]] = []
    fmt = getattr(req, "response_format", None)
    if fmt is not None and fmt.type != "text":
        given.append(("response_format", lambda: _response_format(fmt)))
    if req.guided_json is not None:
        given.append(("guided_json", lambda: JsonSchema(req.guided_json)))
    if req.guided_regex is not None:
        given.append(("guided_regex", lambda: Regex(req.guided_regex)))
    if req.guided_choice is not None:
        given.append(("guided_choice", lambda: Choice(req.guided_choice)))
    if req.guided_grammar is not None:
        given.append(("guided_grammar", lambda: Grammar(req.guided_grammar, syntax="ebnf")))
    so = req.structured_outputs
    if so is not None:
        if so.whitespace_pattern is not None:
            raise ApiError(400, "'structured_outputs.whitespace_pattern' is not supported: "
                                "JSON is written on one line", param="structured_outputs",
                           code="unsupported_parameter")
        parts = [(k, v) for k, v in (("json", so.json), ("regex", so.regex),
                                     ("choice", so.choice), ("grammar", so.grammar),
                                     ("json_object", so.json_object or None))
                 if v is not None]
        if len(parts) != 1:
            raise ApiError(400, "'structured_outputs' takes exactly one of json, regex, "
                                "choice, grammar, json_object", param="structured_outputs")
        kind, value = parts[0]
        make = {"json": lambda: JsonSchema(value), "regex": lambda: Regex(value),
                "choice": lambda: Choice(value),
                "grammar": lambda: Grammar(value, syntax="ebnf"),
                "json_object": lambda: JsonSchema({"type": "object"})}[kind]
        given.append((f"structured_outputs.{kind}", make))
    if not given:
        return None
    if len(given) > 1:
        names = ", ".join(name for name, _ in given)
        raise ApiError(400, f"one constraint per request: {names} were all given",
                       param=given[1][0].split(".")[0])
    name, make = given[0]
    try:
        return make()
    except InvalidArgument as err:
        raise ApiError(400, f"{name}: {err}", param=name.split(".")[0]) from None


def _response_format(fmt: ResponseFormat) -> Any:
    """``response_format`` (not ``text``) -> a ``pie_ctx.constrain.JsonSchema``."""
    schema = fmt.json_schema.schema if fmt.json_schema is not None else None
    return json_constraint(fmt.type, schema, where="response_format",
                           param="response_format",
                           missing="response_format json_schema needs 'json_schema': "
                                   "{'schema': {...}}")
