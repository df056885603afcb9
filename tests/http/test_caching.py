"""Caching HTTP clients steer (docs/http.md, "Caching clients steer"), through the official
``anthropic`` and ``openai`` clients against a live ``serve --http``: Anthropic's
``cache_control`` and OpenAI's ``prompt_cache_retention`` hold a prompt through pressure
that evicts an unheld one, usage splits the prompt exactly, a turn that ends in tool calls
is held while the client runs them, and one key cannot take every held page.

The tiny model's tokens are bytes, so a prompt of N characters is about N tokens; pages
hold 4 tokens, the pool 1,200 pages, and the engine's budget of held pages is a quarter of
it (300 pages), half of that per key. The disk cache is off (``--disk-cache-gb 0``): an
evicted unheld page is gone, a held one would go to disk."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator

import anthropic
import httpx
import openai
import pytest

from runtime.server.http.anthropic.schema import TOOLS, MessagesRequest, cache_points
from runtime.server.http.conversation.body import decode
from runtime.server.http.conversation.errors import ApiError
from tests.http.test_openai import LiveServer
from tests.sdk.harness import tiny_model_folder

pytestmark = pytest.mark.fp32_only("the protocol's cache accounting, not numerics")

SYSTEM_A = "Rules of the archive: " + " ".join(f"a{i:02d}" for i in range(30))  # ~140 chars
SYSTEM_B = "Rules of the library: " + " ".join(f"b{i:02d}" for i in range(30))
PROMPT_C = "Catalogue entries: " + " ".join(f"c{i:02d}" for i in range(28))
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "required": ["city"],
                                          "properties": {"city": {"type": "string",
                                                                  "maxLength": 6}}}}}


def _start(tmp_path_factory, *extra: str) -> LiveServer:
    return LiveServer(str(tiny_model_folder(tmp_path_factory.mktemp("model"))),
                      str(tmp_path_factory.mktemp("srv")), "--num-pages", "1200", "--disk-cache-gb", "0", *extra)


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[LiveServer]:
    srv = _start(tmp_path_factory)
    yield srv
    srv.stop()


def claude(server: LiveServer, key: str = "a") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=key, max_retries=0)


def metric(server: LiveServer, name: str) -> float:
    text = httpx.get(server.url + "/metrics", timeout=30).text
    m = re.search(rf"^{name}(?:{{[^}}]*all[^}}]*}})? ([0-9.e+]+)$", text, re.M)
    assert m, name
    return float(m.group(1))


def ask_a(server: LiveServer) -> anthropic.types.Message:
    return claude(server).messages.create(
        model="tiny-llama", max_tokens=1, extra_body={"temperature": 0},
        system=[{"type": "text", "text": SYSTEM_A, "cache_control": {"type": "ephemeral",
                                                                     "ttl": "1h"}}],
        messages=[{"role": "user", "content": "Hi."}])


def flood(server: LiveServer, n: int = 20) -> None:
    """Prompts of ~300 tokens each, unheld: together more than the pool."""
    chat = server.client("flood")
    for i in range(n):
        chat.chat.completions.create(model="tiny-llama", max_tokens=1, messages=[
            {"role": "user", "content": f"{i} " + " ".join(f"f{i}{j:03d}" for j in range(60))}])


def test_breakpoints_in_prompt_order() -> None:
    """Where each breakpoint holds up to: the tools, the system prompt, a message's end (a
    block's anywhere in it, a tool result's inner block too), the request's own: the last
    message."""
    ephemeral, hour = {"type": "ephemeral"}, {"type": "ephemeral", "ttl": "1h"}
    body = {"model": "m", "max_tokens": 1, "cache_control": ephemeral,
            "tools": [{"name": "f", "input_schema": {"type": "object"},
                       "cache_control": hour}],
            "system": [{"type": "text", "text": "s", "cache_control": hour}],
            "messages": [{"role": "user", "content": [
                {"type": "text", "text": "a", "cache_control": ephemeral},
                {"type": "text", "text": "b"}]},
                {"role": "assistant", "content": "ok"},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                              "content": [{"type": "text", "text": "r"}]}]}]}
    req = decode(json.dumps(body).encode(), MessagesRequest, {})
    assert cache_points(req) == [(TOOLS, 3600.0), (-1, 3600.0), (0, 300.0), (2, 300.0)]
    body["messages"][2]["content"][0]["content"][0]["cache_control"] = ephemeral
    req = decode(json.dumps(body).encode(), MessagesRequest, {})
    with pytest.raises(ApiError, match="maximum of 4"):
        cache_points(req)


def test_held_prompts_outlive_pressure_that_evicts_an_unheld_one(server) -> None:
    first = ask_a(server)
    u = first.usage
    counted = claude(server).messages.count_tokens(
        model="tiny-llama", system=SYSTEM_A, messages=[{"role": "user", "content": "Hi."}])
    assert u.input_tokens + u.cache_creation_input_tokens + u.cache_read_input_tokens == \
        counted.input_tokens
    held = u.cache_read_input_tokens + u.cache_creation_input_tokens  # up to the breakpoint
    assert u.cache_creation_input_tokens > 100 and 0 < u.input_tokens < 40
    b = claude(server, "b").messages.create(
        model="tiny-llama", max_tokens=1, extra_body={"temperature": 0}, system=SYSTEM_B,
        messages=[{"role": "user", "content": "Hi."}])
    assert b.usage.cache_creation_input_tokens == 0  # no breakpoint: nothing held
    c = server.client("c").chat.completions.create(
        model="tiny-llama", max_tokens=1, messages=[{"role": "user", "content": PROMPT_C}],
        extra_body={"prompt_cache_retention": "24h"})
    assert metric(server, "pie_ctx_holds") >= 2
    flood(server)
    again = ask_a(server).usage
    assert again.cache_read_input_tokens >= held - 4  # every whole page up to the breakpoint
    assert again.cache_creation_input_tokens == max(0, held - again.cache_read_input_tokens)
    c2 = server.client("c").chat.completions.create(
        model="tiny-llama", max_tokens=1, messages=[{"role": "user", "content": PROMPT_C}])
    assert c2.usage.prompt_tokens_details.cached_tokens >= c.usage.prompt_tokens - 4
    b2 = claude(server, "b").messages.create(
        model="tiny-llama", max_tokens=1, extra_body={"temperature": 0}, system=SYSTEM_B,
        messages=[{"role": "user", "content": "Hi."}])
    assert b2.usage.cache_read_input_tokens < b.usage.input_tokens // 2  # evicted


def test_asking_again_refreshes_the_hold_instead_of_adding_one(server) -> None:
    ask_a(server)
    holds = metric(server, "pie_ctx_holds")
    ask_a(server)
    assert metric(server, "pie_ctx_holds") == holds


def test_bad_cache_requests_are_400s_naming_the_field(server) -> None:
    base = {"model": "tiny-llama", "max_tokens": 1, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "x",
                                      "cache_control": {"type": "ephemeral", "ttl": "2h"}}]}]}
    with pytest.raises(anthropic.BadRequestError, match="cache_control.ttl"):
        claude(server).messages.create(**base)
    five = [{"type": "text", "text": str(i), "cache_control": {"type": "ephemeral"}}
            for i in range(5)]
    with pytest.raises(anthropic.BadRequestError, match="maximum of 4 blocks"):
        claude(server).messages.create(model="tiny-llama", max_tokens=1,
                                       messages=[{"role": "user", "content": five}])
    with pytest.raises(openai.BadRequestError, match="prompt_cache_retention"):
        server.client().chat.completions.create(
            model="tiny-llama", max_tokens=1, messages=[{"role": "user", "content": "x"}],
            extra_body={"prompt_cache_retention": "1w"})


def test_a_turn_that_ends_in_tool_calls_is_held_while_the_client_runs_them(server) -> None:
    before = metric(server, "pie_ctx_holds")
    r = server.client("tools").chat.completions.create(
        model="tiny-llama", max_tokens=200, temperature=0, tools=[WEATHER],
        tool_choice="required",
        messages=[{"role": "user", "content": "Weather in Oslo?"}])
    assert r.choices[0].finish_reason == "tool_calls"
    assert metric(server, "pie_ctx_holds") == before + 1
    # (another key: a key's share counts its holds on every API, and the chat turn's
    # context took most of this one's)
    resp = server.client("tools2").responses.create(
        model="tiny-llama", input="Weather in Rome?", max_output_tokens=200, temperature=0,
        tool_choice="required", tools=[{"type": "function", **WEATHER["function"]}])
    assert resp.output[-1].type == "function_call"
    assert metric(server, "pie_ctx_holds") == before + 2
    plain = server.client("tools3").responses.create(  # (a key of its own, as above)
        model="tiny-llama", input="Hi.", max_output_tokens=2, temperature=0,
        prompt_cache_retention="in_memory")
    assert plain.status in ("completed", "incomplete")
    assert metric(server, "pie_ctx_holds") == before + 3


def test_one_key_cannot_take_every_held_page(tmp_path_factory) -> None:
    srv = _start(tmp_path_factory, "--tool-hold", "0")

    def retained(key: str, i: int) -> int:
        """Ask ``key`` to hold a ~67-page prompt; its pages."""
        r = srv.client(key).chat.completions.create(
            model="tiny-llama", max_tokens=1, extra_body={"prompt_cache_retention": "24h"},
            messages=[{"role": "user", "content": f"{key} {i} " + "x" * 240}])
        return r.usage.prompt_tokens // 4

    try:
        pages = [retained("greedy", i) for i in range(4)]
        # alone, all four would fit the engine's budget, and leave no room for another key
        assert pages[0] + pages[1] <= 150 < sum(pages[:3]) and sum(pages) <= 300
        assert sum(pages) + pages[0] > 300
        assert metric(srv, "pie_ctx_holds") == 2  # the key's half: the first two
        assert metric(srv, "pie_ctx_pages_held") <= 150
        retained("other", 0)
        assert metric(srv, "pie_ctx_holds") == 3  # the other key still got its hold
        # --tool-hold 0: a turn ending in calls takes no hold
        r = srv.client("tools").chat.completions.create(
            model="tiny-llama", max_tokens=200, temperature=0, tools=[WEATHER],
            tool_choice="required",
            messages=[{"role": "user", "content": "Weather in Oslo?"}])
        assert r.choices[0].finish_reason == "tool_calls"
        assert metric(srv, "pie_ctx_holds") == 3
    finally:
        srv.stop()


def test_serve_refuses_a_bad_tool_hold(tmp_path) -> None:
    for value in ("-1", "99999", "nan"):
        out = subprocess.run([sys.executable, "-m", "runtime.server", "serve", "--http", "0",
                              "--tool-hold", value], capture_output=True, text=True,
                             timeout=120, env={**os.environ, "XDG_DATA_HOME": str(tmp_path)})
        assert out.returncode == 2 and "--tool-hold" in out.stderr, out.stderr[-500:]
