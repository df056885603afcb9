"""Tiny random checkpoints of architectures the native runner does not have, for the
transformers backend's tests.

Owner: tests. Each is built from transformers' own config class, seeded, with weights
re-drawn at a scale that makes logits O(1) (HF's init makes them ~0, where any slip
hides), saved with ``save_pretrained`` beside the tests' byte-level tokenizer.
"""

from __future__ import annotations

from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, PreTrainedModel

from tests.model.loader_fixtures import build_gguf_tokenizer, tiny_spec, tiny_tokens

ARCHS = ("gpt2", "gemma2", "gemma3", "phi3", "mistral")
NATIVE = ("llama", "qwen3")  # archs both backends run
WINDOW = 8  # the sliding window of the windowed archs: shorter than the tests' prompts
POSITIONS = 64  # GPT-2's learned position table


def make_config(arch: str) -> transformers.PretrainedConfig:
    """A tiny config of ``arch`` (2-3 layers, hidden 64, the tests' vocab)."""
    c = transformers
    common = dict(vocab_size=len(tiny_tokens()), hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=512, bos_token_id=None, eos_token_id=None,
                  pad_token_id=None)
    if arch == "gpt2":  # absolute positions, fused qkv (Conv1D), LayerNorm, GELU
        return c.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=POSITIONS,
                            vocab_size=common["vocab_size"], bos_token_id=None,
                            eos_token_id=None)
    if arch == "gemma2":  # alternating sliding/global layers, attention and final soft-caps
        return c.Gemma2Config(**common, head_dim=16, sliding_window=WINDOW)
    if arch == "gemma3":  # sliding + global layers, q/k norms, query_pre_attn_scalar
        return c.Gemma3TextConfig(**common, head_dim=16, sliding_window=WINDOW,
                                  layer_types=["sliding_attention", "full_attention"])
    if arch == "phi3":  # fused qkv_proj and gate_up_proj, partial rotary
        return c.Phi3Config(**common, partial_rotary_factor=0.5)
    if arch == "mistral":  # a sliding window on every layer
        return c.MistralConfig(**common, sliding_window=WINDOW)
    if arch == "llama":
        return c.LlamaConfig(**common)
    if arch == "qwen3":
        return c.Qwen3Config(**common, head_dim=32)
    raise ValueError(arch)


def make_model(arch: str, seed: int = 0) -> PreTrainedModel:
    """The seeded random tiny model of ``arch`` (eval, fp32, eager attention: the oracle)."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(make_config(arch), attn_implementation="eager")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "ln_" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.15)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


def write_folder(model: PreTrainedModel, folder: Path) -> Path:
    """``model`` as an HF folder pie-ctx loads (config, safetensors, tokenizer.json)."""
    model.save_pretrained(folder)
    build_gguf_tokenizer(tiny_spec()).save(str(folder / "tokenizer.json"))
    return folder
