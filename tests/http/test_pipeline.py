"""The conversation pipeline the three chat-shaped APIs share: one greedy rule, one tool
choice, one key scope (docs/http.md, "One pipeline, three APIs"). Unit tests: no server."""

from __future__ import annotations

import json

import pytest

from pie_ctx.proto.messages import SamplerSpec
from pie_ctx.tools import Tool
from runtime.fleet.sessions import session_of
from runtime.server.http.anthropic.schema import MessagesRequest
from runtime.server.http.anthropic.schema import tool_choice_of as anthropic_choice
from runtime.server.http.conversation.body import decode
from runtime.server.http.conversation.decoding import sampler_of, tool_choice_of
from runtime.server.http.conversation.errors import ApiError
from runtime.server.http.conversation.keys import ANONYMOUS, key_scope
from runtime.server.http.openai.decoding import decoding_of
from runtime.server.http.openai.schema import ChatRequest
from runtime.server.http.openai.schema import decode as decode_openai
from runtime.server.http.responses.schema import decode_request

CHAT = [{"role": "user", "content": "hi"}]


def _chat(**fields: object) -> SamplerSpec:
    req = decode_openai(json.dumps({"model": "m", "messages": CHAT, **fields}).encode(),
                        ChatRequest)
    return decoding_of(req).sampler(0)


def _messages(**fields: object) -> SamplerSpec:
    req = decode(json.dumps({"model": "m", "max_tokens": 8, "messages": CHAT,
                             **fields}).encode(), MessagesRequest, {})
    return sampler_of(req.temperature, top_p=req.top_p, top_k=req.top_k)


def _responses(**fields: object) -> SamplerSpec:
    req = decode_request(json.dumps({"model": "m", "input": "hi", **fields}).encode())
    return sampler_of(req.temperature, top_p=req.top_p, seed=req.seed)


@pytest.mark.parametrize("sampler", [_chat, _messages, _responses])
def test_every_api_is_greedy_at_exactly_zero_and_samples_above(sampler) -> None:
    assert sampler(temperature=0) == SamplerSpec()
    assert sampler(temperature=0).is_greedy
    tiny = sampler(temperature=1e-6)  # the engine clamps it; it is still a temperature
    assert not tiny.is_greedy and tiny.temperature == 1e-6
    assert sampler().temperature == 1.0  # none given: 1, as OpenAI and Anthropic
    assert sampler(top_p=0).top_p == 1.0  # 0: no nucleus


def test_the_apis_agree_on_one_request() -> None:
    fields = {"temperature": 0.5, "top_p": 0.9}
    assert _chat(**fields) == _messages(**fields) == _responses(**fields)
    assert _chat(seed=7, **fields) == _responses(seed=7, **fields)
    assert _responses(seed=-1, temperature=1).seed == (1 << 63) - 1  # modulo 2**63


def test_one_tool_choice_rule() -> None:
    tools = [Tool(name="f", parameters={"type": "object"})]
    assert tool_choice_of(None, tools) is None
    assert tool_choice_of("required", tools) == "required"
    assert tool_choice_of("named", tools, name="f") == "f"
    with pytest.raises(ApiError, match="not one of the tools"):
        tool_choice_of("named", tools, name="g")
    with pytest.raises(ApiError, match="needs 'tools'"):
        tool_choice_of("auto", [])
    assert tool_choice_of("none", [], quiet_without_tools=("none",)) is None
    req = decode(json.dumps({"model": "m", "max_tokens": 8, "messages": CHAT,
                             "tool_choice": {"type": "any",
                                             "disable_parallel_tool_use": True}}).encode(),
                 MessagesRequest, {})
    assert anthropic_choice(req, tools) == ("required", False)


def test_one_key_scope_for_the_store_and_the_fleet() -> None:
    a = {"authorization": "Bearer sekrit"}
    assert key_scope(a) == key_scope({"authorization": "bearer  sekrit "})
    assert key_scope(a).startswith("http-") and "sekrit" not in key_scope(a)
    assert key_scope(a) != key_scope({"authorization": "Bearer other"})
    assert key_scope({}) == key_scope({"authorization": "Basic xyz"}) == ANONYMOUS
    # the fleet's sessions are scoped by the same function
    assert session_of("POST", "/v1/chat/completions", {**a, "x-session-id": "u7"}, {}) == \
        f"s:{key_scope(a)}:u7"
    # OpenAI's prompt_cache_key: the same key lands on the same replica, per API key
    assert session_of("POST", "/v1/responses", a, {"prompt_cache_key": "k"}) == \
        session_of("POST", "/v1/chat/completions", a, {"prompt_cache_key": "k"}) == \
        f"pck:{key_scope(a)}:k"
    assert session_of("POST", "/v1/responses", {}, {"prompt_cache_key": "k"}) != \
        session_of("POST", "/v1/responses", a, {"prompt_cache_key": "k"})
