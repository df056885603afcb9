"""LoRA adapters loaded at run time are HTTP models at once: ``rt.load_adapter`` by an inferlet,
and vLLM's ``POST /v1/load_lora_adapter`` / ``/v1/unload_lora_adapter`` (same API-key rules
as hosted inferlets), checked with the official ``openai`` client."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
import openai
import pytest
import torch

from pie_ctx import Context, Runtime, Sampler
from runtime.server.testing import serve_http_in_background
from tests.model.lora_fixtures import make_adapter
from tests.sdk.harness import tiny_engine, tiny_model_folder

pytest.importorskip("peft")

PROMPT = list(range(40, 60))
KEY = "sekrit"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    folder = tiny_model_folder(tmp_path_factory.mktemp("model"))
    hf = AutoModelForCausalLM.from_pretrained(str(folder), torch_dtype=torch.float32).eval()
    paths = tmp_path_factory.mktemp("adapters")
    make_adapter(hf, paths / "a", rank=8, seed=3)
    make_adapter(hf, paths / "b", rank=4, seed=4)
    return folder, paths / "a", paths / "b"


async def test_adapters_come_and_go_over_http_and_from_inferlets(folders) -> None:
    folder, path, other = folders
    async with tiny_engine(folder) as engine, \
            serve_http_in_background(engine, api_key=KEY) as url, \
            httpx.AsyncClient(base_url=url + "/v1", timeout=60,
                              headers={"Authorization": f"Bearer {KEY}"}) as http, \
            Runtime.local(engine=engine) as rt:
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
        base = (await client.models.list()).data[0].id

        # an inferlet loads one: HTTP serves it on the next request
        await rt.load_adapter("inf", str(path))
        assert {m.id for m in (await client.models.list()).data} == {base, "inf"}
        want = await Context(rt, adapter="inf").append(PROMPT).generate(
            Sampler.greedy(), max_tokens=6, ignore_eos=True).text()
        out = await client.completions.create(model="inf", prompt=PROMPT, max_tokens=6,
                                              temperature=0, extra_body={"ignore_eos": True})
        assert out.choices[0].text == want and out.model == "inf"

        # HTTP loads one (vLLM's body, through the official client's raw post)
        reply = await client.post("/load_lora_adapter", cast_to=httpx.Response,
                                  body={"lora_name": "terse", "lora_path": str(other)})
        assert reply.text == "Success: LoRA adapter 'terse' added successfully."
        assert [a.name for a in engine.info().adapters] == ["inf", "terse"]
        card = await client.models.retrieve("terse")
        assert card.id == "terse" and card.root == str(other)
        want = await Context(rt, adapter="terse").append(PROMPT).generate(
            Sampler.greedy(), max_tokens=6, ignore_eos=True).text()
        out = await client.completions.create(model="terse", prompt=PROMPT, max_tokens=6,
                                              temperature=0, extra_body={"ignore_eos": True})
        assert out.choices[0].text == want

        # refusals change nothing
        again = await http.post("/load_lora_adapter",
                                json={"lora_name": "terse", "lora_path": str(path)})
        assert again.status_code == 400 and "already loaded" in again.json()["error"]["message"]
        missing = await http.post("/load_lora_adapter",
                                  json={"lora_name": "x", "lora_path": "/no/such/folder"})
        assert missing.status_code == 400
        assert missing.json()["error"]["code"] == "adapter_load_failed"
        bad = await http.post("/load_lora_adapter", json={"lora_name": "x"})
        assert bad.status_code == 400 and "lora_path" in bad.json()["error"]["message"]
        no_key = await http.post("/load_lora_adapter", headers={"Authorization": ""},
                                 json={"lora_name": "y", "lora_path": str(path)})
        assert no_key.status_code == 401
        held = Context(rt, adapter="terse").append(PROMPT)
        await held.flush()
        busy = await http.post("/unload_lora_adapter", json={"lora_name": "terse"})
        assert busy.status_code == 409 and busy.json()["error"]["code"] == "adapter_in_use"
        await held.release()

        # HTTP unloads it: gone from /v1/models and from the model names at once
        gone = await http.post("/unload_lora_adapter", json={"lora_name": "terse"})
        assert gone.status_code == 200 and "removed" in gone.text
        assert {m.id for m in (await client.models.list()).data} == {base, "inf"}
        with pytest.raises(openai.NotFoundError):
            await client.completions.create(model="terse", prompt="x", max_tokens=1)
        unknown = await http.post("/unload_lora_adapter", json={"lora_name": "terse"})
        assert unknown.status_code == 404
        assert unknown.json()["error"]["code"] == "adapter_not_found"
        await rt.unload_adapter("inf")                      # an inferlet unloads its own
        assert [m.id for m in (await client.models.list()).data] == [base]
        await client.close()


def _serve(*args: str, tmp) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "runtime.server", "serve", "--socket", str(tmp / "e.sock"),
         "--page-size", "4", *args], stderr=subprocess.PIPE, text=True,
        env={**os.environ, "XDG_DATA_HOME": str(tmp / "data")})


def test_serve_says_which_adapters_it_loaded(folders, tmp_path) -> None:
    folder, path, _ = folders
    proc = _serve("--model", str(folder), "--adapter", f"terse={path}", tmp=tmp_path)
    try:
        lines = []
        for line in proc.stderr:  # type: ignore[union-attr]
            lines.append(line)
            if line.startswith("pie-ctx: snapshots:"):  # after the adapters' lines
                break
        log = "".join(lines)
        assert "adapter terse: rank 8 on q_proj" in log and str(path) in log, log
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_a_missing_adapter_folder_fails_before_the_model_loads(tmp_path) -> None:
    # the model does not exist either: the adapter's check comes first, so it is what fails
    t0 = time.monotonic()
    proc = _serve("--model", str(tmp_path / "no-model"), "--adapter", "x=/missing",
                  tmp=tmp_path)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2
    assert "adapter folder /missing does not exist" in err, err
    assert time.monotonic() - t0 < 20
