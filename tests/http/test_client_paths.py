"""What clients of ``serve --http`` rely on without asking: an abandoned request stops
computing, one default output limit, no call markup from a history without tools,
Responses in the metrics and the access log, ASCII regex classes, the input-token count,
vLLM's message and stop fields, CORS. Against a live server (the tiny model, whose text is
gibberish), with the official clients and raw HTTP."""

from __future__ import annotations

import json
import re
import socket
import time
from collections.abc import Iterator
from urllib.parse import urlparse

import anthropic
import httpx
import openai
import pytest

from tests.http.test_openai import LiveServer
from tests.sdk.harness import tiny_model_folder

MODEL = "tiny-llama"
ORIGIN = "http://app.example"
CONTEXT = 4096  # the tiny model's (tests/sdk/harness.py)
DEFAULT_LIMIT = 2048  # runtime/server/http/limits.py, docs/http.md


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[LiveServer]:
    folder = str(tiny_model_folder(tmp_path_factory.mktemp("model")))
    srv = LiveServer(folder, str(tmp_path_factory.mktemp("srv")), "--cors-origin", ORIGIN)
    yield srv
    srv.stop()
    assert srv.proc.returncode == 0


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    return server.client(timeout=600)


def _metrics(server: LiveServer) -> str:
    return httpx.get(server.url + "/metrics", timeout=60).text


def _steps(server: LiveServer) -> float:
    """The engine's steps so far (counted as they run; a job's tokens are counted when it
    ends)."""
    m = re.search(r"^pie_ctx_model_steps_total (\S+)$", _metrics(server), re.M)
    assert m is not None
    return float(m.group(1))


def _log_lines(server: LiveServer, needle: str) -> list[str]:
    return [line for line in list(server.log) if needle in line]


# ----------------------------------------------------------- abandoned requests

ABANDONED = {
    "/v1/chat/completions": {"model": MODEL, "max_tokens": 4000, "ignore_eos": True,
                             "temperature": 0, "messages": [{"role": "user",
                                                             "content": "Go on."}]},
    "/v1/completions": {"model": MODEL, "max_tokens": 4000, "ignore_eos": True,
                        "temperature": 0, "prompt": "Go on."},
    "/v1/responses": {"model": MODEL, "max_output_tokens": 4000, "ignore_eos": True,
                      "temperature": 0, "store": False, "input": "Go on."},
    "/v1/messages": {"model": MODEL, "max_tokens": 4000, "ignore_eos": True,
                     "temperature": 0, "messages": [{"role": "user", "content": "Go on."}]},
}


@pytest.mark.parametrize("path", list(ABANDONED))
def test_an_abandoned_non_streamed_request_stops_generating(server, path) -> None:
    """A raw client sends a long non-streamed request, waits until the engine generates
    for it, and closes the connection: the engine stops within a few steps (not the 4,000
    tokens asked), the context is released, and the access log says 499."""
    url = urlparse(server.url)
    body = json.dumps(ABANDONED[path]).encode()
    before = _steps(server)
    sock = socket.create_connection((url.hostname, url.port))
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {url.netloc}\r\nContent-Type: "
                 f"application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
    deadline = time.monotonic() + 300
    while _steps(server) - before < 16:  # it is generating
        assert time.monotonic() < deadline, "the request never started generating"
        time.sleep(0.02)
    sock.close()
    closed = _steps(server)
    deadline = time.monotonic() + 30
    while server.state()["stats"]["num_contexts"]:
        assert time.monotonic() < deadline, "the abandoned request still holds a context"
        time.sleep(0.05)
    stopped = _steps(server)
    time.sleep(0.5)
    assert _steps(server) == stopped  # nothing runs any more
    # a few steps after the close (the steps a scrape takes to come back, under load)
    assert stopped - closed < 64, (closed, stopped)
    assert stopped - before < 1000
    deadline = time.monotonic() + 10
    while not _log_lines(server, f"POST {path} 499"):
        assert time.monotonic() < deadline, "no access-log line with 499"
        time.sleep(0.05)
    assert re.search(rf'pie_ctx_http_requests_total{{endpoint="{path}",status="499"}} [1-9]',
                     _metrics(server))


# ------------------------------------------------------------------- output limit


