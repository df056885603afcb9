"""int8 weights on the real default model against its fp32 oracle: the quality budget of
docs/models.md, measured on the text the project ships.

Budget (the test's, a little looser than the benchmark's 20 x 64 figure so that a smaller
sample cannot flake): perplexity on benchmarks/data/alice_chapter_1.txt within
``PPL_BUDGET`` of fp32's; teacher-forced greedy choices over chat continuations equal to
fp32's on at least ``AGREE_BUDGET`` of the positions.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from runtime.model.loader import LoadedModel, load_model
from runtime.model.quant import calibration_tokens
from runtime.model.runner import ModelRunner, SeqInput

pytestmark = pytest.mark.real_model

PPL_BUDGET = 0.02
AGREE_BUDGET = 0.85
TEXT = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "alice_chapter_1.txt"
PROMPTS = ["Why is the sky blue?", "Give me a recipe for pancakes.",
           "How do I reverse a list in Python?", "Tell me a fun fact about octopuses."]
PAGE_SIZE = 16


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return load_model(device="cpu", dtype=torch.float32, progress=False)


def _runner(loaded: LoadedModel, weights: str) -> ModelRunner:
    c = loaded.config
    pool = torch.zeros(200, PAGE_SIZE, c.num_layers, 2, c.num_kv_heads, c.head_dim)
    calibration = calibration_tokens(loaded.tokenizer) if weights == "int8" else None
    return ModelRunner(c, loaded.weights, pool, PAGE_SIZE, weight_format=weights,
                       calibration=calibration)


def _logits(runner: ModelRunner, ids: list[int], chunk: int = 512) -> torch.Tensor:
    """Logits of every position, in prefill chunks (the paged path)."""
    pages = list(range(runner.num_pages))
    out = []
    for a in range(0, len(ids), chunk):
        part = ids[a:a + chunk]
        out.append(runner.forward([SeqInput(part, list(range(a, a + len(part))), pages, a,
                                            list(range(len(part))))]))
    return torch.cat(out)


def _greedy(runner: ModelRunner, ids: list[int], n: int) -> list[int]:
    pages = list(range(runner.num_pages))
    logits = runner.forward([SeqInput(ids, list(range(len(ids))), pages, 0, [len(ids) - 1])])
    out, pos = [], len(ids)
    for _ in range(n):
        out.append(int(logits[0].argmax()))
        logits = runner.forward([SeqInput([out[-1]], [pos], pages, pos, [0])])
        pos += 1
    return out


def _ppl(logits: torch.Tensor, ids: list[int]) -> float:
    return math.exp(F.cross_entropy(logits[:-1], torch.tensor(ids[1:])).item())


def test_int8_meets_the_quality_budget(loaded: LoadedModel) -> None:
    fp32, int8 = _runner(loaded, "fp32"), _runner(loaded, "int8")
    assert int8.weight_bytes <= 0.3 * fp32.weight_bytes
    ids = loaded.tokenizer.encode(TEXT.read_text())[:2048]
    delta = _ppl(_logits(int8, ids), ids) / _ppl(_logits(fp32, ids), ids) - 1
    agree, total = 0, 0
    for text in PROMPTS:
        prompt = loaded.tokenizer.encode_chat([{"role": "user", "content": text}],
                                              add_generation_prompt=True)
        cont = _greedy(fp32, prompt, 32)
        seq = prompt + cont
        rows = slice(len(prompt) - 1, len(seq) - 1)
        agree += int((_logits(int8, seq)[rows].argmax(-1) == torch.tensor(cont)).sum())
        total += len(cont)
    print(f"int8 ppl delta {delta:+.4f}, greedy agreement {agree}/{total}")
    assert abs(delta) <= PPL_BUDGET
    assert agree / total >= AGREE_BUDGET
