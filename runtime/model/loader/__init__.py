"""Model loading: resolve a model reference, fetch/convert if needed, load weights + tokenizer.

Owner: this package owns the on-disk model cache (see :mod:`.cache`) and produces
:class:`LoadedModel` records; it never runs the model. Public API::

    loaded = load_model()                       # the default SmolLM2-135M-Instruct
    loaded = load_model("smollm2-135m")         # a known short name
    loaded = load_model("/path/to/hf-folder")   # config.json + *.safetensors + tokenizer.json
    loaded = load_model("/path/to/model.gguf")  # read in place (config/tokenizer cached)
    loaded.config, loaded.weights["model.embed_tokens.weight"], loaded.tokenizer.encode("hi")

A GGUF is read in place, as llama.cpp reads it: the file is memory-mapped and its tensors
are taken from the mapping at every start; the cache holds only its config and tokenizer
(:mod:`.convert`). ``load_model(..., blocks=True)`` keeps the matrices stored in a type the
block kernels compute as block weights on the file's bytes (``weights="gguf"``; see
``runtime.model.gguf_weights``); otherwise every tensor is dequantized in memory, to
float32, then the requested dtype (float32 on CPU, bfloat16 on CUDA, unless ``dtype``
says).
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pie_ctx.proto.errors import InvalidArgument, ModelError
from pie_ctx.proto.tokenizer import IncrementalDecoder, Tokenizer

from ..config import ModelConfig
from . import cache
from .convert import ensure_converted, gguf_cache_name
from .default import DEFAULT_NAME, default_gguf_path, ensure_default
from .gguf_file import SUPPORTED_GGUF_ARCHS
from .hf import load_tokenizer, load_weights, read_config

__all__ = [
    "LoadedModel", "CachedModel", "load_model", "resolve_model", "resolve_device",
    "resolve_dtype", "list_cached_models",
    "pull_default", "default_gguf_path", "Tokenizer", "IncrementalDecoder", "KNOWN_MODELS",
    "load_blocks", "gguf_source", "gguf_blocks_source", "gguf_weights", "dense_folder",
    "split_fused",
]

# Short names -> cache entry of a model pie-ctx knows how to fetch.
KNOWN_MODELS: dict[str, str] = {
    "default": DEFAULT_NAME,
    "smollm2-135m": DEFAULT_NAME,
    "smollm2-135m-instruct": DEFAULT_NAME,
}

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}


@dataclass(slots=True)
class LoadedModel:
    """A model ready for the runner: config, weights (HF names) and tokenizer."""

    name: str
    config: ModelConfig
    config_dict: dict[str, Any]
    weights: dict[str, torch.Tensor]
    tokenizer: Tokenizer
    path: Path
    dtype: torch.dtype = torch.float32  # of the float weights (block weights keep theirs)
    device: torch.device = torch.device("cpu")


@dataclass(slots=True)
class CachedModel:
    """One converted model in the cache (for ``pie-ctx models``)."""

    name: str
    path: Path
    size_bytes: int
    source: dict[str, Any]


def resolve_device(device: str | torch.device | None) -> torch.device:
    """The torch device a model loads onto (None: CUDA when available, else CPU)."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return torch.device(device)
    except (RuntimeError, TypeError):
        raise InvalidArgument(f"device {device!r} is not a torch device (try 'cpu' or 'cuda')") from None


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """The compute dtype named by ``dtype`` (None: float32 on CPU, bfloat16 on CUDA)."""
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
        return dtype
    if isinstance(dtype, str) and dtype.lower() in _DTYPES:
        return _DTYPES[dtype.lower()]
    raise InvalidArgument(f"dtype {dtype!r} is unsupported; use float32, bfloat16 or float16")


def resolve_model(ref: str | Path | None = None, *, progress: bool = True,
                  dense: bool = False) -> tuple[str, Path]:
    """Turn a model reference into ``(name, HF-layout folder)``, fetching/converting if needed.

    Args:
        ref: None or ``"default"`` (the default model), a known short name (see
            :data:`KNOWN_MODELS`), a checkpoint folder, or a ``.gguf`` file.
        progress: show fetch/convert progress on stderr.
        dense: for a GGUF, the folder that also holds its weights dequantized to float32
            safetensors (for loaders that read only those: the transformers backend).

    Returns:
        The model's display name and the folder to load.

    Raises:
        ModelError: the reference names nothing loadable.
    """
    if ref is None or (isinstance(ref, str) and ref.lower() in KNOWN_MODELS):
        name = KNOWN_MODELS[(ref or "default").lower()]
        folder = ensure_default(progress=progress)
        return name, dense_folder(folder, progress=progress) if dense else folder
    path = Path(ref).expanduser()
    if path.is_dir():
        return path.name, path
    if path.is_file() and path.suffix.lower() == ".gguf":
        folder = ensure_converted(path, gguf_cache_name(path), progress=progress)
        return path.stem, dense_folder(folder, progress=progress) if dense else folder
    if path.is_file():
        raise ModelError(f"model file {path} is not a .gguf; pass a GGUF file or an HF folder")
    raise ModelError(f"model {str(ref)!r} not found: not a known name "
                     f"({', '.join(sorted(KNOWN_MODELS))}), a folder, or a .gguf file")


