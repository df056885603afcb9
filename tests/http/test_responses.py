"""``/v1/responses`` against the official ``openai`` client and a live ``pie-ctx serve
--http`` subprocess (the tiny random model: its text is gibberish, every call is valid
only because the engine constrains it; the tests check the protocol, not the model).

Covers: plain, streamed, function tools and their round trip through
``previous_response_id``, ``text.format``, forks from an older id, stored responses
reopened after a restart computing only the new tokens, ids of other keys and missing ids
(404), server-side MCP tools on a stdio server written here (two tool rounds inside one
request), and a fuzz of hostile bodies (4xx, never 5xx).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
import jsonschema
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.http.conftest import Served

WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city.",
           "parameters": {"type": "object", "additionalProperties": False,
                          "required": ["city"],
                          "properties": {"city": {"type": "string", "maxLength": 8}}}}

def test_plain_and_streamed_answers_agree(served: Served) -> None:
    r = served.create(input="Name a colour.", instructions="Answer briefly.")
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.status in ("completed", "incomplete")
    (msg,) = r.output
    assert msg.type == "message" and msg.role == "assistant"
    assert r.usage.output_tokens > 0 and r.usage.input_tokens > 5
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    with served.client().responses.stream(model="tiny-llama", input="Name a colour.",
                                          instructions="Answer briefly.", temperature=0,
                                          max_output_tokens=8) as stream:
        events = list(stream)
    kinds = [event.type for event in events]
    final = events[-1].response  # completed, or incomplete (cut by max_output_tokens)
    assert final.output_text == r.output_text  # greedy: the same text
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    for kind in ("response.output_item.added", "response.content_part.added",
                 "response.output_text.delta", "response.output_text.done",
                 "response.output_item.done"):
        assert kind in kinds
    again = served.client().responses.retrieve(final.id)
    assert again.output_text == final.output_text and again.usage == final.usage


def test_function_call_round_trip_computes_only_the_new_items(served: Served) -> None:
    first = served.create(input="Weather in Oslo?", tools=[WEATHER], tool_choice="required",
                          parallel_tool_calls=False, max_output_tokens=200)
    (call,) = [o for o in first.output if o.type == "function_call"]
    assert call.name == "get_weather" and call.call_id
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    follow = served.create(previous_response_id=first.id, tools=[WEATHER],
                           input=[{"type": "function_call_output", "call_id": call.call_id,
                                   "output": "sunny, 21 C"}])
    assert follow.previous_response_id == first.id
    before = first.usage.input_tokens + first.usage.output_tokens
    # every token of the stored context is reused: only the tool output is computed
    assert follow.usage.input_tokens_details.cached_tokens >= before - 1
    computed = follow.usage.input_tokens - follow.usage.input_tokens_details.cached_tokens
    assert 0 < computed < 60 < before  # the tool turn's tokens, not the conversation
    # the same from an older id: a fork, the first response's snapshot is unchanged
    fork = served.create(previous_response_id=first.id, tools=[WEATHER],
                         input=[{"type": "function_call_output", "call_id": call.call_id,
                                 "output": "sunny, 21 C"}])
    assert fork.output_text == follow.output_text
    items = served.client().responses.input_items.list(follow.id, order="asc").data
    assert [i.type for i in items] == ["function_call_output"]
    # an unknown call id is the client's error
    with pytest.raises(openai.BadRequestError, match="call_nope"):
        served.create(previous_response_id=first.id, tools=[WEATHER],
                      input=[{"type": "function_call_output", "call_id": "call_nope",
                              "output": "x"}])


def test_streamed_function_call_events(served: Served) -> None:
    with served.client().responses.stream(
            model="tiny-llama", input="Weather in Oslo?", tools=[WEATHER], temperature=0,
            tool_choice="required", parallel_tool_calls=False, max_output_tokens=200) as s:
        events = list(s)
        final = s.get_final_response()
    kinds = [e.type for e in events]
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and "response.function_call_arguments.delta" in kinds
    (call,) = [o for o in final.output if o.type == "function_call"]
    assert done[0].arguments == call.arguments
    # the call's item is done before the response completes
    assert kinds.index("response.output_item.done") < kinds.index("response.completed")


def test_text_format_json_schema(served: Served) -> None:
    schema = {"type": "object", "additionalProperties": False, "required": ["colour"],
              "properties": {"colour": {"enum": ["red", "green", "blue"]}}}
    r = served.create(input="Pick a colour.", max_output_tokens=40,
                      text={"format": {"type": "json_schema", "name": "pick",
                                       "schema": schema}})
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.text.format.type == "json_schema"
    fmt = {"format": {"type": "json_schema", "name": "pick", "schema": schema}}
    # with tools, while a call is required: the call's schema rules
    called = served.create(input="Weather?", tools=[WEATHER], tool_choice="required",
                           parallel_tool_calls=False, max_output_tokens=200, text=fmt)
    assert [o.type for o in called.output] == ["function_call"]
    # with tools, free to answer: the answer follows the schema, or the server says it
    # cannot constrain its tool format's answer yet (400 naming text)
    try:
        free = served.create(input="Pick.", tools=[WEATHER], tool_choice="none",
                             max_output_tokens=60, text=fmt)
    except openai.BadRequestError as err:
        assert err.body["param"] == "text"
    else:
        jsonschema.validate(json.loads(free.output_text), schema)


def test_other_keys_missing_and_deleted_ids_are_404(served: Served) -> None:
    mine = served.create(key="alice", input="Hello.")
    with pytest.raises(openai.NotFoundError):
        served.client("bob").responses.retrieve(mine.id)
    with pytest.raises(openai.NotFoundError) as nf:
        served.create(key="bob", input="Go on.", previous_response_id=mine.id)
    assert nf.value.body["param"] == "previous_response_id"
    assert served.client("alice").responses.retrieve(mine.id).id == mine.id
    with pytest.raises(openai.NotFoundError):
        served.client("bob").responses.delete(mine.id)
    served.client("alice").responses.delete(mine.id)
    for rid in (mine.id, "resp_" + "0" * 32, "nonsense"):
        with pytest.raises(openai.NotFoundError):
            served.client("alice").responses.retrieve(rid)
    not_stored = served.create(key="alice", input="Hello.", store=False)
    with pytest.raises(openai.NotFoundError):
        served.client("alice").responses.retrieve(not_stored.id)


def test_mcp_tools_run_two_rounds_inside_one_request(served: Served) -> None:
    tool = {"type": "mcp", "server_label": "count", "require_approval": "never",
            "allowed_tools": ["tally"]}
    r = served.create(input="Tally ab twice.", tools=[tool], tool_choice="required",
                      parallel_tool_calls=False, max_tool_calls=2, max_output_tokens=300)
    kinds = [o.type for o in r.output]
    assert kinds[0] == "mcp_list_tools" and kinds.count("mcp_call") == 2, kinds
    assert [t.name for t in r.output[0].tools] == ["tally"]
    calls = [o for o in r.output if o.type == "mcp_call"]
    # the server ran both, in order: its counter says so
    assert calls[0].output.startswith("tally 1") or calls[0].output.startswith("tally ")
    n = [int(c.output.split()[1].rstrip(":")) for c in calls]
    assert n[1] == n[0] + 1 and all(c.server_label == "count" for c in calls)
    assert "function_call" not in kinds  # nothing left for the client to run
    streamed = []
    with served.client().responses.stream(
            model="tiny-llama", input="Tally cd.", tools=[tool], tool_choice="required",
            parallel_tool_calls=False, max_tool_calls=1, max_output_tokens=200,
            temperature=0) as s:
        streamed = [e.type for e in s]
    for kind in ("response.mcp_list_tools.completed", "response.mcp_call_arguments.done",
                 "response.mcp_call.in_progress", "response.mcp_call.completed"):
        assert kind in streamed
    # a follow-up continues the stored context without listing the tools again
    follow = served.create(input="And now?", tools=[tool], previous_response_id=r.id,
                           tool_choice="none")
    assert all(o.type != "mcp_list_tools" for o in follow.output)


def _raw_events(served: Served, body: dict) -> list[dict]:
    """A streamed response's events as the wire carries them (raw SSE, no client)."""
    events = []
    with httpx.stream("POST", f"{served.server.url}/v1/responses", json=body, timeout=300,
                      headers={"Authorization": "Bearer none"}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[len("data: "):]))
    return events


