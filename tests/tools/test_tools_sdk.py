"""Tool calls in the SDK, on both transports and both tool formats.

The tiny random model writes nonsense, which is what makes these tests strict: whatever it
wants to write, a call must be valid JSON for its tool's schema.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from pathlib import Path
from typing import Annotated, Literal

import jsonschema
import pytest

from pie_ctx import Context, Sampler, gather
from pie_ctx.errors import InvalidArgument
from pie_ctx.tools import Tool, ToolCall
from tests.sdk.harness import sdk_runtime
from tests.tools.templates import TOOLS_TEMPLATE, with_template

GREEDY = Sampler.greedy()


class Unit(enum.Enum):
    C = "celsius"
    F = "fahrenheit"


async def get_weather(city: Annotated[str, "a city name"], unit: Unit = Unit.C,
                      days: int = 1) -> dict:
    """Current weather in a city.

    Args:
        city: ignored here (the Annotated text wins).
        days: how many days of forecast.
    """
    return {"city": city, "unit": unit if isinstance(unit, str) else unit.value, "t": 18}


def lookup(code: Literal["ab", "cd", "ef"], strict: bool) -> str:
    """Look up a code."""
    return f"{code}:{strict}"


FROM_FUNCTION = Tool.from_function(get_weather)
# The tiny model writes random strings: bound the city so that a call always ends.
WEATHER = dataclasses.replace(FROM_FUNCTION, parameters=json.loads(
    json.dumps(FROM_FUNCTION.parameters).replace('"type": "string"',
                                                 '"type": "string", "maxLength": 12')))
LOOKUP = Tool.from_function(lookup)
TOOLS = [WEATHER, LOOKUP]


@pytest.fixture(params=["generic", "hermes"])
def tools_folder(request, tiny_folder, tmp_path_factory):
    """The tiny model with its own template (no tool format: ``generic``) or with a
    tools-aware template in Qwen2.5's style (``hermes``)."""
    if request.param == "generic":
        return tiny_folder
    root = tmp_path_factory.getbasetemp() / "tools-template"
    path = with_template(Path(tiny_folder), root, TOOLS_TEMPLATE)
    tiny_folder.path = path  # keep the dtype of this run
    return tiny_folder


def _samplers(n: int) -> list:
    return [GREEDY] + [Sampler.top_p(1.0, 0.95, seed=s) for s in range(n - 1)]


def _valid(call: ToolCall) -> None:
    tool = {t.name: t for t in TOOLS}[call.name]
    jsonschema.validate(call.arguments, tool.parameters)


def test_from_function_reads_types_and_docstring():
    p = FROM_FUNCTION.parameters
    assert FROM_FUNCTION.name == "get_weather"
    assert FROM_FUNCTION.description == "Current weather in a city."
    assert p["required"] == ["city"]
    assert p["properties"]["city"] == {"type": "string", "description": "a city name"}
    assert p["properties"]["unit"]["enum"] == ["celsius", "fahrenheit"]
    assert p["properties"]["days"] == {"type": "integer", "description":
                                       "how many days of forecast.", "default": 1}
    assert LOOKUP.parameters["properties"]["code"] == {"enum": ["ab", "cd", "ef"]}
    assert LOOKUP.parameters["required"] == ["code", "strict"]
    assert p["additionalProperties"] is False
    assert FROM_FUNCTION.to_openai()["function"]["parameters"] == p
    assert Tool.from_openai(FROM_FUNCTION.to_openai()) == FROM_FUNCTION


async def test_run_calls_sync_and_async_functions():
    assert json.loads(await WEATHER.run({"city": "Oslo"})) == \
        {"city": "Oslo", "unit": "celsius", "t": 18}
    assert await LOOKUP.run({"code": "ab", "strict": True}) == "ab:True"
    with pytest.raises(InvalidArgument, match="do not fit"):
        await LOOKUP.run({"code": "ab"})
    with pytest.raises(InvalidArgument, match="no function"):
        await Tool("bare").run({})


@pytest.mark.parametrize("bad", [
    lambda: Tool("has space"), lambda: Tool("x", parameters={"type": "array"}),
    lambda: Tool.from_function(lambda *a: None), lambda: Tool.from_function(print),
])
def test_bad_tools_are_refused(bad):
    with pytest.raises(InvalidArgument):
        bad()


