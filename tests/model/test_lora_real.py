"""A random rank-8 LoRA on the real default model (SmolLM2-135M-Instruct) vs peft's
PeftModel on transformers, fp32: max abs logit diff <= 1e-3, greedy 32 tokens identical."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from lora_fixtures import make_adapter

from runtime.model.loader import LoadedModel, load_model
from runtime.model.runner import ModelRunner, SeqInput
from tests.model.loader_fixtures import hf_default_model

pytestmark = pytest.mark.real_model
pytest.importorskip("peft")

PAGE_SIZE = 16
MESSAGES = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Write a haiku about paged memory."}]


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> tuple[LoadedModel, Any, ModelRunner, int]:
    loaded = load_model(device="cpu", dtype=torch.float32, progress=False)
    folder = tmp_path_factory.mktemp("lora") / "r8"
    oracle = make_adapter(hf_default_model(loaded.path), folder, rank=8, alpha=16, seed=7,
                          std=0.02)
    c = loaded.config
    pool = torch.zeros(24, PAGE_SIZE, c.num_layers, 2, c.num_kv_heads, c.head_dim)
    runner = ModelRunner(c, loaded.weights, pool, PAGE_SIZE)
    key = runner.load_adapter("r8", str(folder), loaded.name).key
    return loaded, oracle, runner, key


def test_real_model_lora_matches_peft(setup) -> None:
    loaded, oracle, runner, key = setup
    ids = loaded.tokenizer.encode_chat(MESSAGES, add_generation_prompt=True)
    pages = list(range(runner.num_pages))
    ours = runner.forward([SeqInput(ids, list(range(len(ids))), pages, 0,
                                    list(range(len(ids))), adapter=key)])
    with torch.inference_mode():
        ref = oracle(torch.tensor([ids])).logits[0].float()
    diff = (ours - ref).abs().max().item()
    print(f"real model + rank-8 LoRA: max abs logit diff vs peft {diff:.3g}")
    assert diff <= 1e-3
    # greedy 32 tokens
    logits = ours[-1:]
    out: list[int] = []
    pos = len(ids)
    for _ in range(32):
        out.append(int(logits[0].argmax()))
        logits = runner.forward([SeqInput([out[-1]], [pos], pages, pos, [0], adapter=key)])
        pos += 1
    with torch.inference_mode():
        want = oracle.generate(input_ids=torch.tensor([ids]), do_sample=False,
                               max_new_tokens=32, min_new_tokens=32, eos_token_id=None,
                               pad_token_id=0)
    assert out == want[0, len(ids):].tolist()