def test_every_item_and_event_validates_against_openais_types(served: Served) -> None:
    """Strict pydantic validation of what the wire carries, by the official library's
    own models: every stream event, the final response, its input items."""
    import pydantic
    from openai.types.responses import Response, ResponseItem, ResponseStreamEvent

    event_type = pydantic.TypeAdapter(ResponseStreamEvent)
    item_type = pydantic.TypeAdapter(ResponseItem)
    tool = {"type": "mcp", "server_label": "count", "require_approval": "never",
            "allowed_tools": ["tally"]}
    seen = set()
    for body in ({"input": "Hi.", "max_output_tokens": 6},  # text: message, parts, deltas
                 {"input": "Tally ab.", "tools": [tool], "max_tool_calls": 1,
                  "tool_choice": "required", "max_output_tokens": 200},
                 {"input": "Weather?", "tools": [WEATHER], "tool_choice": "required",
                  "max_output_tokens": 200}):
        events = _raw_events(served, {"model": "tiny-llama", "stream": True,
                                      "temperature": 0, **body})
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        for event in events:
            parsed = event_type.validate_python(event)
            assert parsed.type == event["type"]
            seen.add(event["type"])
        final = Response.model_validate(events[-1]["response"])
        assert final.status in ("completed", "incomplete") and final.output
        assert final.completed_at is not None and final.usage is not None
        stored = served.client().responses.input_items.list(final.id)
        for item in httpx.get(f"{served.server.url}/v1/responses/{final.id}/input_items",
                              headers={"Authorization": "Bearer none"}).json()["data"]:
            item_type.validate_python(item)
        assert [i.id for i in stored.data]
    assert {"response.created", "response.in_progress", "response.output_item.added",
            "response.content_part.added", "response.output_text.delta",
            "response.output_text.done", "response.content_part.done",
            "response.output_item.done", "response.mcp_list_tools.in_progress",
            "response.mcp_list_tools.completed", "response.mcp_call_arguments.delta",
            "response.mcp_call_arguments.done", "response.mcp_call.in_progress",
            "response.mcp_call.completed", "response.function_call_arguments.delta",
            "response.function_call_arguments.done"} <= seen, seen