def test_one_default_output_limit_on_chat_and_responses(client) -> None:
    chat = client.chat.completions.create(
        model=MODEL, temperature=0, messages=[{"role": "user", "content": "Hi."}],
        extra_body={"ignore_eos": True})
    assert chat.usage.completion_tokens == DEFAULT_LIMIT
    assert chat.choices[0].finish_reason == "length"
    r = client.responses.create(model=MODEL, temperature=0, input="Hi.", store=False,
                                extra_body={"ignore_eos": True})
    assert r.usage.output_tokens == DEFAULT_LIMIT
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"


def test_the_default_limit_is_capped_by_the_context(server, client) -> None:
    """A prompt leaving fewer tokens than the default: answered up to the context's end."""
    text = "x" * 3000
    n = httpx.post(server.url + "/tokenize", timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": text}]}).json()["count"]
    assert CONTEXT - DEFAULT_LIMIT < n < CONTEXT - 8
    chat = client.chat.completions.create(
        model=MODEL, temperature=0, messages=[{"role": "user", "content": text}],
        extra_body={"ignore_eos": True})
    assert chat.usage.prompt_tokens == n
    assert chat.usage.completion_tokens == CONTEXT - n
    assert chat.choices[0].finish_reason == "length"
    done = client.completions.create(model=MODEL, prompt=text, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert done.usage.completion_tokens == CONTEXT - done.usage.prompt_tokens


# ------------------------------------------------------- tool history without tools

HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "22 C, sunny"},
    {"role": "user", "content": "And now?"},
]
MARKUP = ('{"tool_call"', '"tool_calls"', "<tool_call>", '{"response"')


@pytest.mark.parametrize("tools", [None, []])
def test_a_tool_history_without_tools_is_plain_text(server, client, tools) -> None:
    """The prompt a chat request builds from a history with calls but no tools holds no
    call markup for the model to copy, only what happened, in words."""
    body: dict = {"model": MODEL, "messages": HISTORY}
    if tools is not None:
        body["tools"] = tools
    tokens = httpx.post(server.url + "/tokenize", json=body, timeout=60).json()["tokens"]
    prompt = httpx.post(server.url + "/detokenize", json={"model": MODEL, "tokens": tokens},
                        timeout=60).json()["prompt"]
    assert not [m for m in MARKUP if m in prompt], prompt
    assert 'Called get_weather with {"city": "Paris"}.' in prompt
    assert "Result of get_weather: 22 C, sunny" in prompt
    kw = {} if tools is None else {"tools": tools}
    chat = client.chat.completions.create(model=MODEL, messages=HISTORY, max_tokens=8,
                                          temperature=0, **kw)
    assert chat.choices[0].message.tool_calls is None
    assert chat.usage.prompt_tokens == len(tokens)


def test_a_responses_tool_history_without_tools_is_the_same_plain_text(server, client
                                                                       ) -> None:
    items = [{"role": "user", "content": "Weather in Paris?"},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather",
              "arguments": '{"city": "Paris"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "22 C, sunny"},
             {"role": "user", "content": "And now?"}]
    plain = httpx.post(server.url + "/tokenize", json={"model": MODEL, "messages": HISTORY},
                       timeout=60).json()["count"]
    r = client.responses.create(model=MODEL, input=items, tools=[], max_output_tokens=4,
                                temperature=0, store=False)
    assert r.usage.input_tokens == plain
    assert all(o.type == "message" for o in r.output)


# --------------------------------------------------------- metrics and access log


def test_responses_and_messages_are_in_the_metrics_and_the_access_log(server, client
                                                                       ) -> None:
    r = client.responses.create(model=MODEL, input="Hi.", max_output_tokens=3,
                                temperature=0, store=False)
    a = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)
    m = a.messages.create(model=MODEL, max_tokens=3,
                          messages=[{"role": "user", "content": "Hi."}])
    text = _metrics(server)
    for path in ("/v1/responses", "/v1/messages"):
        assert re.search(rf'pie_ctx_http_requests_total{{endpoint="{path}",status="200"}} '
                         r'[1-9]', text), path
    deadline = time.monotonic() + 10
    while not (_log_lines(server, "POST /v1/responses 200")
               and _log_lines(server, "POST /v1/messages 200")):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    line = _log_lines(server, "POST /v1/responses 200")[-1]
    assert line.rstrip().endswith(f"prompt={r.usage.input_tokens} "
                                  f"completion={r.usage.output_tokens}"), line
    line = _log_lines(server, "POST /v1/messages 200")[-1]
    prompt = m.usage.input_tokens + m.usage.cache_read_input_tokens
    assert line.rstrip().endswith(f"prompt={prompt} completion={m.usage.output_tokens}")


