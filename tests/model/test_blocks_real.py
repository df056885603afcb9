"""weights="gguf" on the real default model (its Q4_1 GGUF, Q8_0 embedding) against the
fp32 runner on the same file dequantized: the same weights, so the same model up to fp32
summation order (the budget of docs/performance.md's gate: max |logit diff| small, greedy
choices equal, perplexity within 0.2%)."""

from __future__ import annotations

import pytest
import torch

from runtime.model.loader import LoadedModel, load_blocks, load_model
from runtime.model.runner import ModelRunner
from tests.model.test_int8_real import PAGE_SIZE, PROMPTS, TEXT, _greedy, _logits, _ppl

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return load_model(device="cpu", dtype=torch.float32, progress=False)


def _runner(loaded: LoadedModel, weights: str) -> ModelRunner:
    c = loaded.config
    pool = torch.zeros(64, PAGE_SIZE, c.num_layers, 2, c.num_kv_heads, c.head_dim)
    blocks = load_blocks(loaded.path) if weights == "gguf" else None
    return ModelRunner(c, loaded.weights, pool, PAGE_SIZE, weight_format=weights, blocks=blocks)


def test_the_default_gguf_on_its_blocks_is_the_file_dequantized(loaded: LoadedModel) -> None:
    fp32, ours = _runner(loaded, "fp32"), _runner(loaded, "gguf")
    assert {p.weight.source for p in ours.model.projections()} == {"Q4_1", "Q8_0"}
    assert ours.weight_bytes <= 0.2 * fp32.weight_bytes  # ~97 MB against ~540 MB
    ids = loaded.tokenizer.encode(TEXT.read_text(encoding="utf-8"))[:384]
    a, b = _logits(fp32, ids), _logits(ours, ids)
    assert (a - b).abs().max().item() < 2e-3
    assert (a.argmax(-1) == b.argmax(-1)).float().mean().item() >= 0.99
    assert abs(_ppl(b, ids) / _ppl(a, ids) - 1) < 0.002
    for prompt in PROMPTS[:2]:
        chat = loaded.tokenizer.render_chat([{"role": "user", "content": prompt}])
        ids = loaded.tokenizer.encode(chat) if isinstance(chat, str) else list(chat)
        assert _greedy(ours, ids, 12) == _greedy(fp32, ids, 12)