def test_an_mcp_server_over_streamable_http(served: Served) -> None:
    r = served.create(input="Look up ab.", tools=[{"type": "mcp", "server_label": "web",
                                                   "allowed_tools": ["lookup"]}],
                      tool_choice="required", max_tool_calls=1, max_output_tokens=100)
    listed, call = r.output[0], r.output[1]
    assert listed.type == "mcp_list_tools" and [t.name for t in listed.tools] == ["lookup"]
    assert call.type == "mcp_call" and call.name == "lookup" and call.server_label == "web"
    code = json.loads(call.arguments)["code"]
    assert json.loads(call.output) == {"code": code, "value": 14}


def test_mcp_servers_are_only_the_configured_ones(served: Served) -> None:
    for tool in ({"type": "mcp", "server_label": "elsewhere"},
                 {"type": "mcp", "server_label": "count",
                  "server_url": "http://127.0.0.1:9/mcp"},
                 {"type": "mcp", "server_label": "count", "require_approval": "always"}):
        with pytest.raises(openai.BadRequestError):
            served.create(input="Hi.", tools=[tool])


def test_serve_refuses_a_bad_mcp_option(tmp_path) -> None:
    for args in (["--mcp", "no-equals-sign", "--http", "0"], ["--mcp", "x=python s.py"]):
        out = subprocess.run([sys.executable, "-m", "runtime.server", "serve", *args],
                             capture_output=True, text=True, timeout=120,
                             env={**os.environ, "XDG_DATA_HOME": str(tmp_path)})
        assert out.returncode == 2 and "--mcp" in out.stderr, out.stderr[-500:]


