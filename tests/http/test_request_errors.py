"""Every 400 of a request body names the field and says what it accepts: the decoder's
messages, one per kind of mistake, and one through the served API."""

from __future__ import annotations

import json
from typing import Any

import httpx
import msgspec
import pytest

from runtime.server.http.openai.schema import (
    ACCEPTS,
    COMPLETION_ACCEPTS,
    ApiError,
    ChatRequest,
    CompletionRequest,
    decode,
)
from runtime.server.testing import serve_http_in_background
from tests.sdk.harness import tiny_engine

CHAT = [{"role": "user", "content": "hi"}]
CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


def _error(body: Any, kind: type = ChatRequest) -> ApiError:
    with pytest.raises(ApiError) as err:
        decode(json.dumps(body).encode(), kind)
    assert err.value.status == 400
    return err.value


def _chat_error(**fields: Any) -> ApiError:
    return _error({"model": "m", "messages": CHAT, **fields})


@pytest.mark.parametrize(("fields", "param", "says"), [
    ({"temperature": "hot"}, "temperature", ["'temperature' must be a number from 0 to 2",
                                             "not a string"]),
    ({"temperature": 5}, "temperature", ["'temperature' must be a number from 0 to 2"]),
    ({"temperature": True}, "temperature", ["not a boolean"]),
    ({"messages": "hi"}, "messages", ["'messages' must be a non-empty list of messages",
                                      '"role"', "not a string"]),
    ({"messages": []}, "messages", ["'messages' must be a non-empty list"]),
    ({"messages": [{"role": "bot", "content": "x"}]}, "messages",
     ["'messages[0].role' must be", '"user", "assistant" or "tool"', "not 'bot'"]),
    ({"messages": [{"content": "x"}]}, "messages", ["'messages[0].role' is required",
                                                    '"system"']),
    ({"messages": [{"role": "user", "content": 3}]}, "messages",
     ["'messages[0].content' must be a string or a list of text parts", '"type": "text"']),
    ({"messages": CHAT + [{"role": "tool", "content": "x"}]}, "messages",
     ["'messages[1].tool_call_id' is required", "the id of the tool call"]),
    ({"messages": CHAT + [{"role": "assistant", "tool_calls": [{"function": CALL["function"]}]}]},
     "messages", ["'messages[1].tool_calls[0].id' is required", '"arguments"']),
    ({"tool_choice": "any"}, "tool_choice",
     ['\'tool_choice\' must be "auto", "none", "required" or {"type": "function"', "not 'any'"]),
    ({"tool_choice": 3}, "tool_choice", ["'tool_choice' must be", "not an integer"]),
    ({"tool_choice": {"type": "function"}}, "tool_choice",
     ["'tool_choice.function' is required", '{"name": "..."}']),
    ({"tool_choice": {"type": "tool", "function": {"name": "f"}}}, "tool_choice",
     ["'tool_choice.type' must be \"function\", not 'tool'"]),
    ({"response_format": "json"}, "response_format",
     ['\'response_format\' must be {"type": "text"}, {"type": "json_object"} or', "not a string"]),
    ({"response_format": {"type": "xml"}}, "response_format",
     ['\'response_format.type\' must be "text", "json_object" or "json_schema", not \'xml\'']),
    ({"response_format": {}}, "response_format", ["'response_format.type' is required"]),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": 3}}},
     "response_format", ["'response_format.json_schema.schema' must be a JSON Schema"]),
    ({"response_format": {"type": "json_object", "schema": {}}}, "response_format",
     ["'response_format' has an unknown field 'schema'", '"json_schema": {']),
    ({"tools": [{"type": "function"}]}, "tools", ["'tools[0].function' is required",
                                                  '"parameters"']),
    ({"stop": 3}, "stop", ["'stop' must be a non-empty string or a list", "not an integer"]),
    ({"logit_bias": {"5": 200}}, "logit_bias", ["must be a number from -100 to 100"]),
    ({"max_tokens": 0}, "max_tokens", ["'max_tokens' must be an integer from 1"]),
    ({"n": 99}, "n", ["'n' must be an integer from 1 to 16"]),
])
def test_a_wrong_field_is_named_with_what_it_accepts(fields, param, says):
    err = _chat_error(**fields)
    assert err.param == param and err.type == "invalid_request_error"
    for text in says:
        assert text in err.message, err.message
    assert "Expected `" not in err.message  # msgspec's wording is translated


def test_what_is_valid_stays_valid():
    # an assistant message with no content and tool calls, then the call's result
    messages = CHAT + [{"role": "assistant", "content": None, "tool_calls": [CALL]},
                       {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    request = decode(json.dumps({"model": "m", "messages": messages}).encode(), ChatRequest)
    assert request.messages[1].content is None


def test_completions_say_their_own_meanings():
    err = _error({"model": "m", "prompt": "x", "logprobs": 9}, CompletionRequest)
    assert err.param == "logprobs" and "an integer from 0 to 5" in err.message
    err = _error({"model": "m", "prompt": 3}, CompletionRequest)
    assert "'prompt' must be a string, a list of strings, a list of token ids" in err.message
    err = _error({"model": "m"}, CompletionRequest)
    assert err.message.startswith("'prompt' is required: a string")
    assert "must be a JSON object" in _error([], CompletionRequest).message
    assert '"messages": [...]' in _error([]).message


def _fields(kind: type) -> list[str]:
    return [f.name for f in msgspec.structs.fields(kind) if f.type is not Any]


def test_every_checked_field_says_what_it_accepts():
    assert not [name for name in _fields(ChatRequest) if name not in ACCEPTS]
    assert not [name for name in _fields(CompletionRequest) if name not in COMPLETION_ACCEPTS]


@pytest.mark.fp32_only("the HTTP error body only")
async def test_the_served_400_carries_the_message_and_param(tiny_folder) -> None:
    async with tiny_engine(tiny_folder) as engine, \
            serve_http_in_background(engine) as url, \
            httpx.AsyncClient(base_url=url) as http:
        model = (await http.get("/v1/models")).json()["data"][0]["id"]
        r = await http.post("/v1/chat/completions", json={
            "model": model, "messages": CHAT, "tool_choice": "any"})
        assert r.status_code == 400
        error = r.json()["error"]
        assert error["param"] == "tool_choice" and error["type"] == "invalid_request_error"
        assert '"auto", "none", "required"' in error["message"]
