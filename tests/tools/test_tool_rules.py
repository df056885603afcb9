"""The rules of a tool call, in both formats (docs/agents.md, "The rules of a call"):
``"none"`` never yields a call, undeclared argument keys are refused, calls per answer are
bounded, a cut answer keeps its complete calls and shows no markup, and an answer schema
constrains the answer beside the tools.

Each rule once on the readers and constraints themselves (exact), once through the SDK on
the tiny random model, whose nonsense is what makes the end-to-end checks strict.
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from pie_ctx import Context, Sampler
from pie_ctx.constrain import JsonSchema
from pie_ctx.errors import InvalidArgument
from pie_ctx.tools import Tool, tool_format
from pie_ctx.tools.formats import (
    GenericFormat,
    HermesFormat,
    ToolOffer,
    closed_schema,
    max_calls,
)
from tests.sdk.harness import sdk_runtime
from tests.tools.test_tools_sdk import tools_folder  # noqa: F401 - the fixture

pytestmark = pytest.mark.fp32_only("the rules are about text and JSON, not numerics")

# No "additionalProperties": the constraint closes it. Strings bounded so calls end.
OPEN = Tool("note", "Write a note.", {"type": "object", "required": ["text"],
                                      "properties": {"text": {"type": "string",
                                                              "maxLength": 6}}})
FREE = Tool("tag", "Tag anything.", {"type": "object", "additionalProperties": True,
                                     "properties": {"k": {"enum": ["a", "b"]}}})
TOOLS = [OPEN, FREE]
FORMATS = {"generic": GenericFormat(), "hermes": HermesFormat()}
CALL = {"name": "note", "arguments": {"text": "hi"}}
WRITTEN = {  # a call, then a second one cut by max_tokens, as each format writes them
    "generic": '{"tool_calls": [' + json.dumps(CALL) + ', {"name": "note", "argu',
    "hermes": f"<tool_call>\n{json.dumps(CALL)}\n</tool_call>\n<tool_call>\n"
              '{"name": "no',
}
ANSWER = {"type": "object", "required": ["ok"], "properties": {"ok": {"type": "boolean"}}}


def _read(offer: ToolOffer, text: str, step: int = 3) -> tuple[str, list]:
    reader = offer.reader()
    content = "".join(reader.feed(text[i: i + step]) for i in range(0, len(text), step))
    return content + reader.finish(), reader.calls_done


@pytest.mark.parametrize("name", FORMATS)
def test_none_reads_no_call(name):
    fmt = FORMATS[name]
    whole = fmt.model_text("", [*_calls(1)])
    content, calls = _read(ToolOffer(fmt, TOOLS, "none", None), whole)
    assert calls == [] and content == whole  # what looks like a call stays text
    content, calls = _read(ToolOffer(fmt, TOOLS, "auto", None), whole)
    assert [c.name for c in calls] == ["note"] and content == ""


@pytest.mark.parametrize("name", FORMATS)
def test_a_cut_answer_keeps_its_complete_calls_and_shows_no_markup(name):
    fmt = FORMATS[name]
    for step in (1, 4, 1000):
        content, calls = _read(ToolOffer(fmt, TOOLS, "required", None), WRITTEN[name], step)
        assert content == "" and [(c.name, c.arguments) for c in calls] == \
            [("note", {"text": "hi"})]


def test_constraints_close_undeclared_keys_and_bound_the_calls():
    generic = json.loads(GenericFormat().constraint(TOOLS, "required", True).source)
    call, calls = generic["anyOf"]
    args = {o["properties"]["name"]["const"]: o["properties"]["arguments"]
            for o in call["properties"]["tool_call"]["anyOf"]}
    assert args["note"]["additionalProperties"] is False  # closed
    assert args["tag"]["additionalProperties"] is True  # the schema allows more: kept
    assert calls["properties"]["tool_calls"]["maxItems"] == max_calls(TOOLS, True) == 2
    single = json.loads(GenericFormat().constraint(TOOLS, "required", False).source)
    assert "tool_calls" not in json.dumps(single) and max_calls(TOOLS, False) == 1
    none = json.loads(GenericFormat().constraint(TOOLS, "none", True, ANSWER).source)
    assert none["properties"] == {"response": ANSWER}  # "none": the answer branch only
    mixed = closed_schema({"type": "object", "properties": {"a": {}},
                           "allOf": [{"properties": {"b": {"type": "object",
                                                         "properties": {}}}}]})
    assert "additionalProperties" not in mixed  # allOf's parts add keys: left open
    assert "additionalProperties" not in mixed["allOf"][0]
    assert mixed["allOf"][0]["properties"]["b"]["additionalProperties"] is False
    assert closed_schema({"type": "object"}) == {"type": "object"}  # free-form stays
    lark = HermesFormat().constraint([OPEN], "required", True).source
    assert lark.count("<tool_call>") == 2 and "*" not in lark.split("\n")[1].split("%json")[0]
    assert '"additionalProperties": false' in lark
    assert HermesFormat().constraint(TOOLS, "none", True) is None
    assert json.loads(HermesFormat().constraint(TOOLS, "none", True, ANSWER).source) == ANSWER


def _calls(n: int) -> list:
    from pie_ctx.tools import ToolCall

    return [ToolCall(id=f"call_{i}", name="note", arguments={"text": "hi"}) for i in range(n)]


# ---------------------------------------------------------------------- through the SDK


def _samplers(n: int) -> list:
    return [Sampler.greedy()] + [Sampler.top_p(1.0, 0.95, seed=s) for s in range(n - 1)]


async def test_none_never_calls_through_the_sdk(tools_folder):  # noqa: F811
    async with sdk_runtime(tools_folder) as (rt, _):
        base = Context(rt).system("Call tools.", tools=TOOLS).user("note hi")
        for s in _samplers(3):
            gen = base.fork().generate(s, max_tokens=30, tool_choice="none")
            text = await gen.text()
            assert gen.tool_calls == [] and gen.finish_reason in ("constraint", "length",
                                                                  "stop_token")
            if tool_format(rt.tokenizer).name == "generic":  # the answer branch only
                assert gen.text_out.startswith('{"response": "')
                if gen.finish_reason == "constraint":
                    assert json.loads(gen.text_out) == {"response": text}


async def test_calls_hold_declared_keys_and_are_bounded(tools_folder):  # noqa: F811
    async with sdk_runtime(tools_folder) as (rt, _):
        base = Context(rt).system("Call tools.", tools=TOOLS).user("go")
        for s in _samplers(4):
            gen = base.fork().generate(s, max_tokens=400, tool_choice="required")
            calls = await gen.calls()
            assert 1 <= len(calls) <= max_calls(TOOLS, True), gen.text_out
            for c in calls:
                if c.name == "note":
                    assert set(c.arguments) == {"text"}, gen.text_out
                    jsonschema.validate(c.arguments, OPEN.parameters)
        for max_tokens in (6, 14, 22):  # cut inside a call: no markup, complete calls only
            gen = base.fork().generate(Sampler.greedy(), max_tokens=max_tokens,
                                       tool_choice="required")
            content = await gen.text()
            assert "tool_call" not in content and "{" not in content, content
            assert gen.finish_reason == "length"


async def test_an_answer_schema_beside_the_tools(tools_folder):  # noqa: F811
    async with sdk_runtime(tools_folder) as (rt, _):
        base = Context(rt).system("Answer in JSON.", tools=TOOLS).user("ok?")
        gen = base.fork().generate(Sampler.greedy(), max_tokens=60, tool_choice="none",
                                   constrain=JsonSchema(ANSWER))
        jsonschema.validate(json.loads(await gen.text()), ANSWER)
        for s in _samplers(3):
            gen = base.fork().generate(s, max_tokens=300, constrain=JsonSchema(ANSWER))
            content = await gen.text()
            if not gen.tool_calls:
                jsonschema.validate(json.loads(content), ANSWER)
        from pie_ctx.constrain import Regex

        with pytest.raises(InvalidArgument, match="only JsonSchema"):
            base.fork().generate(constrain=Regex("a+"), tool_choice="auto")
