"""A tiny random Llama with 8 query heads and 4 KV heads, so 2 (and 4) ranks can split it."""

from __future__ import annotations

import json
from pathlib import Path

from tests.model.loader_fixtures import hf_reference_weights, write_tiny_hf_folder

HEADS, KV_HEADS, HEAD_DIM = 8, 4, 8


def tp_model_folder(root: Path, seed: int = 5) -> Path:
    """The HF folder (untied lm_head, so the vocab-parallel head has its own rows; weights
    drawn like a trained model's)."""
    w = hf_reference_weights(seed, tied=False, scaled=True, heads=HEADS, kv_heads=KV_HEADS,
                             head_dim=HEAD_DIM)
    folder = write_tiny_hf_folder(root / "tiny-llama-kv4", w)
    config = json.loads((folder / "config.json").read_text())
    config |= {"num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
               "head_dim": HEAD_DIM, "max_position_embeddings": 4096}
    (folder / "config.json").write_text(json.dumps(config))
    return folder