async def test_required_and_named_calls_are_valid(tools_folder, transport):
    async with sdk_runtime(tools_folder, transport) as (rt, engine):
        gens = []
        for i, s in enumerate(_samplers(4)):
            ctx = Context(rt).system("You call tools.", tools=TOOLS).user(f"weather {i}?")
            choice = "required" if i % 2 else "lookup"
            gens.append(ctx.generate(s, max_tokens=300, tool_choice=choice,
                                     parallel_tool_calls=False))
        for i, calls in enumerate(await gather(*(g.calls() for g in gens))):
            g = gens[i]
            assert g.finish_reason == "tool_calls", (g.text_out, g.finish_reason)
            assert calls and calls == g.tool_calls
            for c in calls:
                _valid(c)
                assert c.id.startswith("call_")
            if i % 2 == 0:
                assert {c.name for c in calls} == {"lookup"}
        engine.store.check_invariants()


async def test_none_makes_no_call_and_auto_calls_are_valid(tools_folder, transport):
    async with sdk_runtime(tools_folder, transport) as (rt, _):
        base = Context(rt).system("Be brief.", tools=TOOLS).user("hello")
        none = base.fork().generate(GREEDY, max_tokens=40, tool_choice="none")
        text = await none.text()
        assert none.tool_calls == [] and none.finish_reason != "tool_calls"
        assert "<tool_call>" not in text and '"tool_call' not in text
        for s in _samplers(4):
            auto = base.fork().generate(s, max_tokens=300)
            await auto.text()
            for c in auto.tool_calls:
                _valid(c)
            assert (auto.finish_reason == "tool_calls") == bool(auto.tool_calls) or \
                auto.finish_reason == "length"


async def test_streamed_deltas_carry_content_and_calls(tools_folder, transport):
    async with sdk_runtime(tools_folder, transport) as (rt, _):
        ctx = Context(rt).system("x", tools=TOOLS).user("go")
        gen = ctx.generate(GREEDY, max_tokens=300, tool_choice="required",
                           parallel_tool_calls=False)
        streamed: list[ToolCall] = []
        content = ""
        async for delta in gen:
            streamed.extend(delta.tool_calls)
            content += delta.content
        assert streamed == gen.tool_calls and len(streamed) == 1
        assert content == gen.content == ""


async def test_tool_result_round_trip_prefills_only_new_tokens(tools_folder, transport):
    async with sdk_runtime(tools_folder, transport) as (rt, _):
        ctx = Context(rt).system("Use tools.", tools=TOOLS).user("Weather in Oslo?")
        gen = ctx.generate(GREEDY, max_tokens=300, tool_choice="get_weather",
                           parallel_tool_calls=False)
        (call,) = await gen.calls()
        ctx.tool_result(call.id, await WEATHER.run(call.arguments))
        new = len(ctx.pending_tokens)  # the call's last token, then the tool turn
        cue = rt.tokenizer.encode("<|im_start|>assistant\n")
        answer = ctx.generate(GREEDY, max_tokens=8, tool_choice="none")
        await answer.text()
        # the prompt of this generation is only the new tokens: nothing is sent twice
        assert answer.report.tokens_written == new + len(cue)
        assert answer.report.pages_reused == 0
        with pytest.raises(InvalidArgument, match="awaits a result"):
            ctx.tool_result(call.id, "again")


async def test_parallel_results_render_as_one_group(tools_folder, transport):
    """Results of two calls added one by one equal the template's rendering of both."""
    async with sdk_runtime(tools_folder, transport) as (rt, _):
        tok = rt.tokenizer
        ctx = Context(rt).system("s", tools=TOOLS).user("two things")
        await ctx.flush()
        core = ctx._core
        calls = [ToolCall(id=f"call_{i}", name="lookup", arguments={"code": "ab",
                                                                    "strict": bool(i)})
                 for i in range(2)]
        core.chat.calls.update({c.id: c.name for c in calls})  # as a generation records
        ctx.tool_result("call_1", "one").tool_result("call_0", "zero")
        messages = core.chat.messages
        assert [m["role"] for m in messages[-2:]] == ["tool", "tool"]
        fmt = core.chat.tool_format(tok)
        expected = tok.render_chat(messages, **fmt.template_vars(core.chat.tools))
        assert tok.decode(await ctx.tokens()) == expected