def test_hostile_bodies_are_4xx_never_5xx(served: Served) -> None:
    item = st.one_of(
        st.none(), st.integers(), st.text(max_size=8),
        st.fixed_dictionaries({"type": st.sampled_from(
            ["message", "function_call", "function_call_output", "mcp_call", "reasoning",
             "input_image", "bogus"])},
            optional={"role": st.sampled_from(["user", "assistant", "tool", "x"]),
                      "content": st.one_of(st.text(max_size=6), st.lists(
                          st.dictionaries(st.sampled_from(["type", "text"]),
                                          st.text(max_size=6)), max_size=2), st.integers()),
                      "call_id": st.one_of(st.text(max_size=6), st.integers()),
                      "name": st.text(max_size=6), "arguments": st.one_of(
                          st.text(max_size=8), st.just("{}"), st.integers()),
                      "output": st.one_of(st.text(max_size=6), st.none())}))
    body = st.fixed_dictionaries(
        {"model": st.sampled_from(["tiny-llama", "nope"]),
         "input": st.one_of(st.text(max_size=10), st.lists(item, max_size=4))},
        optional={"previous_response_id": st.sampled_from(["resp_x", "resp_" + "f" * 32]),
                  "tools": st.lists(st.dictionaries(st.sampled_from(
                      ["type", "name", "server_label"]), st.text(max_size=5)), max_size=2),
                  "tool_choice": st.sampled_from(["auto", "required", "bogus", None]),
                  "max_output_tokens": st.integers(-2, 3), "temperature": st.floats(-1, 3),
                  "text": st.just({"format": {"type": "json_schema"}}),
                  "metadata": st.dictionaries(st.text(max_size=3), st.integers(), max_size=2)})
    with httpx.Client(base_url=served.server.url, timeout=60) as http:

        @settings(max_examples=50, deadline=None,
                  suppress_health_check=[HealthCheck.function_scoped_fixture])
        @given(b=body)
        def check(b: dict) -> None:
            r = http.post("/v1/responses", json=b)
            assert r.status_code < 500, (r.status_code, r.text[:300])
            if r.status_code != 200:
                assert "message" in r.json()["error"]

        check()
        for raw in (b"", b"[]", b"{", b'{"model": "tiny-llama", "input": []}',
                    b'{"model": "tiny-llama", "input": "x", "background": true}'):
            r = http.post("/v1/responses", content=raw)
            assert 400 <= r.status_code < 500
        huge = {"model": "tiny-llama", "input": "x" * (5 << 20)}
        assert http.post("/v1/responses", json=huge).status_code == 413
    assert served.server.state()["stats"]["num_contexts"] == 0  # every request released


def test_a_stored_response_survives_a_restart(served: Served) -> None:
    first = served.create(input="Remember the number 7.", max_output_tokens=6)
    served.server.stop()
    served.server = served.start()  # the same snapshot directory
    follow = served.create(input="Which number?", previous_response_id=first.id)
    context = first.usage.input_tokens + first.usage.output_tokens
    assert follow.usage.input_tokens_details.cached_tokens >= context - 1
    new = follow.usage.input_tokens - follow.usage.input_tokens_details.cached_tokens
    assert 0 < new < 40 < context  # only "Which number?" and its turn's markup
    assert served.client().responses.retrieve(first.id).output_text == first.output_text
