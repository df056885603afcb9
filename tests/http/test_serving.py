"""The server around the APIs: OpenAI's error JSON on unknown paths and methods, the
access log, vLLM's extension fields and serving endpoints (``/tokenize``, ``/detokenize``,
``/health``, ``/version``), and hostile bodies on the new endpoints (4xx, never 5xx).
Against a live ``serve --http`` with the official ``openai`` client where it has a call."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.http.test_openai import JSON, LiveServer
from tests.sdk.harness import tiny_model_folder

pytestmark = pytest.mark.fp32_only("the server's shapes, not numerics")

CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[LiveServer]:
    srv = LiveServer(str(tiny_model_folder(tmp_path_factory.mktemp("model"))),
                     str(tmp_path_factory.mktemp("srv")))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    return server.client()


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def _chat(client: openai.OpenAI, model: str, **kw):
    kw.setdefault("max_tokens", 8)
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(model=model, messages=kw.pop("messages", CHAT), **kw)


def test_unknown_paths_and_methods_get_openai_error_json(client, model, server) -> None:
    with pytest.raises(openai.NotFoundError) as nf:
        client.images.generate(model=model, prompt="x")  # not served
    assert "Invalid URL (POST /v1/images/generations)" in nf.value.message
    assert nf.value.body["code"] == "unknown_url" and nf.value.body["param"] is None
    with pytest.raises(openai.APIStatusError) as na:
        client.get("/chat/completions", cast_to=object)
    assert na.value.status_code == 405 and "allowed: POST" in na.value.message
    r = httpx.delete(server.url + "/v1/models")
    assert r.status_code == 405 and r.headers["allow"] and set(r.json()["error"]) == \
        {"message", "type", "param", "code"}


def test_one_access_log_line_per_request(client, model, server) -> None:
    r = _chat(client, model, max_tokens=3)
    httpx.get(server.url + "/no/such/path")
    want = re.compile(rf"POST /v1/chat/completions 200 [\d.]+ms prompt={r.usage.prompt_tokens} "
                      rf"completion={r.usage.completion_tokens}$")
    for _ in range(100):  # the log is read from the server's stderr by a thread
        lines = [line.strip() for line in server.log]
        if any(want.search(line) for line in lines) and \
                any("GET /no/such/path 404" in line for line in lines):
            break
        time.sleep(0.05)
    assert any(want.search(line) for line in lines), lines[-5:]
    assert any(re.search(r"GET /no/such/path 404 [\d.]+ms prompt=- completion=-", line)
               for line in lines)


def test_vllm_constraint_fields(client, model) -> None:
    schema = {"type": "object", "required": ["ok"], "properties": {"ok": {"type": "boolean"}},
              "additionalProperties": False}
    for extra in ({"guided_json": schema}, {"structured_outputs": {"json": schema}}):
        r = _chat(client, model, max_tokens=40, extra_body=extra)
        assert set(json.loads(r.choices[0].message.content)) == {"ok"}
    for extra in ({"guided_choice": ["yes", "no"]},
                  {"structured_outputs": {"choice": ["yes", "no"]}}):
        assert _chat(client, model, extra_body=extra).choices[0].message.content in \
            ("yes", "no")
    r = _chat(client, model, max_tokens=10, extra_body={"guided_regex": "[ab]{3}"})
    assert re.fullmatch("[ab]{3}", r.choices[0].message.content)
    c = client.completions.create(model=model, prompt="x", max_tokens=10, temperature=0,
                                  extra_body={"guided_regex": "[cd]{2}"})
    assert re.fullmatch("[cd]{2}", c.choices[0].text)
    r = _chat(client, model, max_tokens=40, extra_body={"structured_outputs":
                                                        {"json_object": True}})
    text = r.choices[0].message.content  # any object: the tiny model may not end it
    assert text.startswith("{") and (r.choices[0].finish_reason == "length"
                                     or isinstance(json.loads(text), dict))
    for extra, param in [({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
                         ({"structured_outputs": {"regex": "a", "choice": ["b"]}},
                          "structured_outputs"),
                         ({"repetition_penalty": 1.3}, "repetition_penalty"),
                         ({"use_beam_search": True}, "use_beam_search"),
                         ({"skip_special_tokens": False, "guided_regex": "a"},
                          "skip_special_tokens")]:
        with pytest.raises(openai.BadRequestError) as bad:
            _chat(client, model, extra_body=extra)
        assert bad.value.param == param, (extra, bad.value.message)
        assert param in bad.value.message


def test_vllm_template_and_text_fields(client, model, server) -> None:
    plain = _chat(client, model, max_tokens=6)
    same = _chat(client, model, max_tokens=6, extra_body={
        "chat_template_kwargs": {"unused_flag": True}, "repetition_penalty": 1.0,
        "skip_special_tokens": True})
    assert same.usage.prompt_tokens == plain.usage.prompt_tokens
    assert same.choices[0].message.content == plain.choices[0].message.content
    convo = [*CHAT, {"role": "assistant", "content": "Well, then"}]
    cont = _chat(client, model, messages=convo, max_tokens=4,
                 extra_body={"continue_final_message": True, "add_generation_prompt": False})
    counted = httpx.post(server.url + "/tokenize", json={
        "messages": convo, "continue_final_message": True, "add_generation_prompt": False})
    assert counted.json()["count"] == cont.usage.prompt_tokens
    closed = httpx.post(server.url + "/tokenize", json={"messages": convo}).json()
    assert closed["count"] > cont.usage.prompt_tokens  # the turn's end and a new cue
    specials = _chat(client, model, max_tokens=6, extra_body={"skip_special_tokens": False,
                                                              "ignore_eos": True})
    assert isinstance(specials.choices[0].message.content, str)
    for extra, param in [({"continue_final_message": True}, "continue_final_message"),
                         ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
                         ({"continue_final_message": True, "add_generation_prompt": True},
                          "continue_final_message")]:
        with pytest.raises(openai.BadRequestError) as bad:
            _chat(client, model, extra_body=extra)
        assert bad.value.param == param


def test_tokenize_detokenize_health_version(client, model, server) -> None:
    url = server.url
    r = _chat(client, model, max_tokens=2)
    t = httpx.post(url + "/tokenize", json={"model": model, "messages": CHAT}).json()
    assert t["count"] == len(t["tokens"]) == r.usage.prompt_tokens and t["max_model_len"] > 0
    p = httpx.post(url + "/tokenize", json={"prompt": "hello world", "add_special_tokens": False,
                                            "return_token_strs": True}).json()
    c = client.completions.create(model=model, prompt="hello world", max_tokens=1)
    assert p["count"] == c.usage.prompt_tokens and "".join(p["token_strs"]) == "hello world"
    d = httpx.post(url + "/detokenize", json={"model": model, "tokens": p["tokens"]}).json()
    assert d == {"prompt": "hello world"}
    assert httpx.get(url + "/health").status_code == 200
    assert httpx.get(url + "/version").json()["version"]
    for path, body, param in [("/tokenize", {"prompt": "a", "messages": CHAT}, "prompt"),
                              ("/tokenize", {"prompt": 3}, "prompt"),
                              ("/tokenize", {"prompt": "a", "model": "other"}, "model"),
                              ("/detokenize", {"tokens": [-1]}, "tokens"),
                              ("/detokenize", {"tokens": [10**9]}, "tokens"),
                              ("/detokenize", {"tokens": "abc"}, "tokens")]:
        bad = httpx.post(url + path, json=body)
        assert bad.status_code in (400, 404) and bad.json()["error"]["param"] == param, body


HOSTILE = st.sampled_from([10**30, -(10**30), 1e308, "x" * 5000, [1] * 2000, None, {}, [],
                           [[1]], {"type": "text"}, True])
NEW_FIELDS = ["model", "prompt", "messages", "tokens", "tools", "add_special_tokens",
              "chat_template_kwargs", "continue_final_message", "return_token_strs",
              "max_tokens", "system", "stream", "tool_choice", "stop_sequences", "thinking",
              "guided_json", "guided_regex", "guided_choice", "structured_outputs",
              "repetition_penalty", "skip_special_tokens"]


@st.composite
def hostile_bodies(draw) -> bytes:
    kind = draw(st.sampled_from(["fields", "odd", "raw", "nested"]))
    if kind == "raw":
        return draw(st.binary(max_size=64))
    if kind == "nested":
        depth = draw(st.integers(50, 5000))
        return ("{\"a\": " * depth + "1" + "}" * depth).encode()
    body: dict = {"model": "tiny-llama", "max_tokens": 2,
                  "messages": [{"role": "user", "content": "hi"}]}
    for name in draw(st.lists(st.sampled_from(NEW_FIELDS), min_size=1, max_size=3)):
        body[name] = draw(JSON if kind == "fields" else HOSTILE)
    return json.dumps(body).encode()


def test_fuzzed_bodies_on_the_new_endpoints_get_4xx(server) -> None:
    paths = ["/tokenize", "/detokenize", "/v1/messages", "/v1/messages/count_tokens",
             "/v1/chat/completions"]
    with httpx.Client(base_url=server.url, timeout=60) as http:

        @settings(max_examples=80, deadline=None,
                  suppress_health_check=[HealthCheck.function_scoped_fixture])
        @given(body=hostile_bodies(), path=st.sampled_from(paths))
        def check(body: bytes, path: str) -> None:
            r = http.post(path, content=body, headers={"content-type": "application/json"})
            if r.status_code == 200:
                return
            assert 400 <= r.status_code < 500, (path, r.status_code, r.text[:300])
            error = r.json()["error"]
            assert error["message"]
            if path.startswith("/v1/messages"):
                assert r.json()["type"] == "error" and error["type"]

        check()
        huge = http.post("/tokenize", content=b'{"prompt": "' + b"x" * (5 << 20) + b'"}')
        assert huge.status_code == 413
    stats = server.state()["stats"]
    assert stats["num_contexts"] == 0
