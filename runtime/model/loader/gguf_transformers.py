"""GGUF files the native converter does not read, converted with transformers' GGUF reader.

Owner: the GGUF loader (called by :mod:`.convert`, writing into its staging folder).
pie-ctx's own converter (:mod:`.gguf_file`, :mod:`.gguf_tokenizer`) reads the Llama,
Qwen2 and Qwen3 architectures with a byte-level BPE vocabulary. Two kinds of files go
through transformers (``pip install 'pie-ctx[transformers]'``) instead:

* a **sentencepiece vocabulary** (``tokenizer.ggml.model = "llama"``: Mistral 7B, Llama 2)
  on one of those architectures: only the tokenizer is built by transformers
  (:func:`transformers_tokenizer`), the weights are converted as usual;
* **another architecture** transformers reads from GGUF (Gemma 2/3, Phi-3/3.5/4-mini...):
  config, weights (dequantized to float32) and tokenizer are written by transformers'
  ``from_pretrained(gguf_file=)`` and ``save_pretrained`` (:func:`convert_with_transformers`).
  Which runner then runs the folder is boot's choice (``runtime.boot.choose_backend``):
  Phi-3 with plain RoPE runs native, the rest on the transformers backend.

transformers' GGUF reader leaves out a few settings the file holds; :func:`config_fixes`
writes them back into ``config.json`` (Phi-3's sliding window, partial rotary and LongRoPE factors,
Gemma 2's soft-caps, Gemma 3's linear rope scaling), or the converted model would silently
differ from the one llama.cpp runs from the same file.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from pie_ctx.proto.errors import ModelError

__all__ = ["convert_with_transformers", "transformers_tokenizer", "config_fixes",
           "read_gguf_header"]


def read_gguf_header(path: Path) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """The file's metadata and its small float tensors (1-D: rope factors, norms) by name.

    Raises:
        ModelError: the file is not a readable GGUF.
    """
    from .gguf_header import index_gguf

    header = index_gguf(path)
    small = {t.name: np.asarray(t.data, dtype=np.float32) for t in header.tensors
             if t.name.startswith("rope_factors") and t.tensor_type.name == "F32"}
    return header.metadata, small


def _transformers(what: str) -> Any:
    try:
        import transformers
    except ImportError:
        raise ModelError(f"{what} needs transformers: pip install 'pie-ctx[transformers]'"
                         ) from None
    return transformers


def transformers_tokenizer(gguf_path: Path) -> Any:
    """The ``tokenizers.Tokenizer`` transformers builds from the file's vocabulary (any type
    transformers reads: sentencepiece ``llama``, ``gpt2``...).

    Raises:
        ModelError: transformers is missing or cannot build it.
    """
    transformers = _transformers(f"the sentencepiece vocabulary of {gguf_path.name}")
    try:
        tok = transformers.AutoTokenizer.from_pretrained(str(gguf_path.parent),
                                                         gguf_file=gguf_path.name)
    except (ValueError, OSError, KeyError, TypeError) as e:
        raise ModelError(f"cannot build the tokenizer of {gguf_path} ({e})") from None
    return tok.backend_tokenizer


def config_fixes(meta: dict[str, Any], small: dict[str, np.ndarray],
                 config: dict[str, Any]) -> dict[str, Any]:
    """``config`` (transformers' reading of the file) with what its GGUF reader leaves out.

    Args:
        meta: the file's metadata.
        small: its rope factor tensors (:func:`read_gguf_header`).
        config: the ``config.json`` dict transformers wrote.

    Returns:
        The corrected dict (a copy).
    """
    arch = meta.get("general.architecture")
    out = dict(config)
    rope = dict(out.get("rope_parameters") or {})

    def key(name: str) -> Any:
        return meta.get(f"{arch}.{name}")

    if arch == "phi3":
        head_dim = out["hidden_size"] // out["num_attention_heads"]
        dims = key("rope.dimension_count")
        if dims and int(dims) != head_dim:  # Phi-4-mini rotates 3/4 of each head
            rope["partial_rotary_factor"] = int(dims) / head_dim
        if "rope_factors_long.weight" in small and "rope_factors_short.weight" in small:
            rope |= {"rope_type": "longrope",
                     "long_factor": small["rope_factors_long.weight"].tolist(),
                     "short_factor": small["rope_factors_short.weight"].tolist()}
            if key("rope.scaling.attn_factor") is not None:
                rope["attention_factor"] = float(key("rope.scaling.attn_factor"))
        if key("attention.sliding_window"):  # Phi-3-mini-4k: 2047
            out["sliding_window"] = int(key("attention.sliding_window"))
        if key("rope.scaling.original_context_length"):
            out["original_max_position_embeddings"] = int(
                key("rope.scaling.original_context_length"))
        out["rope_parameters"] = rope
    elif arch == "gemma2":
        for name in ("attn_logit_softcapping", "final_logit_softcapping"):
            if key(name) is not None:
                out[name] = float(key(name))
    elif arch == "gemma3":
        if key("rope.scaling.type") == "linear" and key("rope.scaling.factor"):
            full = dict(rope.get("full_attention") or {"rope_theta": out.get("rope_theta")})
            full |= {"rope_type": "linear", "factor": float(key("rope.scaling.factor"))}
            rope["full_attention"] = full
            out["rope_parameters"] = rope
    return out


def convert_with_transformers(gguf_path: Path, out_dir: Path) -> Path:
    """Write the HF-layout conversion of ``gguf_path`` into ``out_dir`` with transformers
    (config, float32 weights, tokenizer and chat template; see the module docstring).

    Raises:
        ModelError: transformers is missing or does not read this architecture.
    """
    transformers = _transformers(f"{gguf_path.name} (an architecture pie-ctx's GGUF reader "
                                 "does not convert)")
    import torch

    meta, small = read_gguf_header(gguf_path)
    arch = meta.get("general.architecture")
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32)
        tok = transformers.AutoTokenizer.from_pretrained(str(gguf_path.parent),
                                                         gguf_file=gguf_path.name)
    except (ValueError, OSError, KeyError, TypeError, NotImplementedError, RuntimeError) as e:
        raise ModelError(f"GGUF architecture {arch!r} of {gguf_path} is not one pie-ctx's "
                         f"reader converts (llama, qwen2, qwen3), and transformers cannot "
                         f"read it either ({e})") from None
    # save_pretrained refuses a model transformers marked GGUF-quantized: its weights are
    # plain float32 tensors by now, written as they are (a tied lm_head once, as the embedding)
    from safetensors.torch import save_file

    config = model.config.to_dict()
    config.pop("quantization_config", None)
    tied = bool(model.config.get_text_config().tie_word_embeddings)
    weights = {k: v.contiguous() for k, v in model.state_dict().items()
               if not (tied and k == "lm_head.weight")}
    save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    model.generation_config.to_json_file(str(out_dir / "generation_config.json"))
    tok.save_pretrained(out_dir)
    config = config_fixes(meta, small, config)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return out_dir
