"""The per-user model cache: where it lives, how entries are locked and published.

Owner: the loader. Layout under the cache root (``$PIE_CTX_CACHE``, else
``$XDG_CACHE_HOME/pie-ctx``, else ``~/.cache/pie-ctx``)::

    downloads/<name>/<file>.gguf   fetched source files (verified by sha256 on arrival)
    models/<name>/                 a GGUF's config and tokenizer (HF layout, no weights), or
                                   the default model's
    dense/<name>/                  the same with float32 safetensors, for the transformers
                                   backend (written on first use)
    locks/<name>.lock              one lock file per entry

Invariants: a folder under ``models/`` is complete or absent. It is built in a temporary
sibling and renamed into place (atomic on one filesystem), and it carries a manifest
(``pie-ctx-manifest.json``) listing each file's size; processes that fetch or convert the
same entry at once serialise on the entry's lock file.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pie_ctx.proto.errors import ModelError

__all__ = [
    "MANIFEST", "cache_root", "models_dir", "dense_dir", "downloads_dir", "entry_lock", "staging_dir",
    "publish", "write_manifest", "read_manifest", "check_manifest",
]

MANIFEST = "pie-ctx-manifest.json"
MANIFEST_FORMAT = 1


def cache_root() -> Path:
    """The cache root folder (not created)."""
    env = os.environ.get("PIE_CTX_CACHE")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "pie-ctx"


def models_dir() -> Path:
    """Folder of converted models (HF layout), one sub-folder per model."""
    return cache_root() / "models"


def dense_dir() -> Path:
    """Folder of GGUFs' float32 safetensors copies (for the transformers backend), one
    sub-folder per model, named as its entry under ``models/``."""
    return cache_root() / "dense"


def downloads_dir() -> Path:
    """Folder of fetched source files, one sub-folder per model."""
    return cache_root() / "downloads"


def _mkdir(path: Path) -> Path:
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ModelError(f"cannot create cache folder {path} ({e}); set PIE_CTX_CACHE to a "
                         "writable folder") from None
    return path


@contextlib.contextmanager
def entry_lock(name: str) -> Iterator[None]:
    """Hold the cache lock of entry ``name`` (blocks while another process holds it).

    On platforms without ``fcntl`` this only relies on atomic renames, which still never
    leave a half-written entry visible.
    """
    lock_path = _mkdir(cache_root() / "locks") / f"{name}.lock"
    try:
        import fcntl
    except ImportError:  # Windows: no advisory locks; publish() stays atomic anyway
        yield
        return
    with open(lock_path, "a+b") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def staging_dir(final: Path) -> Path:
    """A fresh temporary folder next to ``final`` (same filesystem, so rename is atomic)."""
    _mkdir(final.parent)
    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    return tmp


def publish(tmp: Path, final: Path) -> Path:
    """Move a finished staging folder into place; if another process won, keep theirs.

    Returns:
        ``final``.
    """
    try:
        os.rename(tmp, final)
    except OSError:
        if not (final / MANIFEST).is_file():
            shutil.rmtree(final, ignore_errors=True)  # an incomplete leftover: replace it
            os.rename(tmp, final)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def write_manifest(folder: Path, source: dict[str, Any]) -> None:
    """Record the folder's files and sizes, plus where they came from, as the last step."""
    files = {p.name: p.stat().st_size for p in sorted(folder.iterdir())
             if p.is_file() and p.name != MANIFEST}
    data = {"format": MANIFEST_FORMAT, "source": source, "files": files}
    (folder / MANIFEST).write_text(json.dumps(data, indent=2, sort_keys=True), encoding="utf-8")


def read_manifest(folder: Path) -> dict[str, Any] | None:
    """The folder's manifest, or None if it has none (or it is unreadable)."""
    try:
        data = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("format") == MANIFEST_FORMAT else None


def check_manifest(folder: Path, fix_hint: str) -> None:
    """Check that every file the manifest lists is present with its recorded size.

    Args:
        folder: a converted model folder.
        fix_hint: what the user should do, appended to the error.

    Raises:
        ModelError: the manifest is missing, or a file is missing or has the wrong size.
    """
    manifest = read_manifest(folder)
    if manifest is None:
        raise ModelError(f"cached model {folder} is incomplete ({MANIFEST} missing); {fix_hint}")
    for name, size in manifest.get("files", {}).items():
        path = folder / name
        if not path.is_file():
            raise ModelError(f"cached model file {path} is missing; {fix_hint}")
        if path.stat().st_size != size:
            raise ModelError(f"cached model file {path} is corrupt (size {path.stat().st_size}, "
                             f"expected {size}); {fix_hint}")
