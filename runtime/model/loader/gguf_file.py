"""Read a GGUF file: metadata -> HF config dict, tensors -> HF-named fp32 arrays.

Owner: the GGUF loader. Read-only over the file (memory-mapped, indexed by
:func:`runtime.model.loader.gguf_header.index_gguf`).
Tensors are dequantized with ``gguf.quants.dequantize`` to float32 and renamed from
llama.cpp names (``blk.0.attn_q.weight``) to Hugging Face names
(``model.layers.0.self_attn.q_proj.weight``). For the Llama family, llama.cpp's converter
permuted the rows of Q and K (it stores each head's rotary halves interleaved, for its
"normal" RoPE); :func:`unpermute_qk` restores HF's layout. Qwen2/Qwen3 are stored unpermuted.

:meth:`GGUFModel.iter_weights` is how a model is loaded from its GGUF, in place: the file
stays memory-mapped and each matrix stored in a type the block kernels compute
(``runtime.model.formats``: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) is handed to
its family's constructor as a uint8 view of the mapping, ``[rows, row bytes]``, with no copy on the way; only what must
be converted is: Q/K rows of the Llama family (the rotary layout), float tensors (norms,
biases, F16/BF16 matrices) to float32, and the types no kernel computes, dequantized (one
log line names them).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from pie_ctx.proto.errors import ModelError

from .gguf_header import GGUFTensor, index_gguf

__all__ = [
    "GGUFModel", "hf_tensor_name", "permute_qk", "unpermute_qk", "gguf_config_dict",
    "SUPPORTED_GGUF_ARCHS",
]

# general.architecture -> (HF architectures entry, HF model_type)
SUPPORTED_GGUF_ARCHS: dict[str, tuple[str, str]] = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
}
_PERMUTED_ARCHS = frozenset({"llama"})

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
# Tensors llama.cpp stores that HF derives from the config instead.
_DERIVED = frozenset({"rope_freqs.weight"})


def hf_tensor_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a llama.cpp tensor, or None if HF has no such tensor.

    Raises:
        ModelError: the name is not one this loader knows (an unsupported architecture).
    """
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    if gguf_name in _DERIVED:
        return None
    m = _BLOCK_RE.match(gguf_name)
    if m is None or m.group(2) not in _BLOCK_NAMES:
        raise ModelError(f"GGUF tensor {gguf_name!r} is not part of a supported Llama/Qwen2/Qwen3 "
                         "model; this GGUF uses an architecture pie-ctx cannot run")
    return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}.{m.group(3)}"


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's row permutation of a Q/K projection (HF layout -> GGUF layout).

    Within each head, HF keeps the two rotary halves as rows ``[0, d/2)`` and ``[d/2, d)``;
    llama.cpp interleaves them (row pairs). Used by tests to build GGUF files.
    """
    rows = w.shape[0]  # [n_head * head_dim, ...]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of :func:`permute_qk` (GGUF layout -> HF layout).

    Args:
        w: ``[n_head * head_dim, in]`` weight (or ``[n_head * head_dim]`` bias).
        n_head: query heads for Q, key/value heads for K.
    """
    rows = w.shape[0]
    if rows % (2 * n_head) != 0:
        raise ModelError(f"cannot un-permute a Q/K tensor of {rows} rows into {n_head} heads")
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_config_dict(meta: dict[str, Any], shapes: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    """An HF ``config.json`` dict equivalent to the GGUF metadata.

    Args:
        meta: GGUF key/values (``general.architecture``, ``{arch}.block_count``...).
        shapes: GGUF tensor name -> numpy shape (rows first), for vocab size and tying.

    Returns:
        The config dict (architectures, sizes, rope, eps, tie_word_embeddings...).

    Raises:
        ModelError: the architecture is unsupported or a required key is missing.
    """
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHS:
        raise ModelError(f"GGUF architecture {arch!r} is unsupported; supported: "
                         f"{', '.join(SUPPORTED_GGUF_ARCHS)}")

    def get(key: str, default: Any = None) -> Any:
        v = meta.get(f"{arch}.{key}", default)
        if v is None:
            raise ModelError(f"GGUF metadata key {arch}.{key} is missing; the file is incomplete")
        return v

    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    kv_heads = int(get("attention.head_count_kv", heads))
    if "token_embd.weight" not in shapes:
        raise ModelError("GGUF file has no token_embd.weight tensor; the file is incomplete")
    vocab = shapes["token_embd.weight"][0]
    cfg: dict[str, Any] = {
        "architectures": [SUPPORTED_GGUF_ARCHS[arch][0]],
        "model_type": SUPPORTED_GGUF_ARCHS[arch][1],
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": int(get("attention.key_length", hidden // heads)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "rope_scaling": _rope_scaling(meta, arch, shapes),
        "max_position_embeddings": int(get("context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in shapes,
        "attention_bias": "blk.0.attn_q.bias" in shapes,
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    for key in ("bos_token_id", "eos_token_id", "padding_token_id"):
        if meta.get(f"tokenizer.ggml.{key}") is not None:
            cfg[key.replace("padding", "pad")] = int(meta[f"tokenizer.ggml.{key}"])
    return cfg


def _rope_scaling(meta: dict[str, Any], arch: str,
                  shapes: dict[str, tuple[int, ...]]) -> dict[str, Any] | None:
    kind = meta.get(f"{arch}.rope.scaling.type")
    factor = meta.get(f"{arch}.rope.scaling.factor")
    if kind == "linear" and factor:
        return {"rope_type": "linear", "factor": float(factor)}
    if kind not in (None, "none") and "rope_freqs.weight" not in shapes:
        raise ModelError(f"GGUF rope scaling {kind!r} is unsupported (only linear and llama3)")
    if "rope_freqs.weight" in shapes:
        return {"rope_type": "llama3"}  # parameters filled by GGUFModel from the tensor
    return None


def llama3_rope_scaling(freq_factors: np.ndarray, rope_theta: float,
                        head_dim: int) -> dict[str, Any]:
    """Recover HF's llama3 rope-scaling parameters from llama.cpp's ``rope_freqs`` tensor.

    llama.cpp stores the per-frequency divisor; Llama 3.x checkpoints all use
    low_freq_factor=1, high_freq_factor=4 and an 8192-token original context, so those are
    assumed and then checked against the tensor.

    Raises:
        ModelError: the tensor is not explained by those parameters.
    """
    factors = np.asarray(freq_factors, dtype=np.float64)
    # Stored as float32: round the factor back to the short decimal it was written from.
    params = {"rope_type": "llama3", "factor": float(f"{factors.max():.6g}"), "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    inv_freq = rope_theta ** -(np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    low_wl = params["original_max_position_embeddings"] / params["low_freq_factor"]
    high_wl = params["original_max_position_embeddings"] / params["high_freq_factor"]
    smooth = (params["original_max_position_embeddings"] / wavelen - 1.0) / 3.0
    expected = np.where(wavelen < high_wl, 1.0,
                        np.where(wavelen > low_wl, params["factor"],
                                 1.0 / ((1 - smooth) / params["factor"] + smooth)))
    if factors.shape != expected.shape or not np.allclose(factors, expected, rtol=1e-3):
        raise ModelError("GGUF rope_freqs tensor does not match Llama 3 rope scaling; "
                         "this rope variant is unsupported, load the model from its HF folder")
    return params


class GGUFModel:
    """An open GGUF file: its metadata, HF config dict and HF-named fp32 tensors."""

    def __init__(self, path: str | Path) -> None:
        """Open and index the file (tensor data stays memory-mapped until iterated).

        Raises:
            ModelError: the file is missing, not a GGUF, or truncated.
        """
        self.path = Path(path)
        if not self.path.is_file():
            raise ModelError(f"GGUF file {self.path} does not exist; check the path")
        header = index_gguf(self.path)
        self.metadata: dict[str, Any] = header.metadata
        self._tensors = header.tensors
        self.shapes = {t.name: t.shape for t in self._tensors}
        self.config = gguf_config_dict(self.metadata, self.shapes)
        if self.config["rope_scaling"] == {"rope_type": "llama3"}:
            freqs = self._dequantize(self._tensor("rope_freqs.weight"))
            self.config["rope_scaling"] = llama3_rope_scaling(
                freqs, self.config["rope_theta"], self.config["head_dim"])
        self.arch: str = self.metadata["general.architecture"]

    def _tensor(self, name: str) -> GGUFTensor:
        for t in self._tensors:
            if t.name == name:
                return t
        raise ModelError(f"GGUF file {self.path} has no tensor {name!r}")

    def _dequantize(self, t: GGUFTensor) -> np.ndarray:
        import gguf

        try:
            return np.asarray(gguf.quants.dequantize(t.data, t.tensor_type),
                              dtype=np.float32).reshape(t.shape)
        except NotImplementedError:
            raise ModelError(f"GGUF tensor {t.name} uses quantization {t.tensor_type.name}, which "
                             "the installed gguf package cannot dequantize; upgrade gguf") from None

    @property
    def num_tensors(self) -> int:
        """How many tensors :meth:`iter_tensors` yields (at most)."""
        return len(self._tensors)

    def iter_weights(self, *, blocks: bool, floats: bool = True) -> Iterator[tuple[str, Any]]:
        """Yield ``(hf_name, weight)`` in file order, read in place.

        Args:
            blocks: keep each matrix stored in a format computed as stored
                (``runtime.model.formats.weight_from_gguf``) as that family's weight built
                on the file's bytes, a view of the mapping; False: every tensor dequantized.
            floats: also yield the float32 arrays (norms, biases, float matrices and the
                formats no family computes, dequantized); False: only the block weights.

        Yields:
            A block weight (Q/K rows un-permuted where needed, a copy), or a float32 array.
            The formats dequantized although ``blocks`` asked for blocks are logged once
            (``runtime.model.formats.note_dequantized``).

        Raises:
            ModelError: an unknown tensor name, or bytes that do not fit a tensor's shape.
        """
        from collections import Counter

        from runtime.model.formats import FLOAT_FORMATS, note_dequantized, weight_from_gguf

        heads = self.config["num_attention_heads"]
        kv_heads = self.config["num_key_value_heads"]
        dequantized: Counter[str] = Counter()
        for t in self._tensors:
            name = hf_tensor_name(t.name)
            if name is None:
                continue
            kind = t.tensor_type.name
            n = (heads if ".attn_q." in t.name else kv_heads if ".attn_k." in t.name
                 else 0) if self.arch in _PERMUTED_ARCHS else 0
            if blocks and kind not in FLOAT_FORMATS and len(t.shape) == 2:
                shape = (t.shape[0], t.shape[1])
                w = weight_from_gguf(t.data, kind, shape)  # t.data: a view of the mapping
                if w is not None:
                    if n:
                        import torch

                        w = w.take_rows(torch.from_numpy(unpermute_qk(np.arange(shape[0]), n)))
                    yield name, w
                    continue
                dequantized[kind] += 1
            if floats:
                w = self._dequantize(t)
                yield name, unpermute_qk(w, n) if n else w
        note_dequantized(dequantized, self.path)

    def iter_blocks(self) -> Iterator[tuple[str, Any]]:
        """Yield ``(hf_name, weight)`` for every matrix stored in a format computed as stored
        (:meth:`iter_weights` without the float tensors).

        Raises:
            ModelError: an unknown tensor name, or bytes that do not fit a shape.
        """
        yield from self.iter_weights(blocks=True, floats=False)

    def iter_tensors(self) -> Iterator[tuple[str, np.ndarray]]:
        """Yield ``(hf_name, float32 array)`` in file order, Q/K un-permuted where needed
        (:meth:`iter_weights` with every tensor dequantized).

        Raises:
            ModelError: an unknown tensor name or an unsupported quantization.
        """
        yield from self.iter_weights(blocks=False)