def load_model(
    ref: str | Path | None = None,
    *,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device | None = None,
    progress: bool = True,
    blocks: bool = False,
) -> LoadedModel:
    """Load a model's config, weights and tokenizer.

    Args:
        ref: see :func:`resolve_model` (None = the default SmolLM2-135M-Instruct).
        dtype: weight dtype; default float32 on CPU, bfloat16 on CUDA.
        device: where weights go; default CUDA when available, else CPU.
        progress: show fetch/convert progress bars on stderr.
        blocks: for a GGUF, keep each matrix the block kernels compute as a block weight
            on the memory-mapped file (``weights="gguf"``); an HF folder ignores it.

    Returns:
        The :class:`LoadedModel`.

    Raises:
        InvalidArgument: bad dtype or device.
        ModelError: a file is missing, corrupt or unsupported (the message says which and
            what to do).
    """
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    name, folder = resolve_model(ref, progress=progress)
    config_dict = read_config(folder)
    config = ModelConfig.from_hf_config(config_dict)
    source = gguf_blocks_source(folder)
    weights = (split_fused(load_weights(folder, dt, dev), config) if source is None
               else gguf_weights(source, dt, dev, blocks=blocks))
    embed = weights.get("model.embed_tokens.weight")
    if embed is None:
        raise ModelError(f"model {folder} has no model.embed_tokens.weight; is it a causal LM?")
    shape = ((embed.out_features, embed.in_features) if not isinstance(embed, torch.Tensor)
             else tuple(embed.shape))
    if shape != (config.vocab_size, config.hidden_size):
        raise ModelError(f"model {folder}: embedding shape {shape} does not match "
                         f"config.json (vocab_size={config.vocab_size}, "
                         f"hidden_size={config.hidden_size}); the folder mixes two checkpoints")
    tokenizer = load_tokenizer(folder, config_dict)
    return LoadedModel(name=name, config=config, config_dict=config_dict, weights=weights,
                       tokenizer=tokenizer, path=folder, dtype=dt, device=dev)


_FUSED = re.compile(r"^(.*)\.(self_attn\.qkv_proj|mlp\.gate_up_proj)\.(weight|bias)$")


