"""LoRA adapters over HTTP: ``pie-ctx serve --adapter NAME=PATH`` serves each adapter as a
model (``model="NAME"``, as vLLM's ``--lora-modules``) and ``/v1/models`` lists them."""

from __future__ import annotations

import openai
import pytest
import torch

from pie_ctx import Context, Sampler
from tests.http.test_openai import LiveServer
from tests.model.lora_fixtures import make_adapter
from tests.sdk.harness import tiny_model_folder, tiny_runtime

pytest.importorskip("peft")

PROMPT = list(range(40, 60))


async def test_model_name_selects_the_adapter(tmp_path_factory) -> None:
    from transformers import AutoModelForCausalLM

    folder = tiny_model_folder(tmp_path_factory.mktemp("model"))
    hf = AutoModelForCausalLM.from_pretrained(str(folder), torch_dtype=torch.float32).eval()
    path = tmp_path_factory.mktemp("adapters") / "terse"
    make_adapter(hf, path, rank=8, seed=3)
    expected = {}
    async with tiny_runtime(folder, adapters={"terse": str(path)}) as rt:
        for name in ("terse", None):
            ctx = Context(rt, adapter=name).append(PROMPT)
            expected[name] = await ctx.generate(Sampler.greedy(), max_tokens=8,
                                                ignore_eos=True).text()
    assert expected["terse"] != expected[None]
    srv = LiveServer(str(folder), str(tmp_path_factory.mktemp("srv")), "--adapter",
                     f"terse={path}")
    try:
        client = srv.client()
        models = {m.id: m for m in client.models.list().data}
        base = next(k for k in models if k != "terse")
        assert set(models) == {base, "terse"}
        assert client.models.retrieve("terse").id == "terse"
        for model, want in ((base, expected[None]), ("terse", expected["terse"])):
            out = client.completions.create(model=model, prompt=PROMPT, max_tokens=8,
                                            temperature=0,
                                            extra_body={"ignore_eos": True})
            assert out.model == model
            assert out.choices[0].text == want
        chat = client.chat.completions.create(
            model="terse", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        assert chat.model == "terse"
        with pytest.raises(openai.NotFoundError, match="terse"):
            client.completions.create(model="nope", prompt="x", max_tokens=1)
    finally:
        srv.stop()
