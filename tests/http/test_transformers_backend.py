"""The HTTP front door over the transformers backend: a live ``serve --backend
transformers`` subprocess on a tiny Gemma 2, asked through the official ``openai`` client."""

from __future__ import annotations

import torch

from runtime.model.loader.hf import load_tokenizer
from tests.http.test_openai import LiveServer
from tests.model.transformers_fixtures import make_model, write_folder


def test_completions_over_a_gemma2_equal_transformers_generate(tmp_path) -> None:
    model = make_model("gemma2")
    folder = write_folder(model, tmp_path / "gemma2")
    prompt = list(range(40, 60))
    with torch.no_grad():
        want = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False,
                              attention_mask=torch.ones(1, len(prompt), dtype=torch.int64))
    text = load_tokenizer(folder).decode(want[0, len(prompt):].tolist())
    server = LiveServer(str(folder), str(tmp_path), "--backend", "transformers")
    try:
        client = server.client()
        model_id = client.models.list().data[0].id
        for _ in range(2):  # the second is a prefix hit
            out = client.completions.create(model=model_id, prompt=prompt, temperature=0,
                                            max_tokens=6)
            assert out.choices[0].text == text
        assert server.state()["engine"]["backend"] == "transformers"
    finally:
        server.stop()
    assert server.proc.returncode == 0
