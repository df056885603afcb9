"""Tool calls through the OpenAI-compatible API, with the official ``openai`` client against
a live ``serve --http``, on both tool formats: the tiny model's own template (no tool
format: ``generic``) and a tools-aware template in Qwen2.5's style (``hermes``).

The tiny random model writes nonsense: every call it makes is valid only because the
engine constrains it to the tool's schema. String arguments are bounded (``maxLength``)
so that a call always ends.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from runtime.model.loader.hf import load_tokenizer
from tests.http.test_openai import LiveServer
from tests.sdk.harness import tiny_model_folder
from tests.tools.templates import TOOLS_TEMPLATE, with_template

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                   "properties": {"city": {"type": "string", "maxLength": 10},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
LOOKUP = {"type": "function", "function": {
    "name": "lookup", "description": "Look up a code.",
    "parameters": {"type": "object", "additionalProperties": False,
                   "required": ["code", "strict"],
                   "properties": {"code": {"enum": ["ab", "cd"]}, "strict": {"type": "boolean"}}}}}
TOOLS = [WEATHER, LOOKUP]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "system", "content": "You call tools."},
       {"role": "user", "content": "Weather in Oslo?"}]


class Served:
    def __init__(self, server: LiveServer, folder: Path, fmt: str) -> None:
        self.server, self.folder, self.format = server, folder, fmt
        self.client = server.client()
        self.model = self.client.models.list().data[0].id

    def chat(self, **kw):
        kw.setdefault("temperature", 0)
        kw.setdefault("max_tokens", 200)
        return self.client.chat.completions.create(model=self.model, **kw)


@pytest.fixture(scope="module", params=["generic", "hermes"])
def served(request, tmp_path_factory) -> Iterator[Served]:
    folder = tiny_model_folder(tmp_path_factory.mktemp("model"))
    if request.param == "hermes":
        folder = with_template(folder, tmp_path_factory.mktemp("t") / "tools", TOOLS_TEMPLATE)
    server = LiveServer(str(folder), str(tmp_path_factory.mktemp("srv")))
    yield Served(server, Path(folder), request.param)
    server.stop()
    assert server.proc.returncode == 0


def _check(call) -> dict:
    assert call.type == "function" and call.id
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, SCHEMAS[call.function.name])
    return args


def test_required_and_named_calls_are_valid(served: Served) -> None:
    r = served.chat(messages=ASK, tools=TOOLS, tool_choice="required",
                    parallel_tool_calls=False)
    (choice,) = r.choices
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    _check(call)
    named = served.chat(messages=ASK, tools=TOOLS, parallel_tool_calls=False, n=2,
                        temperature=0.9, seed=3,
                        tool_choice={"type": "function", "function": {"name": "lookup"}})
    for c in named.choices:
        assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1
        assert c.message.tool_calls[0].function.name == "lookup"
        _check(c.message.tool_calls[0])
        assert not c.message.content  # null, or text the model wrote before the call


def test_none_makes_no_call(served: Served) -> None:
    r = served.chat(messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=24)
    (choice,) = r.choices
    assert choice.message.tool_calls is None and choice.finish_reason in ("stop", "length")
    assert isinstance(choice.message.content, str)
    assert "<tool_call>" not in choice.message.content


def test_streamed_calls_reassemble_to_the_non_streamed_ones(served: Served) -> None:
    kw = {"messages": ASK, "tools": TOOLS, "tool_choice": "required"}
    full = served.chat(**kw).choices[0]
    assert full.finish_reason == "tool_calls"
    calls: dict[int, dict] = {}
    content, finish = "", None
    for chunk in served.chat(stream=True, **kw):
        for c in chunk.choices:
            content += c.delta.content or ""
            finish = c.finish_reason or finish
            for d in c.delta.tool_calls or ():  # OpenAI's fragments, merged by index
                entry = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
                entry["id"] += d.id or ""
                entry["name"] += d.function.name or "" if d.function else ""
                entry["arguments"] += d.function.arguments or "" if d.function else ""
    assert finish == "tool_calls"
    assert content == (full.message.content or "")
    assert [(calls[i]["name"], json.loads(calls[i]["arguments"])) for i in sorted(calls)] == \
        [(c.function.name, json.loads(c.function.arguments)) for c in full.message.tool_calls]
    assert all(c["id"].startswith("call_") for c in calls.values())


def test_tool_results_round_trip(served: Served) -> None:
    """The call goes back as the assistant's message (the response object itself, as
    agents do), its result as a tool message with the client's id, then the answer."""
    first = served.chat(messages=ASK, tools=TOOLS, parallel_tool_calls=False,
                        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    message = first.choices[0].message
    (call,) = message.tool_calls
    result = {"role": "tool", "tool_call_id": call.id, "content": '{"t": 18}'}
    turn2 = [*ASK, message, result]
    answer = served.chat(messages=turn2, tools=TOOLS, tool_choice="none", max_tokens=16)
    (choice,) = answer.choices
    assert choice.message.tool_calls is None and isinstance(choice.message.content, str)
    # turn 1's prompt is a prefix of turn 2's: its full pages were found computed
    assert answer.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 4
    if served.format == "hermes":  # the template renders calls and results itself
        tok = load_tokenizer(served.folder)
        plain = [*ASK, {"role": "assistant", "content": message.content or "", "tool_calls": [
            {"id": call.id, "type": "function", "function": {
                "name": call.function.name,
                "arguments": json.loads(call.function.arguments)}}]},
            {**result, "name": "get_weather"}]
        assert answer.usage.prompt_tokens == len(tok.encode_chat(plain, True, tools=TOOLS))
    # a string of JSON or the arguments object: the same prompt
    again = json.loads(json.dumps([*ASK, message.model_dump(exclude_none=True), result]))
    again[2]["tool_calls"][0]["function"]["arguments"] = json.loads(call.function.arguments)
    same = served.chat(messages=again, tools=TOOLS, tool_choice="auto", max_tokens=16)
    assert same.usage.prompt_tokens == answer.usage.prompt_tokens
    for c in same.choices[0].message.tool_calls or ():
        _check(c)
    with pytest.raises(openai.BadRequestError, match="awaits a result") as bad:
        served.chat(messages=[*ASK, message, {**result, "tool_call_id": "call_nope"}],
                    tools=TOOLS)
    assert bad.value.param == "messages"


def test_unsupported_fields_are_refused_by_name(served: Served) -> None:
    if served.format == "hermes":
        pytest.skip("the format does not matter here")
    msgs = [{"role": "user", "content": "hi"}]
    refused = {"functions": [WEATHER["function"]], "function_call": "auto",
               "audio": {"voice": "alloy", "format": "wav"}, "modalities": ["text", "audio"],
               "prediction": {"type": "content", "content": "x"},
               "web_search_options": {}, "presence_penalty": 0.5, "frobnicate": 1}
    for name, value in refused.items():
        with pytest.raises(openai.BadRequestError) as bad:
            served.chat(messages=msgs, max_tokens=2, extra_body={name: value})
        assert bad.value.param == name and name in bad.value.message, name
    with pytest.raises(openai.BadRequestError) as bad:
        served.client.completions.create(model=served.model, prompt="x", max_tokens=2,
                                         logprobs=6)
    assert bad.value.param == "logprobs"
    for kw, param in [({"tool_choice": "required"}, "tool_choice"),
                      ({"tools": TOOLS, "tool_choice": {"type": "function",
                                                        "function": {"name": "nope"}}},
                       "tool_choice"),
                      ({"tools": TOOLS, "extra_body": {"guided_regex": "a+"}}, "tools"),
                      ({"tools": [{"type": "function", "function": {"name": "a b"}}]},
                       "tools"),
                      ({"messages": [{"role": "user", "content": [
                          {"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages"),
                      ({"extra_body": {"min_tokens": 5}}, "min_tokens")]:
        with pytest.raises(openai.BadRequestError) as bad:
            served.chat(**{"messages": msgs, "max_tokens": 2, **kw})
        assert bad.value.param == param, kw
    # harmless fields are accepted and ignored
    ok = served.chat(messages=msgs, max_tokens=2, user="u", metadata={"k": "v"}, store=False,
                     service_tier="auto", modalities=["text"])
    assert ok.choices[0].message.content is not None
    # a malformed body is still a 400
    bad_json = httpx.post(served.server.url + "/v1/chat/completions", content=b'{"model": ',
                          headers={"content-type": "application/json"}, timeout=30)
    assert bad_json.status_code == 400 and "not valid JSON" in bad_json.json()["error"]["message"]


def test_min_tokens_and_ignore_eos_fix_the_length(served: Served) -> None:
    if served.format == "hermes":
        pytest.skip("the format does not matter here")
    for extra in ({"ignore_eos": True}, {"min_tokens": 9}):
        r = served.chat(messages=ASK, max_tokens=9, temperature=0.7, seed=1, extra_body=extra)
        assert r.usage.completion_tokens == 9 and r.choices[0].finish_reason == "length"
        if "min_tokens" in extra:
            extra = {"min_tokens": 7}
        c = served.client.completions.create(model=served.model, prompt="abc", max_tokens=7,
                                             temperature=0.7, seed=1, extra_body=extra)
        assert c.usage.completion_tokens == 7


# ------------------------------------------------------------------------ the rules of a call

OPEN_NOTE = {"type": "function", "function": {  # no additionalProperties: closed anyway
    "name": "note", "description": "Write a note.", "strict": True,
    "parameters": {"type": "object", "required": ["text"],
                   "properties": {"text": {"type": "string", "maxLength": 6}}}}}
ANSWER = {"type": "object", "required": ["ok"], "properties": {"ok": {"type": "boolean"}}}


def test_none_never_calls_and_its_text_is_no_markup(served: Served) -> None:
    for seed in range(3):
        r = served.chat(messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=40,
                        temperature=1.0, seed=seed)
        (choice,) = r.choices
        assert choice.message.tool_calls is None and choice.finish_reason in ("stop",
                                                                              "length")
        if served.format == "generic":  # the answer branch's text, not its JSON
            assert not choice.message.content.startswith('{"response"')


def test_calls_hold_declared_keys_and_are_bounded(served: Served) -> None:
    tools = [OPEN_NOTE, LOOKUP]
    r = served.chat(messages=ASK, tools=tools, tool_choice="required", n=4, temperature=1.0,
                    seed=5, max_tokens=400)
    for choice in r.choices:
        calls = choice.message.tool_calls
        assert choice.finish_reason == "tool_calls" and 1 <= len(calls) <= len(tools)
        for call in calls:
            args = json.loads(call.function.arguments)
            schema = {"note": OPEN_NOTE, "lookup": LOOKUP}[call.function.name]
            jsonschema.validate(args, schema["function"]["parameters"])
            assert set(args) <= set(schema["function"]["parameters"]["properties"])
    single = served.chat(messages=ASK, tools=tools, tool_choice="required", n=2,
                         temperature=1.0, seed=6, parallel_tool_calls=False, max_tokens=400)
    assert all(len(c.message.tool_calls) == 1 for c in single.choices)


def test_a_cut_call_shows_no_markup(served: Served) -> None:
    for max_tokens in (5, 12, 20):
        r = served.chat(messages=ASK, tools=TOOLS, tool_choice="required",
                        max_tokens=max_tokens)
        (choice,) = r.choices
        assert choice.finish_reason == "length"
        assert not choice.message.content  # no '{"tool_call' nor '<tool_call>' as text
        for call in choice.message.tool_calls or ():
            _check(call)
        chunks = served.chat(messages=ASK, tools=TOOLS, tool_choice="required",
                             max_tokens=max_tokens, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ""


def test_response_format_with_tools_shapes_the_answer(served: Served) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": ANSWER}}
    r = served.chat(messages=ASK, tools=TOOLS, tool_choice="none", response_format=fmt,
                    max_tokens=60)
    jsonschema.validate(json.loads(r.choices[0].message.content), ANSWER)
    r = served.chat(messages=ASK, tools=TOOLS, response_format=fmt, n=3, temperature=1.0,
                    seed=2, max_tokens=300)
    for choice in r.choices:
        if choice.message.tool_calls:
            assert choice.finish_reason == "tool_calls"
            for call in choice.message.tool_calls:
                _check(call)
        else:
            jsonschema.validate(json.loads(choice.message.content), ANSWER)
    streamed = served.chat(messages=ASK, tools=TOOLS, tool_choice="none", response_format=fmt,
                           max_tokens=60, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    jsonschema.validate(json.loads(text), ANSWER)


def test_the_same_seed_gives_the_same_output(served: Served) -> None:
    """Nothing in the HTTP layer varies: per-choice seeds derive from the request's."""
    kw = {"messages": ASK, "tools": TOOLS, "n": 2, "temperature": 1.0, "seed": -7,
          "max_tokens": 60}
    served.chat(**kw)  # warm the prefix cache: the next two requests see the same cache

    def out(r):
        return [(c.message.content, [(t.function.name, t.function.arguments)
                                     for t in c.message.tool_calls or ()]) for c in r.choices]

    assert out(served.chat(**kw)) == out(served.chat(**kw))


def test_a_seeded_request_gives_the_same_choices_cold_warm_and_batched(served: Served) -> None:
    """The same request with a seed, n=2 and tools, at temperature 1, gives the
    same choices with a cold cache, with its prefix cached, and beside other requests."""
    from concurrent.futures import ThreadPoolExecutor

    def ask(**kw):
        r = served.chat(messages=ASK, tools=TOOLS, n=2, temperature=1.0, seed=35,
                        max_tokens=48, **kw)
        return [(c.message.content, [(t.function.name, t.function.arguments)
                                     for t in c.message.tool_calls or []], c.finish_reason)
                for c in r.choices]

    cold = ask()
    assert ask() == cold  # warm: the prompt's pages come from the cache
    with ThreadPoolExecutor(4) as pool:
        others = [pool.submit(served.chat, messages=[{"role": "user", "content": f"Tell {i}"}],
                              temperature=1.0, seed=i, max_tokens=40) for i in range(3)]
        batched = pool.submit(ask)
        assert batched.result() == cold
        assert all(o.result().choices for o in others)
