"""Load a Hugging Face checkpoint folder: config, safetensors weights, tokenizer.

Owner: the loader. Reads only; never writes into the folder. A folder holds
``config.json``, one ``model.safetensors`` or shards listed in
``model.safetensors.index.json``, ``tokenizer.json`` (a fast tokenizer),
``tokenizer_config.json`` (chat template, special tokens) and optionally
``generation_config.json`` (extra EOS ids) and ``chat_template.jinja``.

Weights keep their HF names (``model.layers.0.self_attn.q_proj.weight``) and are cast to
the requested dtype on the requested device, one tensor at a time (peak memory is one
tensor beyond the result).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from pie_ctx.proto.errors import ModelError
from pie_ctx.proto.tokenizer import Tokenizer

__all__ = ["read_json", "read_config", "weight_files", "load_weights", "load_tokenizer"]


def read_json(path: Path, *, required: bool = True) -> dict[str, Any] | None:
    """Parse a JSON object file.

    Args:
        path: the file.
        required: if False, a missing file returns None.

    Raises:
        ModelError: the file is missing (and required) or not a JSON object.
    """
    if not path.is_file():
        if required:
            raise ModelError(f"model file {path} is missing; the model folder is incomplete "
                             "(re-download it, or for the default model run `pie-ctx models pull`)")
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelError(f"model file {path} is corrupt ({e}); re-download it") from None
    if not isinstance(data, dict):
        raise ModelError(f"model file {path} should hold a JSON object")
    return data


def read_config(folder: Path) -> dict[str, Any]:
    """The folder's ``config.json`` as a dict.

    Raises:
        ModelError: missing or corrupt.
    """
    cfg = read_json(folder / "config.json")
    if cfg is None:  # required=True raises instead; this guards the type only
        raise RuntimeError("read_json(required=True) returned None")
    return cfg


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files of the checkpoint, in a stable order.

    Raises:
        ModelError: no safetensors file, or the shard index names a missing shard.
    """
    index = read_json(folder / "model.safetensors.index.json", required=False)
    if index is not None:
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelError(f"{folder / 'model.safetensors.index.json'} has no weight_map")
        files = [folder / name for name in sorted(set(weight_map.values()))]
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelError(f"model folder {folder} has no *.safetensors weights (pytorch .bin "
                         "checkpoints are not supported; convert them to safetensors)")
    for f in files:
        if not f.is_file():
            raise ModelError(f"weight shard {f} is missing; re-download the model")
    return files


def load_weights(
    folder: Path,
    dtype: torch.dtype,
    device: torch.device,
    progress: Callable[[int], None] | None = None,
) -> dict[str, torch.Tensor]:
    """Read every tensor of the checkpoint, cast to ``dtype`` on ``device``.

    Args:
        folder: the checkpoint folder.
        dtype: floating dtype for floating tensors (integer tensors keep theirs).
        device: where the tensors go.
        progress: called with 1 after each tensor (e.g. a tqdm ``update``).

    Returns:
        HF tensor name -> tensor.

    Raises:
        ModelError: a shard is missing, truncated or corrupt, or a name repeats.
    """
    from safetensors import SafetensorError, safe_open

    weights: dict[str, torch.Tensor] = {}
    for path in weight_files(folder):
        hint = ("delete it and re-download (for the default model: "
                "`pie-ctx models pull --force`)")
        try:
            f = safe_open(str(path), framework="pt", device="cpu")
        except (SafetensorError, OSError, RuntimeError) as e:
            raise ModelError(f"weight file {path} is corrupt or truncated ({e}); {hint}") from None
        with f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if name in weights:
                    raise ModelError(f"tensor {name} appears in two shards ({path})")
                try:
                    t = f.get_tensor(name)
                except (SafetensorError, OSError, RuntimeError) as e:
                    raise ModelError(f"weight file {path} is corrupt: tensor {name} is "
                                     f"unreadable ({e}); {hint}") from None
                # Casting may raise (e.g. out of device memory): not a file problem.
                weights[name] = (t.to(device=device, dtype=dtype) if t.is_floating_point()
                                 else t.to(device))
                if progress is not None:
                    progress(1)
    return weights


def _token_text(value: Any) -> str | None:
    """A special token from tokenizer_config.json: a string or ``{"content": ...}``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _chat_template(folder: Path, tok_cfg: dict[str, Any]) -> str | None:
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    template = tok_cfg.get("chat_template")
    if template is None:
        side = read_json(folder / "chat_template.json", required=False)
        template = side.get("chat_template") if side else None
    if isinstance(template, list):  # named templates: use "default"
        by_name = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = by_name.get("default") or next(iter(by_name.values()), None)
    return template if isinstance(template, str) else None


def load_tokenizer(folder: Path, config: dict[str, Any] | None = None) -> Tokenizer:
    """Build the model's :class:`Tokenizer` from the folder's tokenizer files.

    Args:
        folder: the checkpoint folder.
        config: the parsed config.json (fallback source of bos/eos ids).

    Raises:
        ModelError: ``tokenizer.json`` is missing or corrupt.
    """
    import tokenizers

    path = folder / "tokenizer.json"
    if not path.is_file():
        raise ModelError(f"tokenizer file {path} is missing; pie-ctx needs a fast tokenizer "
                         "(tokenizer.json), save one with transformers' tokenizer.save_pretrained")
    try:
        backend = tokenizers.Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception on bad JSON
        raise ModelError(f"tokenizer file {path} is corrupt ({e}); re-download it") from None
    tok_cfg = read_json(folder / "tokenizer_config.json", required=False) or {}
    gen_cfg = read_json(folder / "generation_config.json", required=False) or {}
    config = config or {}

    def by_id(key: str) -> str | None:
        i = gen_cfg.get(key, config.get(key))
        i = i[0] if isinstance(i, list) and i else i
        return backend.id_to_token(i) if isinstance(i, int) else None

    bos = _token_text(tok_cfg.get("bos_token")) or by_id("bos_token_id")
    eos = _token_text(tok_cfg.get("eos_token")) or by_id("eos_token_id")
    extra: list[int] = []
    for source in (gen_cfg, config):
        ids = source.get("eos_token_id")
        extra.extend(ids if isinstance(ids, list) else [ids] if isinstance(ids, int) else [])
    template_vars = {k: _token_text(tok_cfg.get(k)) for k in ("pad_token", "unk_token")
                     if _token_text(tok_cfg.get(k)) is not None}
    return Tokenizer(backend, chat_template=_chat_template(folder, tok_cfg), bos_token=bos,
                     eos_token=eos, extra_stop_token_ids=extra, extra_template_vars=template_vars)
