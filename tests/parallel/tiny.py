"""A tiny random Llama with 8 query heads and 4 KV heads, so 2 (and 4) ranks can split it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from tests.model.loader_fixtures import tiny_tokens, write_tiny_hf_folder

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 64, 96, 2, 8, 4, 8


def tp_model_folder(root: Path, seed: int = 5) -> Path:
    """The HF folder (untied lm_head, so the vocab-parallel head has its own rows)."""
    rng = np.random.default_rng(seed)
    vocab = len(tiny_tokens())

    def r(*shape: int) -> np.ndarray:
        scale = shape[-1] ** -0.5 if len(shape) == 2 else 1.0
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    def norm() -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32)

    w = {"model.embed_tokens.weight": r(vocab, HIDDEN) * HIDDEN**0.5,
         "model.norm.weight": norm(), "lm_head.weight": r(vocab, HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        w |= {p + "input_layernorm.weight": norm(), p + "post_attention_layernorm.weight": norm(),
              p + "self_attn.q_proj.weight": r(HEADS * HEAD_DIM, HIDDEN),
              p + "self_attn.k_proj.weight": r(KV_HEADS * HEAD_DIM, HIDDEN),
              p + "self_attn.v_proj.weight": r(KV_HEADS * HEAD_DIM, HIDDEN),
              p + "self_attn.o_proj.weight": r(HIDDEN, HEADS * HEAD_DIM),
              p + "mlp.gate_proj.weight": r(FFN, HIDDEN), p + "mlp.up_proj.weight": r(FFN, HIDDEN),
              p + "mlp.down_proj.weight": r(HIDDEN, FFN)}
    folder = write_tiny_hf_folder(root / "tiny-llama-kv4", w)
    config = json.loads((folder / "config.json").read_text())
    config |= {"num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
               "head_dim": HEAD_DIM, "max_position_embeddings": 4096}
    (folder / "config.json").write_text(json.dumps(config))
    return folder
