"""The HTTP front door's own parts: addresses, the API key, /metrics, and the ``serve
--http`` options (the OpenAI endpoints are tested in test_openai.py, the live view in
test_live_view.py)."""

from __future__ import annotations

import argparse
import os
import stat

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pie_ctx import Context, Runtime, Sampler
from pie_ctx.proto.errors import InvalidArgument, PieError
from runtime.server import cli as server_cli
from runtime.server.http.app import HttpAddress, is_loopback, parse_http_address
from runtime.server.testing import serve_http_in_background
from tests.sdk.harness import tiny_engine


def test_http_addresses() -> None:
    assert parse_http_address("8000") == HttpAddress("127.0.0.1", 8000)
    assert parse_http_address("0.0.0.0:80") == HttpAddress("0.0.0.0", 80)
    assert parse_http_address("[::1]:9") == HttpAddress("::1", 9)
    assert str(HttpAddress("::1", 9)) == "http://[::1]:9"
    for bad in ("", "host:", "x:70000", "localhost:port"):
        with pytest.raises(InvalidArgument, match=r"\[HOST:\]PORT"):
            parse_http_address(bad)
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("example.com")


def _families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def _value(families: dict, name: str, **labels: str) -> float:
    for sample in families[name].samples:
        if all(sample.labels.get(k) == v for k, v in labels.items()) and \
                sample.name in (name, name + "_total"):
            return sample.value
    raise KeyError((name, labels))


async def test_metrics_parse_and_move_as_requests_are_served(tiny_folder) -> None:
    async with tiny_engine(tiny_folder) as engine, \
            serve_http_in_background(engine) as url, \
            httpx.AsyncClient(base_url=url) as http:
        before = _families((await http.get("/metrics")).text)
        assert _value(before, "pie_ctx_pages_total") == engine.store.num_pages_total
        # traffic: an SDK fork pair on the same engine, and an HTTP request
        async with Runtime.local(engine=engine) as rt:
            base = Context(rt).user("count the pages").cue()
            await base.flush()
            for f in (base.fork(), base.fork()):
                await f.generate(Sampler.greedy(), max_tokens=3, ignore_eos=True).tokens()
        assert (await http.get("/v1/models")).status_code == 200
        assert (await http.get("/no/such/path")).status_code == 404
        response = await http.get("/metrics")
        assert response.headers["content-type"].startswith("text/plain")
        after = _families(response.text)
        assert _value(after, "pie_ctx_tokens_computed") > _value(before, "pie_ctx_tokens_computed")
        assert _value(after, "pie_ctx_model_steps") > _value(before, "pie_ctx_model_steps")
        assert _value(after, "pie_ctx_http_requests", endpoint="/v1/models", status="200") == 1
        assert _value(after, "pie_ctx_http_requests", endpoint="other", status="404") == 1
        assert _value(after, "pie_ctx_http_requests", endpoint="/metrics", status="200") >= 1
        for name in ("pie_ctx_pages", "pie_ctx_queue_depth", "pie_ctx_running_jobs",
                     "pie_ctx_prefix_hit_rate", "pie_ctx_prefix_pages", "pie_ctx_contexts",
                     "pie_ctx_time_to_first_token_seconds",
                     "pie_ctx_inter_token_latency_seconds", "pie_ctx_request_tokens"):
            assert name in after, name
        assert _value(after, "pie_ctx_pages", state="free") + \
            _value(after, "pie_ctx_pages", state="used") + \
            _value(after, "pie_ctx_pages", state="cached") == engine.store.num_pages_total


async def test_the_api_key_guards_every_data_endpoint(tiny_folder) -> None:
    async with tiny_engine(tiny_folder) as engine, \
            serve_http_in_background(engine, api_key="sekrit") as url, \
            httpx.AsyncClient(base_url=url) as http:
        for path in ("/v1/models", "/metrics", "/v1/pie/state"):
            missing = await http.get(path)
            wrong = await http.get(path, headers={"Authorization": "Bearer nope"})
            right = await http.get(path, headers={"Authorization": "Bearer sekrit"})
            assert missing.status_code == wrong.status_code == 401, path
            assert right.status_code == 200, path
            body = wrong.json()["error"]
            assert body["code"] == "invalid_api_key" and body["type"] == "invalid_request_error"
            assert "missing API key" in missing.json()["error"]["message"]
        assert (await http.get("/")).status_code == 200  # the static page holds no data


def _serve_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    server_cli.register(parser.add_subparsers())
    return parser.parse_args(["serve", *argv])


def test_serve_http_options(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    http, key, key_file = server_cli._http_options(_serve_args("--http", "8000"))
    assert http == HttpAddress("127.0.0.1", 8000) and key is None and key_file is None
    # off loopback a key is mandatory: generated 0600 into the runtime folder
    http, key, key_file = server_cli._http_options(_serve_args("--http", "0.0.0.0:8000"))
    assert key and key_file == str(tmp_path / "pie-ctx" / "http.key")
    assert stat.S_IMODE(os.stat(key_file).st_mode) == 0o600
    assert server_cli._http_options(_serve_args("--http", "0.0.0.0:1"))[1] == key  # reused
    named = tmp_path / "k"
    _, key2, _ = server_cli._http_options(_serve_args("--http", "9", "--api-key-file",
                                                      str(named)))
    assert key2 and named.read_text().strip() == key2  # on loopback too, when asked
    with pytest.raises(PieError, match="--api-key-file needs --http"):
        server_cli._http_options(_serve_args("--api-key-file", str(named)))


def test_the_openai_api_is_an_inferlet_over_the_public_sdk() -> None:
    """The front door's APIs (OpenAI's, Anthropic's, the Responses API, vLLM's serving
    endpoints, the conversation pipeline they share, and their helpers: the access log,
    the disconnect watcher and the output limit)
    import the SDK (pie_ctx) and web libraries, never the engine: the only runtime modules
    they name are their own."""
    import ast
    from pathlib import Path

    from runtime.server.http import access_log, disconnect, limits, serving_api
    from runtime.server.http.anthropic import api as anthropic_api
    from runtime.server.http.anthropic import schema as anthropic_schema
    from runtime.server.http.conversation import (
        body,
        decoding,
        errors,
        generation,
        holds,
        keys,
        sse,
        turns,
    )
    from runtime.server.http.openai import api as openai_api
    from runtime.server.http.openai import chat as openai_chat
    from runtime.server.http.openai import decoding as openai_decoding
    from runtime.server.http.openai import schema as openai_schema
    from runtime.server.http.responses import api as responses_api
    from runtime.server.http.responses import compact as responses_compact
    from runtime.server.http.responses import conversations as responses_conversations
    from runtime.server.http.responses import items as responses_items
    from runtime.server.http.responses import mcp as responses_mcp
    from runtime.server.http.responses import run as responses_run
    from runtime.server.http.responses import schema as responses_schema
    from runtime.server.http.responses import store as responses_store

    modules = (openai_api, openai_chat, openai_schema, openai_decoding, access_log,
               anthropic_api, anthropic_schema, serving_api, disconnect, limits,
               body, decoding, errors, generation, holds, keys, sse, turns,
               responses_api, responses_compact, responses_conversations, responses_items,
               responses_mcp,
               responses_run, responses_schema, responses_store)
    own = {m.__name__ for m in modules}
    every: set[str] = set()
    for module in modules:
        tree = ast.parse(Path(module.__file__).read_text())
        names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        names |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        every |= names
        engine = [n for n in names if (n == "runtime" or n.startswith("runtime.")) and
                  n not in own]
        assert names and not engine, (module.__name__, engine)
    assert "pie_ctx" in every
