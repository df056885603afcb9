"""Model hyper-parameters, read from a Hugging Face ``config.json`` dict.

Owner: the model runner. ``ModelConfig`` is frozen: it describes a loaded checkpoint and
never changes after load. Loaders (HF folders, GGUF) build one with
:meth:`ModelConfig.from_hf_config`, feeding either the checkpoint's ``config.json`` or an
equivalent dict synthesised from GGUF metadata.

Supported architectures: Llama (Llama 2/3, SmolLM2; rope scaling ``llama3`` and
``linear``), Mistral without a sliding window (a Llama), Phi-3 with plain RoPE over the
whole head (a Llama whose checkpoint fuses q/k/v and gate/up: Phi-3-mini-4k and
Phi-3-medium-4k), Qwen2 (q/k/v bias) and Qwen3 (q/k RMSNorm, explicit ``head_dim``). Both the
transformers 4 layout (``rope_theta`` + ``rope_scaling``) and the transformers 5 layout
(``rope_parameters``) are accepted. Anything else raises :class:`ModelError`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pie_ctx.proto.errors import ModelError

__all__ = ["ModelConfig", "SUPPORTED_ARCHITECTURES"]

Arch = Literal["llama", "qwen2", "qwen3", "phi3"]

# HF `architectures` entry -> our arch name. model_type is the fallback key.
SUPPORTED_ARCHITECTURES: dict[str, Arch] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",  # without a sliding window (checked below)
    "Phi3ForCausalLM": "phi3",  # plain RoPE over the whole head (checked below)
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
_MODEL_TYPES: dict[str, Arch] = {"llama": "llama", "mistral": "llama", "phi3": "phi3",
                                 "qwen2": "qwen2", "qwen3": "qwen3"}
_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a decoder-only transformer (see docs/design.md, runtime/model).

    ``rope_scaling`` is None for plain RoPE, else a dict with at least ``rope_type``
    (``"linear"`` or ``"llama3"``) and that type's parameters (``factor``, and for llama3
    ``low_freq_factor``, ``high_freq_factor``, ``original_max_position_embeddings``).
    ``attention_bias`` means q/k/v projections carry a bias (always true for Qwen2); an
    o_proj bias, when present, is picked up from the weights.
    """

    arch: Arch
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            if int(getattr(self, name)) <= 0:
                raise ModelError(f"model config: {name} must be positive, got {getattr(self, name)!r}")
        if self.num_heads % self.num_kv_heads != 0:
            raise ModelError(
                f"model config: num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2 != 0:
            raise ModelError(f"model config: head_dim must be even for RoPE, got {self.head_dim}")

    @property
    def num_queries_per_kv(self) -> int:
        """How many query heads share one K/V head (1 = multi-head attention)."""
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf_config(cls, d: dict[str, Any]) -> ModelConfig:
        """Build a config from a Hugging Face ``config.json`` dict.

        Args:
            d: the parsed ``config.json`` (transformers 4 or 5 layout).

        Returns:
            The frozen :class:`ModelConfig`.

        Raises:
            ModelError: the architecture, activation or rope scaling is unsupported, or a
                required field is missing.
        """
        arch = _detect_arch(d)
        try:
            hidden = int(d["hidden_size"])
            num_heads = int(d["num_attention_heads"])
            num_layers = int(d["num_hidden_layers"])
            vocab = int(d["vocab_size"])
            inter = int(d["intermediate_size"])
        except KeyError as e:
            raise ModelError(f"model config.json is missing required field {e.args[0]!r}") from None
        num_kv = int(d.get("num_key_value_heads") or num_heads)
        head_dim = d.get("head_dim")
        head_dim = int(head_dim) if head_dim else hidden // num_heads
        act = d.get("hidden_act", d.get("hidden_activation", "silu"))
        if act != "silu":
            raise ModelError(f"model config: hidden_act {act!r} is unsupported (only 'silu')")
        if d.get("mlp_bias"):
            raise ModelError("model config: mlp_bias=true is unsupported")
        if arch == "qwen2" and d.get("use_sliding_window"):
            raise ModelError("model config: Qwen2 sliding-window attention is unsupported")
        window = d.get("sliding_window")
        if arch in ("llama", "phi3") and window and int(window) < int(
                d.get("max_position_embeddings", 2048)):
            raise ModelError(f"model config: a sliding window of {window} tokens is unsupported "
                             "by the native runner (the transformers backend runs it)")
        rope_theta, rope_scaling = _rope_from_hf(d)
        if arch == "qwen2":
            attention_bias = True  # Qwen2 always has q/k/v bias and no config flag for it
        else:
            attention_bias = bool(d.get("attention_bias", False))
        return cls(
            arch=arch,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=inter,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv,
            head_dim=head_dim,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            qk_norm=arch == "qwen3",
        )


def _detect_arch(d: dict[str, Any]) -> Arch:
    """Map ``architectures`` (or ``model_type``) to one of our arch names."""
    archs = d.get("architectures") or []
    for name in archs:
        if name in SUPPORTED_ARCHITECTURES:
            return SUPPORTED_ARCHITECTURES[name]
    if not archs and d.get("model_type") in _MODEL_TYPES:
        return _MODEL_TYPES[d["model_type"]]
    got = archs or d.get("model_type")
    raise ModelError(
        f"unsupported model architecture {got!r}; supported: "
        f"{', '.join(SUPPORTED_ARCHITECTURES)} (Llama 2/3, SmolLM2, Qwen2, Qwen3)"
    )


def _rope_from_hf(d: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """Return (rope_theta, rope_scaling) from either config layout.

    transformers 5 writes ``rope_parameters = {"rope_type", "rope_theta", ...}``;
    transformers 4 writes ``rope_theta`` and ``rope_scaling`` (with ``type`` or
    ``rope_type``) at top level.
    """
    params = d.get("rope_parameters")
    if isinstance(params, dict) and params:
        scaling: dict[str, Any] = dict(params)
        theta = float(scaling.pop("rope_theta", d.get("rope_theta", 10000.0)))
    else:
        theta = float(d.get("rope_theta", 10000.0))
        scaling = dict(d.get("rope_scaling") or {})
    rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    scaling.pop("type", None)
    partial = scaling.pop("partial_rotary_factor", d.get("partial_rotary_factor")) or 1.0
    if float(partial) != 1.0:
        raise ModelError(f"model config: partial rotary embeddings (partial_rotary_factor="
                         f"{partial}) are unsupported by the native runner (the transformers "
                         "backend runs them)")
    if rope_type not in _ROPE_TYPES:
        raise ModelError(
            f"model config: rope scaling type {rope_type!r} is unsupported; "
            f"supported: {', '.join(_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return theta, None
    if "factor" not in scaling:
        raise ModelError(f"model config: rope scaling {rope_type!r} needs a 'factor'")
    if rope_type == "llama3":
        for key in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            if key not in scaling:
                raise ModelError(f"model config: llama3 rope scaling needs {key!r}")
    out: dict[str, Any] = {"rope_type": rope_type}
    out.update({k: v for k, v in scaling.items() if v is not None})
    return theta, out
