"""Random K-quant super-blocks and a tiny Llama GGUF stored in them, for the K-quant tests.

Owner: tests/model (the K-quant family). ``gguf`` cannot quantize to the K formats, so the
blocks are random bytes with finite float16 scales of a size that keeps a model's
activations O(1): every such block is valid, and ``gguf.quants.dequantize`` is the oracle.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from loader_fixtures import add_tiny_tokenizer, tiny_tokens

# bytes a super-block and where its float16 scales sit
LAYOUT = {"Q4_K": (144, (0, 2)), "Q5_K": (176, (0, 2)), "Q6_K": (210, (208,)),
          "Q2_K": (84, (80, 82)), "Q3_K": (110, (108,))}
HIDDEN, FFN, LAYERS, HEADS, KV_HEADS = 256, 512, 2, 4, 2
HEAD_DIM = HIDDEN // HEADS


def random_blocks(kind: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """uint8 [rows, row bytes]: random super-blocks of ``kind`` whose weights are about
    N(0, 1 / cols) in size (a minimum near the middle of the grid where there is one).
    A legacy format (Q8_0, Q5_0...): gguf's quantizer over such weights."""
    rng = np.random.default_rng(seed)
    if kind not in LAYOUT:
        w = (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)
        return gguf.quants.quantize(w, gguf.GGMLQuantizationType[kind])
    size, scales = LAYOUT[kind]
    nb = cols // 256
    raw = rng.integers(0, 256, size=(rows, nb, size), dtype=np.uint8)
    top = {"Q4_K": 63 * 15, "Q5_K": 63 * 31, "Q6_K": 127 * 32, "Q2_K": 15 * 3, "Q3_K": 32 * 4}
    d = rng.uniform(0.5, 1.5, (rows, nb)) * 3 / np.sqrt(cols) / top[kind]
    values = [d]
    if len(scales) == 2:  # dmin: about the middle of the grid, so the weights centre near 0
        values.append(d * {"Q4_K": 7.5, "Q5_K": 15.5, "Q2_K": 1.5}[kind])
    for at, v in zip(scales, values, strict=True):
        raw[:, :, at:at + 2] = v.astype(np.float16).view(np.uint8).reshape(rows, nb, 2)
    return raw.reshape(rows, nb * size)


def dequantized(raw: np.ndarray, kind: str) -> np.ndarray:
    """The oracle: ``gguf.quants.dequantize`` of ``raw``, float32 [rows, cols]."""
    out = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind])
    return np.asarray(out, dtype=np.float32).reshape(raw.shape[0], -1)


# the Q4_K_M mix of llama.cpp: Q4_K, with Q6_K for attn_v, ffn_down and the embedding table
Q4_K_M = {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q4_K",
          "ffn_gate": "Q4_K", "ffn_up": "Q4_K", "ffn_down": "Q6_K", "token_embd": "Q6_K"}


def write_kquant_gguf(path: Path, formats: dict[str, str] | None = None, seed: int = 0) -> Path:
    """A 2-layer Llama (hidden 256, FFN 512, tied embeddings) with every matrix in the
    K-quant formats of ``formats`` (llama.cpp tensor stem -> format; default
    :data:`Q4_K_M`; ``"blk.1.ffn_up"`` style keys name one layer's tensor), norms F32."""
    formats = formats or Q4_K_M
    vocab = len(tiny_tokens())
    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in (("context_length", 256), ("embedding_length", HIDDEN),
                       ("block_count", LAYERS), ("feed_forward_length", FFN),
                       ("attention.head_count", HEADS), ("attention.head_count_kv", KV_HEADS)):
        w.add_uint32(f"llama.{key}", value)
    w.add_float32("llama.rope.freq_base", 50000.0)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    add_tiny_tokenizer(w)
    rng = np.random.default_rng(seed)
    shapes = {"attn_q": (HEADS * HEAD_DIM, HIDDEN), "attn_k": (KV_HEADS * HEAD_DIM, HIDDEN),
              "attn_v": (KV_HEADS * HEAD_DIM, HIDDEN), "attn_output": (HIDDEN, HIDDEN),
              "ffn_gate": (FFN, HIDDEN), "ffn_up": (FFN, HIDDEN), "ffn_down": (HIDDEN, FFN)}
    tensors: list[tuple[str, str, tuple[int, int]]] = [("token_embd", "token_embd",
                                                        (vocab, HIDDEN))]
    for i in range(LAYERS):
        tensors += [(f"blk.{i}.{stem}", stem, shape) for stem, shape in shapes.items()]
    for n, (name, stem, (rows, cols)) in enumerate(tensors):
        kind = formats.get(name, formats[stem])
        raw = random_blocks(kind, rows, cols, seed=seed * 1000 + n)
        if stem == "token_embd":  # an embedding's entries are O(1), not O(1 / sqrt(hidden))
            raw = _scaled(raw, kind, np.sqrt(cols))
        w.add_tensor(f"{name}.weight", raw, raw_dtype=gguf.GGMLQuantizationType[kind])
    norm = lambda: (1.0 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32)  # noqa: E731
    w.add_tensor("output_norm.weight", norm())
    for i in range(LAYERS):
        w.add_tensor(f"blk.{i}.attn_norm.weight", norm())
        w.add_tensor(f"blk.{i}.ffn_norm.weight", norm())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _scaled(raw: np.ndarray, kind: str, factor: float) -> np.ndarray:
    """``raw`` with its float16 scales multiplied by ``factor``."""
    size, scales = LAYOUT[kind]
    blocks = raw.reshape(raw.shape[0], -1, size).copy()
    for at in scales:
        h = blocks[:, :, at:at + 2].copy().view(np.float16)
        blocks[:, :, at:at + 2] = (h.astype(np.float32) * factor).astype(np.float16).view(np.uint8)
    return blocks.reshape(raw.shape)
