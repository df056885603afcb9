"""Synthetic GGUF files and HF folders for the loader and tokenizer tests.

Owner: tests/model (loader side). Everything here is tiny and seeded: a 2-layer model with
hidden size 64 (a multiple of 32, so Q8_0 blocks fit one row) and a byte-level BPE
vocabulary of 3 control tokens, the 256 byte symbols and a handful of merges.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from safetensors.torch import save_file

from runtime.model.loader.gguf_file import permute_qk
from runtime.model.loader.gguf_tokenizer import (
    GGUFTokenizerSpec,
    build_gguf_tokenizer,
    byte_to_unicode,
)

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS = 64, 96, 2, 4, 2
HEAD_DIM = HIDDEN // HEADS
CONTROL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["h e", "l l", "he ll", "hell o", "Ġ w", "Ġw o", "1 2"]
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def tiny_tokens() -> list[str]:
    """Vocabulary: control tokens, the 256 byte symbols, then one token per merge."""
    merged = ["".join(m.split(" ")) for m in MERGES]
    return CONTROL + [byte_to_unicode()[b] for b in range(256)] + merged


def tiny_spec(pre: str = "smollm", add_bos: bool = False) -> GGUFTokenizerSpec:
    """The tokenizer metadata of the synthetic GGUF, as the loader sees it."""
    tokens = tiny_tokens()
    return GGUFTokenizerSpec(
        model="gpt2", pre=pre, tokens=tokens, token_types=[3] * 3 + [1] * (len(tokens) - 3),
        merges=list(MERGES), bos_token_id=1, eos_token_id=2, unk_token_id=0, pad_token_id=2,
        extra_stop_ids=[], add_bos_token=add_bos, add_eos_token=False, chat_template=CHAT_TEMPLATE,
    )


def hf_reference_weights(seed: int = 0, tied: bool = True, qkv_bias: bool = False,
                         scaled: bool = False, *, heads: int = HEADS, kv_heads: int = KV_HEADS,
                         head_dim: int = HEAD_DIM) -> dict[str, np.ndarray]:
    """Random fp32 weights in HF naming and layout (what the loader must reproduce).

    By default every weight is N(0, 1): activations grow by ~sqrt(hidden) per matrix, which
    makes any slip in the loader or runner loud. ``scaled`` draws them like a trained model
    (matrices N(0, 1/fan_in), norm weights ~1), so activations stay O(1); the precision
    tests use that one, since with unscaled weights bf16 logits drift by a quarter of their
    range (in transformers' own bf16 forward too). ``heads``, ``kv_heads``, ``head_dim``:
    the attention shape (default the tiny model's; tests/parallel needs 4 KV heads).
    """
    rng = np.random.default_rng(seed)
    vocab = len(tiny_tokens())

    def r(*shape: int) -> np.ndarray:
        scale = shape[-1] ** -0.5 if scaled and len(shape) == 2 else 1.0
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    def norm() -> np.ndarray:
        if not scaled:
            return r(HIDDEN)
        return (1.0 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32)

    embed = r(vocab, HIDDEN) * (HIDDEN**0.5 if scaled else 1.0)  # entries N(0, 1) either way
    w = {"model.embed_tokens.weight": embed, "model.norm.weight": norm()}
    if not tied:
        w["lm_head.weight"] = r(vocab, HIDDEN)
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        w |= {p + "input_layernorm.weight": norm(), p + "post_attention_layernorm.weight": norm(),
              p + "self_attn.q_proj.weight": r(heads * head_dim, HIDDEN),
              p + "self_attn.k_proj.weight": r(kv_heads * head_dim, HIDDEN),
              p + "self_attn.v_proj.weight": r(kv_heads * head_dim, HIDDEN),
              p + "self_attn.o_proj.weight": r(HIDDEN, heads * head_dim),
              p + "mlp.gate_proj.weight": r(FFN, HIDDEN), p + "mlp.up_proj.weight": r(FFN, HIDDEN),
              p + "mlp.down_proj.weight": r(HIDDEN, FFN)}
        if qkv_bias:
            w |= {p + "self_attn.q_proj.bias": r(heads * head_dim),
                  p + "self_attn.k_proj.bias": r(kv_heads * head_dim),
                  p + "self_attn.v_proj.bias": r(kv_heads * head_dim)}
    return w


_TO_GGUF = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
            "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
            "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
            "mlp.down_proj": "ffn_down"}
QUANTIZED = ("attn_k.weight", "ffn_up.weight")  # stored as Q8_0; everything else F32


def gguf_name(hf: str) -> str:
    """llama.cpp name of an HF tensor name (test-side inverse of the loader's mapping)."""
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    if hf in fixed:
        return fixed[hf]
    _, _, layer, rest = hf.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_TO_GGUF[module]}.{kind}"


def add_tiny_tokenizer(w: gguf.GGUFWriter) -> None:
    """Write :func:`tiny_spec`'s tokenizer metadata into ``w``."""
    spec = tiny_spec()
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_string("tokenizer.ggml.pre", "smollm")
    w.add_array("tokenizer.ggml.tokens", spec.tokens)
    w.add_array("tokenizer.ggml.token_type", spec.token_types)
    w.add_array("tokenizer.ggml.merges", spec.merges)
    w.add_uint32("tokenizer.ggml.bos_token_id", 1)
    w.add_uint32("tokenizer.ggml.eos_token_id", 2)
    w.add_uint32("tokenizer.ggml.padding_token_id", 2)
    w.add_bool("tokenizer.ggml.add_bos_token", False)
    w.add_string("tokenizer.chat_template", CHAT_TEMPLATE)


def write_tiny_gguf(path: Path, hf: dict[str, np.ndarray], arch: str = "llama",
                    meta_overrides: dict[str, Any] | None = None,
                    extra_tensors: dict[str, np.ndarray] | None = None,
                    formats: dict[str, str] | None = None) -> Path:
    """Write ``hf`` as a llama.cpp-style GGUF (Q/K permuted for llama; some tensors Q8_0).

    ``meta_overrides`` maps keys to ``(value, GGUFValueType)``; ``extra_tensors`` are written
    under their llama.cpp names as given (e.g. ``rope_freqs.weight``); ``formats`` maps
    llama.cpp name suffixes to a block format (``{"attn_q.weight": "Q4_1"}``) instead of
    :data:`QUANTIZED`'s Q8_0.
    """
    w = gguf.GGUFWriter(str(path), arch)
    w.add_uint32(f"{arch}.context_length", 256)
    w.add_uint32(f"{arch}.embedding_length", HIDDEN)
    w.add_uint32(f"{arch}.block_count", LAYERS)
    w.add_uint32(f"{arch}.feed_forward_length", FFN)
    w.add_uint32(f"{arch}.attention.head_count", HEADS)
    w.add_uint32(f"{arch}.attention.head_count_kv", KV_HEADS)
    w.add_float32(f"{arch}.rope.freq_base", 50000.0)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    add_tiny_tokenizer(w)
    for key, value in (meta_overrides or {}).items():
        w.add_key_value(key, value[0], value[1])
    for name, array in hf.items():
        gname = gguf_name(name)
        if arch == "llama" and ".attn_q." in gname:
            array = permute_qk(array, HEADS)
        elif arch == "llama" and ".attn_k." in gname:
            array = permute_qk(array, KV_HEADS)
        kind = next((k for suffix, k in (formats or {}).items() if gname.endswith(suffix)),
                    None if formats is not None else "Q8_0" if gname.endswith(QUANTIZED) else None)
        if kind is not None:
            fmt = gguf.GGMLQuantizationType[kind]
            w.add_tensor(gname, gguf.quants.quantize(array, fmt), raw_dtype=fmt)
        else:
            w.add_tensor(gname, np.ascontiguousarray(array))
    for gname, array in (extra_tensors or {}).items():
        w.add_tensor(gname, np.ascontiguousarray(array, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def q8_roundtrip(array: np.ndarray) -> np.ndarray:
    """What a Q8_0 tensor dequantizes to (rows quantize independently of their order)."""
    q = gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q8_0)
    return gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q8_0).reshape(array.shape)


def write_tiny_hf_folder(folder: Path, hf: dict[str, np.ndarray], shards: int = 1) -> Path:
    """An HF checkpoint folder (config, safetensors, possibly sharded, tokenizer files)."""
    folder.mkdir(parents=True, exist_ok=True)
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": len(tiny_tokens()),
           "hidden_size": HIDDEN, "intermediate_size": FFN, "num_hidden_layers": LAYERS,
           "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "rms_norm_eps": 1e-5,
           "rope_theta": 50000.0, "max_position_embeddings": 256,
           "tie_word_embeddings": "lm_head.weight" not in hf, "bos_token_id": 1, "eos_token_id": 2}
    (folder / "config.json").write_text(json.dumps(cfg))
    names = sorted(hf)
    weight_map: dict[str, str] = {}
    for s in range(shards):
        part = names[s::shards]
        fname = "model.safetensors" if shards == 1 else f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: torch.from_numpy(hf[n]) for n in part}, str(folder / fname), metadata={"format": "pt"})
        weight_map |= {n: fname for n in part}
    if shards > 1:
        (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    build_gguf_tokenizer(tiny_spec()).save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": CHAT_TEMPLATE, "bos_token": {"content": "<|im_start|>"}, "eos_token": "<|im_end|>"}))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    return folder


def hf_default_model(folder: Path) -> Any:
    """transformers' own model of the default SmolLM2, fp32 and in eval mode: loaded from the
    same GGUF by transformers' dequantization when it can (needs ``accelerate``), else from
    the dense entry of the ``folder`` our loader produced (the real-model oracle)."""
    from transformers import AutoModelForCausalLM

    from runtime.model.loader import default_gguf_path, dense_folder

    gguf = Path(default_gguf_path())
    try:
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                     dtype=torch.float32)
    except (ValueError, ImportError, OSError):
        model = AutoModelForCausalLM.from_pretrained(str(dense_folder(folder)),
                                                     dtype=torch.float32)
    return model.eval()