def split_fused(weights: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """``weights`` with a checkpoint's fused projections (Phi-3's ``self_attn.qkv_proj``,
    rows ``[q; k; v]``, and ``mlp.gate_up_proj``, rows ``[gate; up]``) split into the
    separate HF names every other part of the runner reads (layers fuse them again, tensor
    parallelism shards them, adapters name them)."""
    c = config
    sizes = {"self_attn.qkv_proj": (("self_attn.q_proj", c.num_heads * c.head_dim),
                                    ("self_attn.k_proj", c.num_kv_heads * c.head_dim),
                                    ("self_attn.v_proj", c.num_kv_heads * c.head_dim)),
             "mlp.gate_up_proj": (("mlp.gate_proj", c.intermediate_size),
                                  ("mlp.up_proj", c.intermediate_size))}
    out: dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        m = _FUSED.match(name)
        if m is None:
            out[name] = tensor
            continue
        parts = sizes[m.group(2)]
        if tensor.shape[0] != sum(n for _, n in parts):
            raise ModelError(f"checkpoint tensor {name!r} has {tensor.shape[0]} rows, "
                             f"expected {sum(n for _, n in parts)}")
        for (part, _), piece in zip(parts, tensor.split([n for _, n in parts]), strict=True):
            out[f"{m.group(1)}.{part}.{m.group(3)}"] = piece.contiguous()
    return out


def gguf_source(folder: Path) -> Path | None:
    """The GGUF a cached folder was converted from (None: an HF folder).

    Raises:
        ModelError: the folder was converted from a GGUF that is no longer there.
    """
    manifest = cache.read_manifest(Path(folder))
    source = (manifest or {}).get("source", {}).get("gguf")
    if not source:
        return None
    path = Path(source)
    if not path.is_file():
        raise ModelError(f"model {folder} was converted from {path}, which is gone; weights='gguf' "
                         "computes on that file's blocks: put it back, or use --weights fp32 "
                         "or int8")
    return path


def gguf_blocks_source(folder: Path) -> Path | None:
    """The GGUF ``folder`` reads in place: its source when pie-ctx's own reader converted it
    (Llama, Qwen2, Qwen3); None for an HF folder, and for a GGUF transformers converted
    (``.gguf_transformers``: its folder holds the dequantized weights, and it runs on them).

    Raises:
        ModelError: the folder was converted from a GGUF that is no longer there.
    """
    path = gguf_source(folder)
    if path is None:
        return None
    arch = (read_config(folder).get("architectures") or [""])[0]
    return path if arch in {hf for hf, _ in SUPPORTED_GGUF_ARCHS.values()} else None


def dense_folder(folder: Path, *, progress: bool = False) -> Path:
    """``folder`` as a complete HF checkpoint (with safetensors weights), for loaders that
    read only those (transformers' ``from_pretrained``): for a GGUF read in place, its
    dense cache entry (written on first use, float32); else ``folder`` itself (an HF
    folder, or a GGUF transformers converted, which holds its weights already).

    Raises:
        ModelError: the GGUF is gone or unreadable, or the cache is not writable.
    """
    path = gguf_blocks_source(Path(folder))
    if path is None:
        return Path(folder)
    return ensure_converted(path, Path(folder).name, progress=progress, dense=True)


def gguf_weights(path: Path, dtype: torch.dtype, device: torch.device, *,
                 blocks: bool) -> dict[str, Any]:
    """The weights of the GGUF ``path`` by HF name, read in place: with ``blocks``, each
    matrix in a format computed as stored (``runtime.model.formats``) as its family's
    weight on the memory-mapped file; every other tensor as a ``dtype`` tensor on
    ``device`` (``GGUFModel.iter_weights``).

    Raises:
        ModelError: the file is unreadable or describes an unsupported model.
    """
    from .gguf_file import GGUFModel

    out: dict[str, Any] = {}
    for name, w in GGUFModel(path).iter_weights(blocks=blocks):
        # (a float32 tensor may be a view of the read-only mapping: tensors get their own)
        out[name] = (torch.from_numpy(np.require(w, np.float32, ["C", "W"]))
                     .to(device=device, dtype=dtype)
                     if isinstance(w, np.ndarray) else w)
    return out


def load_blocks(folder: Path) -> dict[str, Any] | None:
    """The matrices of the GGUF ``folder`` was converted from whose formats are computed as
    stored (``runtime.model.formats``), as weights on the memory-mapped file by HF name, or
    None for an HF folder.

    Raises:
        ModelError: the GGUF is gone, or was converted by transformers (its blocks are
            not read).
    """
    from .gguf_file import GGUFModel

    path = gguf_source(folder)
    if path is None:
        return None
    if gguf_blocks_source(folder) is None:
        arch = (read_config(folder).get("architectures") or ["?"])[0]
        raise ModelError(f"weights='gguf' computes on the blocks of Llama, Qwen2 and Qwen3 GGUFs; "
                         f"{path.name} ({arch}) runs on its dequantized weights: use --weights "
                         "fp32 or int8")
    return dict(GGUFModel(path).iter_blocks())


def pull_default(*, force: bool = False, progress: bool = True) -> Path:
    """Fetch and convert the default model into the cache (``pie-ctx models pull``).

    Args:
        force: fetch and convert again even if cached.
        progress: show progress bars on stderr.

    Returns:
        The converted folder.

    Raises:
        ModelError: fetch, verification or conversion failed.
    """
    folder = ensure_default(progress=progress, force=force)
    if progress:
        print(f"pie-ctx: default model ready in {folder}", file=sys.stderr)
    return folder


def list_cached_models() -> list[CachedModel]:
    """Every complete converted model in the cache, sorted by name (``pie-ctx models``)."""
    root = cache.models_dir()
    out: list[CachedModel] = []
    if not root.is_dir():
        return out
    for folder in sorted(root.iterdir()):
        manifest = cache.read_manifest(folder) if folder.is_dir() else None
        if manifest is None:
            continue
        size = sum(int(v) for v in manifest.get("files", {}).values())
        out.append(CachedModel(name=folder.name, path=folder, size_bytes=size,
                               source=dict(manifest.get("source", {}))))
    return out
