"""Read a PEFT LoRA folder (``adapter_config.json`` + ``adapter_model.safetensors``).

Owner: nothing after it returns; :class:`LoraAdapter` is plain data (fp32 CPU tensors)
that :mod:`runtime.model.adapters.delta` fuses for one model.

Accepted: plain LoRA on the seven projections a Llama/Qwen2/Qwen3 LoRA targets (q/k/v/o,
gate/up/down), any rank (``rank_pattern`` included: a module's rank is its tensors'),
``lora_alpha``, ``use_rslora``, ``layers_to_transform``. Refused with :class:`ModelError`
naming the folder: DoRA, LoRA biases, embedding or lm_head LoRA, ``modules_to_save``,
``alpha_pattern``, any other tensor, and shapes or a base model that are not the engine's.

The adapter's identity (:attr:`LoraAdapter.key`) is a hash of its tensors and scales, not
of its name: the same weights under two names share pages, and a name reloaded with other
weights never reuses the old pages.
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

import torch
import xxhash

from pie_ctx.proto.errors import ModelError
from runtime.model.config import ModelConfig

__all__ = ["TARGETS", "LoraAdapter", "load_peft"]

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\."
                  r"(" + "|".join(TARGETS) + r")\.lora_([AB])(?:\.default)?\.weight$")
_ID_TAG = b"pie-ctx/lora/v1"


@dataclass(slots=True)
class LoraAdapter:
    """A LoRA adapter as read from disk: ``delta(x) = (x @ A.T) @ B.T * scale`` per module.

    ``modules[(layer, target)] = (A [r, in] fp32, B [out, r] fp32, scale)``.
    """

    name: str
    path: str
    key: int  # u64 identity, never 0 (0 is the base model): see the module docstring
    rank: int  # the largest rank of any module
    alpha: float
    targets: list[str]
    modules: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor, float]] = field(
        default_factory=dict)


def _module_dims(c: ModelConfig, target: str) -> tuple[int, int]:
    """(in, out) features of one projection of the base model."""
    hd, qd, kvd, inter = (c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim,
                          c.intermediate_size)
    return {"q_proj": (hd, qd), "k_proj": (hd, kvd), "v_proj": (hd, kvd), "o_proj": (qd, hd),
            "gate_proj": (hd, inter), "up_proj": (hd, inter), "down_proj": (inter, hd)}[target]


def _same_model(base: str, model_name: str) -> bool:
    """Whether a PEFT ``base_model_name_or_path`` names the engine's model (by its last
    path component, case-insensitive: a hub id and a local copy of it agree)."""
    def tail(s: str) -> str:
        return s.rstrip("/").rsplit("/", 1)[-1].lower()
    return not base or not model_name or tail(base) == tail(model_name)


def _read_config(folder: Path) -> dict:
    path = folder / "adapter_config.json"
    if not folder.is_dir():
        raise ModelError(f"adapter folder {folder} does not exist; pass a PEFT LoRA folder")
    if not path.is_file():
        raise ModelError(f"{path} is missing: an adapter folder holds adapter_config.json and "
                         "adapter_model.safetensors (PEFT's save_pretrained)")
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ModelError(f"{path} is not valid JSON: {err}") from None
    if not isinstance(cfg, dict):
        raise ModelError(f"{path} must hold a JSON object")
    return cfg


def _check_config(cfg: dict, folder: Path, model_name: str) -> None:
    where = folder / "adapter_config.json"
    kind = str(cfg.get("peft_type", "LORA")).upper()
    if kind != "LORA":
        raise ModelError(f"{where}: peft_type {kind}; only LoRA adapters are supported")
    if cfg.get("use_dora"):
        raise ModelError(f"{where}: DoRA adapters (use_dora) are not supported; use plain LoRA")
    if cfg.get("bias", "none") != "none":
        raise ModelError(f"{where}: LoRA biases (bias={cfg['bias']!r}) are not supported; "
                         "train with bias='none'")
    if cfg.get("modules_to_save"):
        raise ModelError(f"{where}: modules_to_save ({cfg['modules_to_save']}) replaces whole "
                         "base modules; only LoRA deltas are supported")
    if cfg.get("alpha_pattern"):
        raise ModelError(f"{where}: alpha_pattern is not supported; use one lora_alpha")
    targets = cfg.get("target_modules") or []
    if isinstance(targets, str):
        targets = [targets]
    for t in targets:
        if t in ("embed_tokens", "lm_head"):
            raise ModelError(f"{where}: embedding LoRA ({t}) is not supported; target the "
                             f"projections {', '.join(TARGETS)}")
        if t not in TARGETS:
            raise ModelError(f"{where}: target module {t!r} is not supported; targets must be "
                             f"among {', '.join(TARGETS)}")
    base = cfg.get("base_model_name_or_path") or ""
    if not _same_model(str(base), model_name):
        raise ModelError(f"{where}: the adapter was trained on {base!r} but this engine runs "
                         f"{model_name!r}; load it on an engine running that model")


def check_folder(path: str | Path) -> None:
    """The checks that need no model: the folder, its config and its weights file exist and
    the config is a LoRA pie-ctx runs (``--adapter`` runs them before the model loads).

    Raises:
        ModelError: what :func:`load_peft` would refuse for the same reason.
    """
    folder = Path(path)
    _check_config(_read_config(folder), folder, "")
    if not (folder / "adapter_model.safetensors").is_file():
        raise ModelError(f"{folder / 'adapter_model.safetensors'} is missing (a .bin adapter? "
                         "save it with safe_serialization=True)")


def load_peft(name: str, path: str | Path, config: ModelConfig,
              model_name: str = "") -> LoraAdapter:
    """Read and check a PEFT LoRA folder against the engine's model.

    Args:
        name: the name the adapter is served under.
        path: the folder (``adapter_config.json`` + ``adapter_model.safetensors``).
        config: the engine's model config (every tensor's shape is checked against it).
        model_name: the engine's model name, compared with ``base_model_name_or_path``
            by its last path component ("" skips that check; shapes are always checked).

    Returns:
        The adapter, its tensors fp32 on CPU.

    Raises:
        ModelError: the folder is missing, malformed or not a supported LoRA of this model
            (the message names the file and what to do).
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    folder = Path(path)
    cfg = _read_config(folder)
    _check_config(cfg, folder, model_name)
    weights_path = folder / "adapter_model.safetensors"
    if not weights_path.is_file():
        raise ModelError(f"{weights_path} is missing (a .bin adapter? save it with "
                         "safe_serialization=True)")
    try:
        tensors = load_file(str(weights_path))
    except (SafetensorError, OSError, ValueError) as err:
        raise ModelError(f"{weights_path} could not be read: {err}") from None
    alpha = float(cfg.get("lora_alpha", cfg.get("r", 8)))
    rslora = bool(cfg.get("use_rslora", False))
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.match(key)
        if m is None:
            if "lora_magnitude_vector" in key:
                why = "DoRA magnitude vectors are not supported"
            elif "embed" in key or "lm_head" in key:
                why = "embedding LoRA is not supported"
            elif key.endswith(".bias"):
                why = "LoRA biases are not supported"
            else:
                why = f"only LoRA A/B weights of {', '.join(TARGETS)} are supported"
            raise ModelError(f"{weights_path}: tensor {key!r}: {why}")
        layer, target = int(m.group(1)), m.group(2)
        if layer >= config.num_layers:
            raise ModelError(f"{weights_path}: tensor {key!r} is for layer {layer} but the "
                             f"engine's model has {config.num_layers} layers: another base model")
        halves.setdefault((layer, target), {})[m.group(3)] = t
    if not halves:
        raise ModelError(f"{weights_path} holds no LoRA weights")
    modules: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor, float]] = {}
    digest = xxhash.xxh3_64(_ID_TAG)
    for (layer, target), ab in sorted(halves.items()):
        if set(ab) != {"A", "B"}:
            raise ModelError(f"{weights_path}: layer {layer} {target} has lora_{''.join(ab)} "
                             "without its other half")
        a, b = ab["A"].float().contiguous(), ab["B"].float().contiguous()
        fan_in, fan_out = _module_dims(config, target)
        r = int(a.shape[0]) if a.dim() == 2 else -1
        if a.dim() != 2 or b.dim() != 2 or tuple(a.shape) != (r, fan_in) \
                or tuple(b.shape) != (fan_out, r) or r < 1:
            raise ModelError(
                f"{weights_path}: layer {layer} {target} has A {tuple(a.shape)} and B "
                f"{tuple(b.shape)}; this engine's model needs A [r, {fan_in}] and B "
                f"[{fan_out}, r]: the adapter is for another base model")
        scale = alpha / (math.sqrt(r) if rslora else r)
        modules[(layer, target)] = (a, b, scale)
        digest.update(struct.pack("<I", layer) + target.encode() + struct.pack("<d", scale))
        digest.update(a.numpy().tobytes())
        digest.update(b.numpy().tobytes())
    return LoraAdapter(name=name, path=str(folder), key=digest.intdigest() or 1,
                       rank=max(a.shape[0] for a, _, _ in modules.values()), alpha=alpha,
                       targets=sorted({t for _, t in modules}, key=TARGETS.index),
                       modules=modules)
