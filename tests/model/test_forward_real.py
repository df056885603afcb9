"""The real default model (SmolLM2-135M-Instruct): our paged runner vs transformers, fp32.

Marked ``real_model``. transformers loads the same GGUF itself when it can (its own
dequantization, needs ``accelerate``), else the converted folder our loader produced.
The oracle budget (docs/models.md): max abs logit difference over a chat prompt <= 1e-3 (the figure is printed),
greedy 64 tokens identical.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from runtime.model.loader import LoadedModel, load_model
from runtime.model.runner import ModelRunner, SeqInput
from tests.model.loader_fixtures import hf_default_model

pytestmark = pytest.mark.real_model

PAGE_SIZE = 16
MESSAGES = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Write a haiku about paged memory."}]


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return load_model(device="cpu", dtype=torch.float32, progress=False)


@pytest.fixture(scope="module")
def hf_model(loaded: LoadedModel) -> Any:
    return hf_default_model(loaded.path)


@pytest.fixture(scope="module")
def runner(loaded: LoadedModel) -> ModelRunner:
    c = loaded.config
    pool = torch.zeros(24, PAGE_SIZE, c.num_layers, 2, c.num_kv_heads, c.head_dim)
    return ModelRunner(loaded.config, loaded.weights, pool, PAGE_SIZE)


def test_chat_prompt_logits_match_transformers(loaded: LoadedModel, hf_model: Any,
                                               runner: ModelRunner) -> None:
    ids = loaded.tokenizer.encode_chat(MESSAGES, add_generation_prompt=True)
    pages = list(range(runner.num_pages))[::-1]
    # two chunks, to go through the cached-prefix path too
    half = len(ids) // 2
    ours = torch.cat([
        runner.forward([SeqInput(ids[:half], list(range(half)), pages, 0, list(range(half)))]),
        runner.forward([SeqInput(ids[half:], list(range(half, len(ids))), pages, half,
                                 list(range(len(ids) - half)))]),
    ])
    with torch.inference_mode():
        ref = hf_model(torch.tensor([ids])).logits[0].float()
    diff = (ours - ref).abs().max().item()
    print(f"real model max abs logit diff: {diff:.3g} over {len(ids)} tokens")
    assert diff <= 1e-3


def test_greedy_64_tokens_identical(loaded: LoadedModel, hf_model: Any,
                                    runner: ModelRunner) -> None:
    ids = loaded.tokenizer.encode_chat(MESSAGES, add_generation_prompt=True)
    pages = list(range(runner.num_pages))
    logits = runner.forward([SeqInput(ids, list(range(len(ids))), pages, 0, [len(ids) - 1])])
    ours: list[int] = []
    pos = len(ids)
    for _ in range(64):
        ours.append(int(logits[0].argmax()))
        logits = runner.forward([SeqInput([ours[-1]], [pos], pages, pos, [0])])
        pos += 1
    with torch.inference_mode():
        out = hf_model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=64,
                                min_new_tokens=64, eos_token_id=None, pad_token_id=0)
    assert ours == out[0, len(ids):].tolist()
