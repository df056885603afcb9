"""API keys with shares against a live ``pie-ctx serve --http --api-key KEY:SHARE ...`` and
the official ``openai`` client: two keys of equal shares flood the server, one with three
times the requests of the other, and each still gets at least 40% of the step rows (read
from ``/metrics``, per key); keys and the priority header are checked; the CLI refuses
malformed keys."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import anyio
import httpx
import openai
import pytest

from tests.http.test_openai import LiveServer
from tests.sdk.harness import tiny_model_folder

FLOOD_S = 12.0


def key_rows(url: str, key: str) -> dict[str, float]:
    """``pie_ctx_key_rows_total`` by key name."""
    text = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {key}"},
                     timeout=30).text
    out = {}
    for line in text.splitlines():
        if line.startswith("pie_ctx_key_rows_total{"):
            name = line.split('key="')[1].split('"')[0]
            out[name] = float(line.rsplit(" ", 1)[1])
    return out


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> LiveServer:
    folder = tiny_model_folder(tmp_path_factory.mktemp("model"))
    live = LiveServer(str(folder), str(tmp_path_factory.mktemp("srv")), "--api-key",
                      "alpha-secret:1:0:alpha", "--api-key", "beta-secret:1:0:beta")
    yield live
    live.stop()


def test_two_keys_flooding_each_get_their_share_of_the_rows(server: LiveServer) -> None:
    prompt = "".join(f"line {i}: the quick brown fox jumps over the lazy dog. "
                     for i in range(36))  # ~2,000 byte-level tokens: steps are full

    async def flood(key: str, workers: int, until: float) -> int:
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=key,
                                    max_retries=0, timeout=120)
        done = 0

        async def worker(i: int) -> None:
            nonlocal done
            n = 0
            while time.monotonic() < until:
                # a new prompt each time (no cache hits): every request computes its rows
                await client.completions.create(model="tiny-llama", prompt=f"{key} {i} {n} "
                                                + prompt, max_tokens=2, temperature=0)
                n += 1
                done += 1
        async with anyio.create_task_group() as tg:
            for i in range(workers):
                tg.start_soon(worker, i)
        await client.close()
        return done

    async def both() -> tuple[int, int]:
        until = time.monotonic() + FLOOD_S
        out = {}

        async def one(key: str, workers: int) -> None:
            out[key] = await flood(key, workers, until)
        async with anyio.create_task_group() as tg:
            tg.start_soon(one, "alpha-secret", 12)
            tg.start_soon(one, "beta-secret", 4)
        return out["alpha-secret"], out["beta-secret"]

    before = key_rows(server.url, "alpha-secret")
    assert set(before) == {"alpha", "beta"}
    alpha_requests, beta_requests = anyio.run(both)
    after = key_rows(server.url, "beta-secret")
    rows = {k: after[k] - before[k] for k in after}
    total = rows["alpha"] + rows["beta"]
    assert alpha_requests > 0 and beta_requests > 0 and total > 0
    assert rows["beta"] >= 0.4 * total, rows  # a third of the requests, half of the rows
    assert rows["alpha"] >= 0.4 * total, rows


def test_every_key_is_checked_and_the_priority_header_too(server: LiveServer) -> None:
    for key in ("alpha-secret", "beta-secret"):
        r = server.client(key).completions.create(model="tiny-llama", prompt="Hi",
                                                  max_tokens=2, temperature=0)
        assert r.choices[0].text is not None
    with pytest.raises(openai.AuthenticationError):
        server.client("gamma").completions.create(model="tiny-llama", prompt="Hi",
                                                  max_tokens=2)
    for bad in ("high", "101", "-1"):
        reply = httpx.post(server.url + "/v1/completions", timeout=30, json={
            "model": "tiny-llama", "prompt": "Hi", "max_tokens": 2},
            headers={"Authorization": "Bearer alpha-secret", "x-pie-priority": bad})
        assert reply.status_code == 400 and "x-pie-priority" in reply.text
    reply = httpx.post(server.url + "/v1/completions", timeout=30, json={
        "model": "tiny-llama", "prompt": "Hi", "max_tokens": 2},
        headers={"Authorization": "Bearer alpha-secret", "x-pie-priority": "7"})
    assert reply.status_code == 200
    text = httpx.get(server.url + "/metrics", timeout=30,
                     headers={"Authorization": "Bearer beta-secret"}).text
    assert 'pie_ctx_key_share{key="alpha"} 1.0' in text
    assert 'pie_ctx_key_page_share{key="beta"}' in text


@pytest.mark.parametrize(("args", "message"), [
    (["--api-key", "justakey"], "KEY:SHARE"),
    (["--api-key", "k:0"], "positive number"),
    (["--api-key", "k:1:200"], "priority"),
    (["--api-key", "k:1", "--api-key", "k:2"], "twice"),
    (["--api-key", "a:1:0:same", "--api-key", "b:1:0:same"], "same name"),
])
def test_malformed_keys_are_refused_at_start(args: list[str], message: str,
                                             tmp_path: Path) -> None:
    folder = tiny_model_folder(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "runtime.server", "serve", "--model",
                           str(folder), "--socket", str(tmp_path / "s.sock"), "--http", "0",
                           *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
