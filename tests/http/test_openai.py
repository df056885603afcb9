"""The OpenAI-compatible API against the official ``openai`` client and a live
``pie-ctx serve --http`` subprocess (the tiny model: its text is gibberish, but greedy
output is deterministic)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import anyio
import httpx
import jsonschema
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.sdk.harness import tiny_model_folder

READY = re.compile(r"serving HTTP on (http://\S+)")


class LiveServer:
    """``python -m runtime.server serve --http 127.0.0.1:0`` in a subprocess."""

    def __init__(self, folder: str, tmp: str, *extra: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "runtime.server", "serve", "--model", folder, "--socket",
             os.path.join(tmp, "e.sock"), "--page-size", "4", "--http", "127.0.0.1:0", *extra],
            stderr=subprocess.PIPE, text=True,
            env={**os.environ, "XDG_DATA_HOME": os.path.join(tmp, "data")})  # its own snapshots
        self.url = ""
        deadline = time.monotonic() + 120
        lines = []
        while time.monotonic() < deadline:
            line = self.proc.stderr.readline()  # type: ignore[union-attr]
            if not line:
                break
            lines.append(line)
            m = READY.search(line)
            if m:
                self.url = m.group(1)
                # Keep reading stderr (the access log), so a full pipe never blocks it.
                self.log: list[str] = lines
                threading.Thread(target=self._drain, daemon=True).start()
                return
        self.stop()
        raise RuntimeError("server did not start:\n" + "".join(lines))

    def _drain(self) -> None:
        for line in self.proc.stderr:  # type: ignore[union-attr]
            self.log.append(line)

    def client(self, key: str = "none", **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, **kw)

    def state(self) -> dict:
        return httpx.get(self.url + "/v1/pie/state", timeout=30).json()

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[LiveServer]:
    folder = str(tiny_model_folder(tmp_path_factory.mktemp("model")))
    srv = LiveServer(folder, str(tmp_path_factory.mktemp("srv")))
    yield srv
    srv.stop()
    assert srv.proc.returncode == 0  # stopped cleanly on SIGTERM


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    return server.client()


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    models = client.models.list().data
    assert len(models) == 1
    return models[0].id


CHAT = [{"role": "system", "content": "You answer briefly."},
        {"role": "user", "content": "Name a colour."}]


def test_chat_streaming_equals_non_streaming_under_greedy(client, model) -> None:
    full = client.chat.completions.create(model=model, messages=CHAT, temperature=0,
                                          max_tokens=12)
    choice = full.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
    assert full.usage.completion_tokens > 0 and full.usage.prompt_tokens > 10
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens
    stream = client.chat.completions.create(model=model, messages=CHAT, temperature=0,
                                            max_tokens=12, stream=True,
                                            stream_options={"include_usage": True})
    parts, finish, usage = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            parts.append(c.delta.content or "")
            finish = c.finish_reason or finish
    assert "".join(parts) == choice.message.content
    assert finish == choice.finish_reason
    assert usage.completion_tokens == full.usage.completion_tokens
    # the prompt was seen before: the second request found its full pages computed
    assert usage.prompt_tokens_details.cached_tokens > 0


def test_n_choices_with_a_seed_are_reproducible(client, model) -> None:
    def ask() -> list[str]:
        r = client.chat.completions.create(model=model, messages=CHAT, n=3, seed=7,
                                           temperature=1.0, max_tokens=8)
        assert [c.index for c in r.choices] == [0, 1, 2]
        return [c.message.content for c in r.choices]

    first = ask()
    assert ask() == first
    assert len(set(first)) > 1  # each choice draws with its own seed


def test_stop_strings(client, model) -> None:
    free = client.completions.create(model=model, prompt="abc def", temperature=0,
                                     max_tokens=16).choices[0].text
    assert len(free) >= 4
    stop = free[2:4]
    cut = client.completions.create(model=model, prompt="abc def", temperature=0,
                                    max_tokens=16, stop=[stop]).choices[0]
    assert cut.text == free[:free.index(stop)] and cut.finish_reason == "stop"


def test_logprobs_and_top_logprobs(client, model) -> None:
    r = client.chat.completions.create(model=model, messages=CHAT, temperature=0,
                                       max_tokens=6, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        tops = [t.logprob for t in entry.top_logprobs]
        assert tops == sorted(tops, reverse=True)
        assert entry.logprob == pytest.approx(tops[0], abs=1e-5)  # greedy took the top one
        assert entry.bytes == list(entry.token.encode())
    assert "".join(e.token for e in content) == r.choices[0].message.content


def test_json_schema_response_format_validates(client, model) -> None:
    schema = {"type": "object", "additionalProperties": False, "required": ["ok", "n"],
              "properties": {"ok": {"type": "boolean"},
                             "n": {"type": "integer", "minimum": 0, "maximum": 9}}}
    r = client.chat.completions.create(
        model=model, messages=CHAT, temperature=0, max_tokens=120,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "answer", "schema": schema}})
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    obj = client.chat.completions.create(model=model, messages=CHAT, temperature=0,
                                         max_tokens=120,
                                         response_format={"type": "json_object"})
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content), dict)


def test_completions_take_text_or_token_ids(client, model) -> None:
    text = client.completions.create(model=model, prompt="hello there", temperature=0,
                                     max_tokens=5, logprobs=2)
    c = text.choices[0]
    assert text.object == "text_completion" and c.text
    assert len(c.logprobs.tokens) == len(c.logprobs.token_logprobs) == 5
    # a dict by token text, as in OpenAI: two tokens that print alike share an entry
    assert all(1 <= len(t) <= 2 for t in c.logprobs.top_logprobs)
    ids = client.completions.create(model=model, prompt=[104, 101, 108, 108, 111],
                                    temperature=0, max_tokens=5)
    assert ids.usage.prompt_tokens == 5 and ids.choices[0].text


def test_second_turn_reports_the_first_as_cached(client, model) -> None:
    system = {"role": "system", "content": "You are a careful librarian. " * 8}
    turn1 = [system, {"role": "user", "content": "Which shelf holds maps?"}]
    r1 = client.chat.completions.create(model=model, messages=turn1, temperature=0,
                                        max_tokens=8)
    turn2 = turn1 + [{"role": "assistant", "content": r1.choices[0].message.content},
                     {"role": "user", "content": "And atlases?"}]
    r2 = client.chat.completions.create(model=model, messages=turn2, temperature=0,
                                        max_tokens=8)
    cached = r2.usage.prompt_tokens_details.cached_tokens
    assert cached >= r1.usage.prompt_tokens - 4  # all but the partly filled last page


def test_errors_have_the_right_status_and_body(server, client, model, tmp_path) -> None:
    with pytest.raises(openai.NotFoundError) as nf:
        client.chat.completions.create(model="gpt-nope", messages=CHAT)
    assert nf.value.status_code == 404 and nf.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=model, messages=CHAT, temperature=5)
    assert bad.value.param == "temperature"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model, messages=[])
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model=model, messages=CHAT,
                                       extra_body={"snapshot": "no-such-snapshot"})
    key_file = tmp_path / "key"
    keyed = LiveServer(str(tiny_model_folder(tmp_path)), str(tmp_path), "--api-key-file",
                       str(key_file))
    try:
        with pytest.raises(openai.AuthenticationError) as auth:
            keyed.client("wrong").models.list()
        assert auth.value.status_code == 401 and auth.value.code == "invalid_api_key"
        assert keyed.client(key_file.read_text().strip()).models.list().data
    finally:
        keyed.stop()


def test_32_streams_with_a_third_abandoned_leave_nothing_behind(server, model) -> None:
    async def one(i: int, aclient: openai.AsyncOpenAI) -> None:
        stream = await aclient.chat.completions.create(
            model=model, messages=[{"role": "user", "content": f"story {i % 4}"}],
            temperature=0.8, seed=i, max_tokens=24, stream=True)
        seen = 0
        async for _chunk in stream:
            seen += 1
            if i % 3 == 0 and seen == 3:
                await stream.close()  # the client goes away mid-stream
                return

    async def main() -> None:
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x",
                                      max_retries=0) as aclient:
            async with anyio.create_task_group() as tg:
                for i in range(32):
                    tg.start_soon(one, i, aclient)

    anyio.run(main)
    for _ in range(100):  # abandoned streams are cancelled as their connections close
        stats = server.state()["stats"]
        if stats["num_contexts"] == 0 and stats["num_pages_used"] == 0:
            break
        time.sleep(0.05)
    assert stats["num_contexts"] == 0 and stats["num_pages_used"] == 0, stats
    assert server.state()["pages"]["num_pages_working"] == 0


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
                    lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=20)
FIELDS = ["model", "messages", "n", "temperature", "top_p", "top_k", "min_p", "seed",
          "max_tokens", "stop", "logprobs", "top_logprobs", "response_format", "stream",
          "logit_bias", "snapshot", "prompt"]


@st.composite
def bodies(draw) -> bytes:
    kind = draw(st.sampled_from(["fields", "nested", "raw", "huge"]))
    if kind == "raw":
        return draw(st.binary(max_size=64))
    if kind == "nested":
        depth = draw(st.integers(50, 5000))
        return ("[" * depth + "]" * depth).encode()
    body = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2}
    for name in draw(st.lists(st.sampled_from(FIELDS), min_size=1, max_size=3)):
        body[name] = draw(JSON) if kind == "fields" else draw(
            st.sampled_from([10**30, -(10**30), 1e308, "x" * 5000, [1] * 2000]))
    return json.dumps(body).encode()


def test_fuzzed_bodies_get_4xx_and_the_server_lives(server, model) -> None:
    with httpx.Client(base_url=server.url, timeout=60) as http:

        @settings(max_examples=60, deadline=None,
                  suppress_health_check=[HealthCheck.function_scoped_fixture])
        @given(body=bodies(), path=st.sampled_from(["/v1/chat/completions", "/v1/completions"]))
        def check(body: bytes, path: str) -> None:
            r = http.post(path, content=body, headers={"content-type": "application/json"})
            if r.status_code == 200:  # a valid request after all: it was served
                return
            assert 400 <= r.status_code < 500, (r.status_code, r.text[:300])
            assert "message" in r.json()["error"]

        check()
        ok = http.post("/v1/chat/completions", json={"model": model, "messages": CHAT,
                                                     "max_tokens": 2})
        assert ok.status_code == 200
    stats = server.state()["stats"]
    assert stats["num_contexts"] == 0