# ------------------------------------------------------------------- regex classes


def test_regex_classes_are_ascii_as_in_vllm(client) -> None:
    """``\\d``, ``\\w``, ``\\s`` are ASCII (xgrammar's and outlines' classes): sampled
    answers of the tiny model, which would otherwise pick any Unicode digit."""
    pattern = r"\d{3}-\d{4} \w{3}\s\S"
    chat = client.chat.completions.create(
        model=MODEL, n=8, seed=5, temperature=1.0, max_tokens=40,
        messages=[{"role": "user", "content": "A phone number."}],
        extra_body={"guided_regex": pattern})
    expected = r"[0-9]{3}-[0-9]{4} [a-zA-Z0-9_]{3}[\t\n\x0b\x0c\r \xa0][^\t\n\x0b\x0c\r \xa0]"
    for c in chat.choices:
        assert re.fullmatch(expected, c.message.content), c.message.content


# ------------------------------------------------------------------- smaller items


def test_the_input_token_count_endpoint(client) -> None:
    count = client.responses.input_tokens.count(model=MODEL, input="How many tokens?",
                                                instructions="Be brief.")
    assert count.object == "response.input_tokens"
    r = client.responses.create(model=MODEL, input="How many tokens?", instructions="Be brief.",
                                max_output_tokens=1, temperature=0, store=True)
    assert count.input_tokens == r.usage.input_tokens > 0
    follow = client.responses.input_tokens.count(model=MODEL, input="And then?",
                                                 instructions="Be brief.",
                                                 previous_response_id=r.id)
    assert follow.input_tokens > count.input_tokens
    assert client.responses.input_tokens.count(input="Hi.").input_tokens > 0  # no model
    # no input: the previous response's whole context (prompt and answer), cued
    alone = client.responses.input_tokens.count(model=MODEL, instructions="Be brief.",
                                                previous_response_id=r.id)
    assert r.usage.input_tokens < alone.input_tokens < follow.input_tokens


def test_reasoning_fields_are_accepted_and_left_out_of_the_prompt(server) -> None:
    def count(extra: dict) -> int:
        reply = httpx.post(server.url + "/v1/chat/completions", timeout=120, json={
            "model": MODEL, "max_tokens": 1, "temperature": 0, "messages": [
                {"role": "user", "content": "Hi."},
                {"role": "assistant", "content": "Hello.", **extra},
                {"role": "user", "content": "Bye."}]})
        assert reply.status_code == 200, reply.text
        return reply.json()["usage"]["prompt_tokens"]

    plain = count({})
    assert count({"reasoning_content": "the user greets me"}) == plain
    assert count({"reasoning": "the user greets me"}) == plain


def test_include_stop_str_in_output(client) -> None:
    kw = dict(model=MODEL, temperature=0, max_tokens=20, stop=["STOP"],
              messages=[{"role": "user", "content": "Say it."}])
    forced = {"guided_regex": "ab STOP cd"}
    without = client.chat.completions.create(**kw, extra_body=forced)
    assert without.choices[0].message.content == "ab "
    assert without.choices[0].finish_reason == "stop"
    with_stop = client.chat.completions.create(
        **kw, extra_body={**forced, "include_stop_str_in_output": True})
    assert with_stop.choices[0].message.content == "ab STOP"
    chunks = client.chat.completions.create(
        **kw, stream=True, extra_body={**forced, "include_stop_str_in_output": True})
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "ab STOP"


def test_cors_preflight_is_answered_for_the_configured_origin(server) -> None:
    headers = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
               "Access-Control-Request-Headers": "authorization, content-type"}
    ok = httpx.options(server.url + "/v1/chat/completions", headers=headers, timeout=30)
    assert ok.status_code == 200
    assert ok.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in ok.headers["access-control-allow-methods"]
    other = httpx.options(server.url + "/v1/chat/completions", timeout=30,
                          headers={**headers, "Origin": "http://elsewhere.example"})
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    reply = httpx.get(server.url + "/v1/models", headers={"Origin": ORIGIN}, timeout=30)
    assert reply.headers["access-control-allow-origin"] == ORIGIN