async def test_undeclared_tools_and_bad_choices_are_refused(tiny_folder, transport):
    async with sdk_runtime(tiny_folder, transport) as (rt, _):
        ctx = Context(rt).user("hi")
        with pytest.raises(InvalidArgument, match="declare"):
            ctx.generate(GREEDY, tools=TOOLS)
        with pytest.raises(InvalidArgument, match="start of a conversation"):
            ctx.system("late", tools=TOOLS)
        ok = Context(rt).system("s", tools=[WEATHER]).user("q")
        before = ok.pending_tokens
        for kw in (dict(tools=[LOOKUP]), dict(tool_choice="nope"), dict(tool_choice=3),
                   dict(tools=[WEATHER], constrain=None, tool_choice="lookup")):
            with pytest.raises(InvalidArgument):
                ok.generate(GREEDY, **kw)
        assert ok.pending_tokens == before


@pytest.mark.fp32_only("the template is what is compared; the dtype does not enter it")
async def test_tool_turns_match_transformers_apply_chat_template(tiny_folder, transport,
                                                                 tmp_path):
    """A whole exchange (tools, call, results, answer cue) is transformers'
    ``apply_chat_template(messages, tools=...)`` for a tools-aware template: the same text,
    the same prompt tokens and the same tokens for the tool turn. (The call itself holds
    the tokens the model chose, which may split the same text differently.)"""
    transformers = pytest.importorskip("transformers")
    folder = with_template(Path(tiny_folder), tmp_path / "hermes", TOOLS_TEMPLATE)
    async with sdk_runtime(folder, transport) as (rt, _):
        ctx = Context(rt).system("Use tools.", tools=TOOLS).user("Weather and a code?")
        ctx.cue()
        prompt = ctx.pending_tokens
        gen = ctx.generate(GREEDY, max_tokens=400, tool_choice="required")
        calls = await gen.calls()
        assert calls, gen.text_out
        results = [f"result {i}" for i in range(len(calls))]
        for call, result in zip(reversed(calls), reversed(results), strict=True):
            ctx.tool_result(call.id, result)  # any order: one group, in the order added
        ctx.cue()
        ours = await ctx.tokens()
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    messages = [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather and a code?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": c.id, "type": "function",
             "function": {"name": c.name, "arguments": c.arguments}} for c in calls]},
        *[{"role": "tool", "tool_call_id": c.id, "content": r}  # in the order added
          for c, r in zip(reversed(calls), reversed(results), strict=True)],
    ]
    theirs = hf.apply_chat_template(messages, tools=[t.to_openai() for t in TOOLS],
                                    add_generation_prompt=True, tokenize=True)
    if not isinstance(theirs, list):  # transformers 5 returns a BatchEncoding
        theirs = theirs["input_ids"]
    theirs = list(theirs)
    assert rt.tokenizer.decode(ours) == hf.decode(theirs)
    assert ours[: len(prompt)] == theirs[: len(prompt)]
    tail = ours[len(prompt) + len(gen.tokens_out):]  # the tool turn and the cue
    assert len(tail) > 10 and theirs[-len(tail):] == tail


async def test_a_replayed_assistant_turn_with_calls_awaits_its_results(tools_folder, transport):
    """``assistant(text, tool_calls=...)`` writes the calls as the model would have, so a
    generated call and a replayed one leave the same conversation behind."""
    async with sdk_runtime(tools_folder, transport) as (rt, _):
        made = Context(rt).system("s", tools=TOOLS).user("Weather in Oslo?")
        gen = made.generate(GREEDY, max_tokens=300, tool_choice="get_weather",
                            parallel_tool_calls=False)
        (call,) = await gen.calls()
        mine = ToolCall(id="call_mine", name=call.name, arguments=call.arguments)
        replayed = Context(rt).system("s", tools=TOOLS).user("Weather in Oslo?")
        replayed.cue().assistant("", tool_calls=[mine]).tool_result("call_mine", "18 C")
        made.tool_result(call.id, "18 C")
        fmt = made._core.chat.tool_format(rt.tokenizer)
        assert fmt.parse(fmt.model_text("", [mine])).calls[0].arguments == call.arguments
        tok = rt.tokenizer
        assert tok.decode(await replayed.tokens()).replace("call_mine", call.id) == \
            tok.decode(await made.tokens())
        with pytest.raises(InvalidArgument, match="distinct ids"):
            replayed.assistant("x", tool_calls=[mine, mine])


async def test_release_before_creation_finishes_releases_once(tiny_folder, transport):
    async with sdk_runtime(tiny_folder, transport) as (rt, engine):
        ctx = Context(rt)
        ctx.user("hi")
        await ctx.release()  # creation still in flight: no error, and nothing left
        await Context(rt).refresh()
        assert engine.store.stats().num_contexts <= 1
