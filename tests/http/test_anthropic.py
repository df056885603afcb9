"""Anthropic's Messages API (``/v1/messages``) against the official ``anthropic`` client and
a live ``serve --http``: plain, with a system prompt, streamed, with a tool and the
``tool_result`` round trip, errors in Anthropic's shape, and ``x-api-key``.

The tiny random model writes nonsense; a call is valid only because the engine constrains
it to the tool's schema (strings bounded so that a call always ends)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import anthropic
import httpx
import jsonschema
import pytest

from tests.http.test_openai import LiveServer
from tests.sdk.harness import tiny_model_folder

pytestmark = pytest.mark.fp32_only("the protocol's shapes, not numerics")

WEATHER = {"name": "get_weather", "description": "Current weather in a city.",
           "input_schema": {"type": "object", "required": ["city"],
                            "properties": {"city": {"type": "string", "maxLength": 8}}}}
ASK = [{"role": "user", "content": "Weather in Oslo?"}]
GREEDY = {"temperature": 0}  # older clients send it; the newest one has no such argument


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[LiveServer]:
    srv = LiveServer(str(tiny_model_folder(tmp_path_factory.mktemp("model"))),
                     str(tmp_path_factory.mktemp("srv")))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server: LiveServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def model(server: LiveServer) -> str:
    return server.client().models.list().data[0].id


def test_plain_and_system(client, model, server) -> None:
    m = client.messages.create(model=model, max_tokens=6, messages=ASK, extra_body=GREEDY)
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert m.stop_reason in ("end_turn", "max_tokens") and m.content[0].type == "text"
    assert m.usage.output_tokens <= 6
    again = client.messages.create(model=model, max_tokens=6, messages=ASK, extra_body=GREEDY)
    assert again.content[0].text == m.content[0].text
    assert again.usage.cache_read_input_tokens > 0  # the prefix cache found the prompt
    systemed = client.messages.create(model=model, max_tokens=2, messages=ASK,
                                      system=[{"type": "text", "text": "Be brief."}])
    total = systemed.usage.input_tokens + systemed.usage.cache_read_input_tokens
    assert total > m.usage.input_tokens + m.usage.cache_read_input_tokens
    counted = client.messages.count_tokens(model=model, messages=ASK, system="Be brief.")
    assert counted.input_tokens == total
    stopped = client.messages.create(model=model, max_tokens=30, messages=ASK,
                                     extra_body=GREEDY, stop_sequences=[m.content[0].text[2:4]])
    if stopped.stop_reason == "stop_sequence":
        assert stopped.stop_sequence == m.content[0].text[2:4]


def test_ignore_eos_runs_the_answer_to_its_budget(client, model) -> None:
    """The extension ``ignore_eos`` (as on the chat API): the end of turn no longer stops
    the greedy answer, which goes on from the same tokens up to ``max_tokens``."""
    go_on = [{"role": "user", "content": "Go on."}]
    ended = client.messages.create(model=model, max_tokens=200, messages=go_on,
                                   extra_body=GREEDY)
    run = client.messages.create(model=model, max_tokens=200, messages=go_on,
                                 extra_body={**GREEDY, "ignore_eos": True})
    assert run.stop_reason == "max_tokens" and run.usage.output_tokens == 200
    assert run.content[0].text.startswith(ended.content[0].text)
    with pytest.raises(anthropic.BadRequestError, match="ignore_eos"):
        client.messages.create(model=model, max_tokens=2, messages=go_on,
                               extra_body={"ignore_eos": "yes"})


def test_streamed_events_match_the_whole_message(client, model) -> None:
    whole = client.messages.create(model=model, max_tokens=8, messages=ASK, extra_body=GREEDY)
    kinds, text = [], ""
    with client.messages.stream(model=model, max_tokens=8, messages=ASK,
                                extra_body=GREEDY) as stream:
        for event in stream:
            kinds.append(event.type)
            if event.type == "content_block_delta" and event.delta.type == "text_delta":
                text += event.delta.text
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "content_block_start" in kinds and "content_block_stop" in kinds
    assert "message_delta" in kinds
    assert text == whole.content[0].text == final.content[0].text
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_tool_use_and_the_tool_result_round_trip(client, model) -> None:
    m = client.messages.create(model=model, max_tokens=300, messages=ASK, tools=[WEATHER],
                               tool_choice={"type": "any", "disable_parallel_tool_use": True},
                               extra_body=GREEDY)
    assert m.stop_reason == "tool_use"
    (use,) = [b for b in m.content if b.type == "tool_use"]
    assert use.name == "get_weather"
    jsonschema.validate(use.input, WEATHER["input_schema"])
    assert set(use.input) == {"city"}  # no undeclared key
    # streamed: the call as input_json_delta, the same call
    with client.messages.stream(model=model, max_tokens=300, messages=ASK, tools=[WEATHER],
                                tool_choice={"type": "tool", "name": "get_weather",
                                             "disable_parallel_tool_use": True},
                                extra_body=GREEDY) as stream:
        deltas = [e.delta.partial_json for e in stream
                  if e.type == "content_block_delta" and e.delta.type == "input_json_delta"]
        final = stream.get_final_message()
    streamed = [b for b in final.content if b.type == "tool_use"]
    assert len(deltas) == len(streamed) == 1 and final.stop_reason == "tool_use"
    assert streamed[0].input == use.input  # greedy: the same call
    # the round trip: the call's message back as it is, then the result
    answer = client.messages.create(model=model, max_tokens=12, tools=[WEATHER], messages=[
        *ASK, {"role": "assistant", "content": m.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                      "content": "18 C, clear"}]}],
        tool_choice={"type": "none"})
    assert answer.stop_reason in ("end_turn", "max_tokens")
    assert [b.type for b in answer.content] == ["text"]
    assert answer.usage.cache_read_input_tokens >= m.usage.input_tokens - 4
    with pytest.raises(anthropic.BadRequestError, match="awaits a result"):
        client.messages.create(model=model, max_tokens=2, tools=[WEATHER], messages=[
            *ASK, {"role": "assistant", "content": m.content},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_no",
                                          "content": "x"}]}])


def test_output_config_shapes_the_answer_beside_tools(client, model) -> None:
    schema = {"type": "object", "required": ["ok"], "additionalProperties": False,
              "properties": {"ok": {"type": "boolean"}}}
    m = client.messages.create(model=model, max_tokens=40, messages=ASK, tools=[WEATHER],
                               tool_choice={"type": "none"}, output_config={
                                   "format": {"type": "json_schema", "schema": schema},
                                   "effort": "low"})
    jsonschema.validate(json.loads(m.content[0].text), schema)


def test_errors_are_anthropic_shaped(client, model, server) -> None:
    with pytest.raises(anthropic.NotFoundError) as nf:
        client.messages.create(model="nope", max_tokens=2, messages=ASK)
    assert nf.value.body["type"] == "error"
    assert nf.value.body["error"]["type"] == "not_found_error"
    assert "nope" in nf.value.body["error"]["message"]
    for kw in ({"max_tokens": 0}, {"thinking": {"type": "enabled", "budget_tokens": 1024}},
               {"messages": [{"role": "user", "content": [
                   {"type": "image", "source": {"type": "url", "url": "x"}}]}]},
               {"tool_choice": {"type": "tool", "name": "nope"}, "tools": [WEATHER]}):
        with pytest.raises(anthropic.BadRequestError) as bad:
            client.messages.create(**{"model": model, "max_tokens": 2, "messages": ASK, **kw})
        assert bad.value.body["error"]["type"] == "invalid_request_error"
    r = httpx.get(server.url + "/v1/messages")
    assert r.status_code == 405 and r.json()["type"] == "error"


def test_x_api_key_is_accepted_and_the_log_can_be_off(tmp_path) -> None:
    key_file = tmp_path / "key"  # generated by the server
    srv = LiveServer(str(tiny_model_folder(tmp_path)), str(tmp_path), "--api-key-file",
                     str(key_file), "--no-access-log")
    try:
        key = key_file.read_text().strip()
        model = srv.client(key).models.list().data[0].id
        good = anthropic.Anthropic(base_url=srv.url, api_key=key, max_retries=0)
        assert good.messages.create(model=model, max_tokens=2, messages=ASK).content
        bad = anthropic.Anthropic(base_url=srv.url, api_key="wrong", max_retries=0)
        with pytest.raises(anthropic.AuthenticationError) as auth:
            bad.messages.create(model=model, max_tokens=2, messages=ASK)
        assert auth.value.body["error"]["type"] == "authentication_error"
        assert httpx.get(srv.url + "/health").status_code == 200  # no key: no data
    finally:
        srv.stop()
    assert not [line for line in srv.log if "/v1/messages" in line]
