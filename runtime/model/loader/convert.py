"""Describe a GGUF file once in an HF-layout cache folder, without its weights.

Owner: the loader; writes only under the cache (see :mod:`.cache`). The folder holds what
is slow to derive from the GGUF's metadata and small: ``config.json``,
``generation_config.json``, ``tokenizer.json`` (the tokenizer built from the file's
vocabulary and merges: seconds for a 150k-token vocabulary), ``tokenizer_config.json``
(chat template and special tokens) and the cache manifest, which names the GGUF. The
weights stay in the GGUF: the native runner reads them from it in place at every start
(``GGUFModel.iter_weights``), so the cache never holds a second copy.

The one exception is a dense entry (``dense=True``, ``dense/<name>/`` beside
``models/<name>/``, same name so that the folder's last component is still the model's
name): ``model.safetensors`` with every tensor dequantized to float32, written on first
use for the transformers backend, whose loader reads safetensors folders only.

An architecture pie-ctx's reader does not read (Gemma, Phi-3...: see
:mod:`.gguf_transformers`) is converted by transformers, weights included, into the
``models/<name>/`` folder itself: that folder is complete, and needs no dense entry.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from pathlib import Path
from typing import Any

import numpy as np

from pie_ctx.proto.errors import ModelError

from . import cache
from .gguf_file import SUPPORTED_GGUF_ARCHS, GGUFModel
from .gguf_tokenizer import GGUFTokenizerSpec, build_gguf_tokenizer
from .gguf_transformers import convert_with_transformers, read_gguf_header, transformers_tokenizer

__all__ = ["CONVERTER_VERSION", "convert_gguf", "gguf_cache_name",
           "ensure_converted", "is_current"]

# Bump when the converted layout changes; folders of another version are rebuilt.
# 2: the weights stay in the GGUF (1 held a float32 copy in model.safetensors).
CONVERTER_VERSION = 2


def gguf_cache_name(gguf_path: Path) -> str:
    """Cache entry name of a user GGUF: its stem plus a key of path, size and mtime."""
    st = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()
    return f"gguf-{gguf_path.stem.lower()}-{key[:12]}"


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def convert_gguf(gguf_path: Path, out_dir: Path, *, progress: bool = True,
                 dense: bool = False) -> Path:
    """Write the HF-layout description of ``gguf_path`` into the new folder ``out_dir``.

    Args:
        gguf_path: the source GGUF.
        out_dir: an empty, existing folder (normally a cache staging folder).
        progress: show a tqdm bar over tensors on stderr (``dense`` only).
        dense: also write ``model.safetensors``, every tensor dequantized to float32.

    Returns:
        ``out_dir``.

    An architecture this module does not read (Gemma, Phi-3...) is converted by
    transformers instead (:mod:`.gguf_transformers`): that folder always holds the weights
    (float safetensors, whatever ``dense`` says), since only pie-ctx's own reader reads a
    GGUF in place. A sentencepiece vocabulary's tokenizer is transformers' too.

    Raises:
        ModelError: the GGUF is unreadable or describes an unsupported model or tokenizer.
    """
    if read_gguf_header(gguf_path)[0].get("general.architecture") not in SUPPORTED_GGUF_ARCHS:
        return convert_with_transformers(gguf_path, out_dir)  # (always with its weights)
    model = GGUFModel(gguf_path)
    spec = GGUFTokenizerSpec.from_metadata(model.metadata)
    tokenizer = (build_gguf_tokenizer(spec) if spec.model == "gpt2"
                 else transformers_tokenizer(gguf_path))
    if dense:
        _write_dense(model, out_dir, progress)
    config = dict(model.config)
    _write_json(out_dir / "config.json", config)
    gen = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config}
    if spec.extra_stop_ids and spec.eos_token_id is not None:
        gen["eos_token_id"] = [spec.eos_token_id, *spec.extra_stop_ids]
    _write_json(out_dir / "generation_config.json", gen)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    tok_cfg: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": spec.token(spec.bos_token_id),
        "eos_token": spec.token(spec.eos_token_id),
        "unk_token": spec.token(spec.unk_token_id),
        "pad_token": spec.token(spec.pad_token_id),
        "add_bos_token": spec.add_bos_token,
        "add_eos_token": spec.add_eos_token,
        "model_max_length": config["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
    }
    if spec.chat_template:
        tok_cfg["chat_template"] = spec.chat_template
    _write_json(out_dir / "tokenizer_config.json", {k: v for k, v in tok_cfg.items() if v is not None})
    return out_dir


def _write_dense(model: GGUFModel, out_dir: Path, progress: bool) -> None:
    """``model.safetensors`` of every tensor dequantized to float32 (HF names, Q/K
    un-permuted): the transformers backend's input."""
    from safetensors.numpy import save_file
    from tqdm import tqdm

    tensors: dict[str, np.ndarray] = {}
    bar = tqdm(total=model.num_tensors, desc=f"dequantizing {model.path.name}", unit="tensor",
               file=sys.stderr, disable=not progress, leave=False)
    with bar:
        for name, array in model.iter_tensors():
            tensors[name] = np.ascontiguousarray(array, dtype=np.float32)
            bar.update(1)
    try:
        save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    except OSError as e:
        raise ModelError(f"cannot write {out_dir / 'model.safetensors'} ({e}); free disk space "
                         "or set PIE_CTX_CACHE to another folder") from None


def ensure_converted(gguf_path: Path, name: str, *, progress: bool = True,
                     force: bool = False, dense: bool = False) -> Path:
    """The converted cache folder of ``gguf_path`` under entry ``name`` (under
    ``dense/`` with ``dense``), converting if needed.

    Safe under concurrency: conversion runs under the entry lock into a staging folder that
    is renamed into place, so readers see a complete folder or none.

    Args:
        gguf_path: the source GGUF.
        name: the cache entry name (folder under ``models/``).
        progress: show progress bars on stderr.
        force: rebuild even if a complete conversion exists.
        dense: the folder with ``model.safetensors`` (see the module docstring).

    Returns:
        The converted folder.

    Raises:
        ModelError: as :func:`convert_gguf`, or the cache is not writable.
    """
    final = (cache.dense_dir() if dense else cache.models_dir()) / name
    if not force and is_current(final):
        return final
    with cache.entry_lock(f"{name}.dense" if dense else name):
        if not force and is_current(final):  # another process converted it meanwhile
            return final
        tmp = cache.staging_dir(final)
        try:
            convert_gguf(gguf_path, tmp, progress=progress, dense=dense)
            cache.write_manifest(tmp, {"gguf": str(gguf_path), "converter": CONVERTER_VERSION})
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if final.exists():
            shutil.rmtree(final, ignore_errors=True)
        return cache.publish(tmp, final)


def is_current(folder: Path) -> bool:
    """Whether ``folder`` is a complete conversion of this converter's version."""
    manifest = cache.read_manifest(folder)
    return manifest is not None and manifest.get("source", {}).get("converter") == CONVERTER_VERSION
