"""Tiny random HF models and a minimal page allocator for the model tests.

Owner: tests/model. Builds transformers models (the oracle) from seeded random tiny
configs and hands their ``state_dict()`` to our runner; weights are re-drawn at a larger
scale than HF's init so logits are O(1) and a numerical slip would show. ``PagedSeq``
plays the page store's role for one context (pages from a shared free list), so these
tests do not depend on runtime/kv.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from runtime.kv.pool import PagePool, PoolShape
from runtime.model.config import ModelConfig
from runtime.model.runner import ModelRunner, SeqInput

VOCAB = 320
ARCHS = ("llama3", "llama_linear", "qwen2", "qwen3")


def make_hf_model(arch: str, seed: int = 0, num_layers: int = 2,
                  **overrides: object) -> PreTrainedModel:
    """A seeded random tiny transformers model of ``arch`` (eval mode, fp32); ``overrides``
    change config fields (sizes, ``max_position_embeddings``...)."""
    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=160,
                  num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=512, eos_token_id=None, bos_token_id=None,
                  pad_token_id=None) | overrides
    if arch == "llama3":
        cfg = LlamaConfig(**common, tie_word_embeddings=True, rope_theta=50000.0,
                          rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                        "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                        "original_max_position_embeddings": 64})
        cls = LlamaForCausalLM
    elif arch == "llama_linear":
        cfg = LlamaConfig(**{**common, "num_key_value_heads": 4},
                          rope_scaling={"rope_type": "linear", "factor": 2.0})
        cls = LlamaForCausalLM
    elif arch == "qwen2":
        cfg = Qwen2Config(**common)
        cls = Qwen2ForCausalLM
    elif arch == "qwen3":
        cfg = Qwen3Config(**{**common, "num_hidden_layers": max(num_layers, 3)}, head_dim=32)
        cls = Qwen3ForCausalLM
    else:
        raise ValueError(arch)
    cfg.architectures = [cls.__name__]
    model = cls(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.15)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def config_of(model: PreTrainedModel) -> ModelConfig:
    return ModelConfig.from_hf_config(model.config.to_dict())


def make_runner(model: PreTrainedModel, page_size: int = 16, num_pages: int = 96,
                kv_dtype: str = "fp32", deterministic: bool = False) -> ModelRunner:
    """Our runner on ``model``'s weights with a private pool of ``kv_dtype`` pages
    (``deterministic``: batch-invariant numerics, docs/performance.md)."""
    cfg = config_of(model)
    pool = PagePool(PoolShape(num_pages, page_size, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim,
                              kv_dtype=kv_dtype))
    # a bf16 pool is bf16 KV under the fp32 model (without a dtype: a bf16 model's pool)
    return ModelRunner(cfg, model.state_dict(), pool.kv, page_size,
                       dtype=torch.float32 if kv_dtype == "bf16" else None,
                       deterministic=deterministic)


@dataclass
class PagedSeq:
    """One context's page table and KV length, with pages taken from ``free``."""

    runner: ModelRunner
    free: list[int]
    pages: list[int] = field(default_factory=list)
    num_cached: int = 0

    def step(self, tokens: list[int], positions: list[int] | None = None,
             logits: list[int] | None = None, mask: np.ndarray | None = None) -> SeqInput:
        """Reserve pages for ``tokens`` and return their SeqInput (call ``advance`` after)."""
        need = -(-(self.num_cached + len(tokens)) // self.runner.page_size)
        while len(self.pages) < need:
            self.pages.append(self.free.pop())
        pos = positions if positions is not None else list(
            range(self.num_cached, self.num_cached + len(tokens)))
        rows = logits if logits is not None else list(range(len(tokens)))
        return SeqInput(list(tokens), list(pos), list(self.pages), self.num_cached, rows, mask)

    def advance(self, n: int) -> None:
        self.num_cached += n

    def run(self, tokens: list[int], **kw: object) -> torch.Tensor:
        """Run one forward of this sequence alone and advance."""
        out = self.runner.forward([self.step(tokens, **kw)])  # type: ignore[arg-type]
        self.advance(len(tokens))
        return out


def free_list(runner: ModelRunner, seed: int = 0) -> list[int]:
    """All page ids in a shuffled order, so page tables are non-contiguous."""
    ids = list(range(runner.num_pages))
    np.random.default_rng(seed).shuffle(ids)
    return ids


def random_tokens(n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(0, VOCAB, n).tolist()
