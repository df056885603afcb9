"""What a model load measures or computes once per machine, kept on disk for the next load.

Owner: the loads that would otherwise redo per-machine work in every process:
``runtime.model.kernel_choice.choose_kernels`` (the projection kernel probe, kind ``"probe"``) and
``runtime.model.quant.calibrate`` (the dense calibration pass, kind ``"calibration"``).
Each entry is one small JSON file, ``<root>/<kind>/<key>.json``, where ``key`` is a digest
of everything that decides the result: the caller's inputs and :func:`machine_facts` (the
CPU, torch and its build, pie-ctx's compiled kernels, the thread count). A changed input
gives another key, so an entry is never stale, only unused; nothing is ever guessed.

Where: ``$PIE_CTX_MACHINE_CACHE_DIR`` if set, else the cache root the models live in
(``runtime.model.loader.cache.cache_root``: ``$PIE_CTX_CACHE``, else
``$XDG_CACHE_HOME/pie-ctx``, else ``~/.cache/pie-ctx``), beside its ``models/`` and the
compiled kernels' ``kernels/``. ``PIE_CTX_MACHINE_CACHE``: ``1`` (default) reads and
writes; ``0`` / ``off`` neither (every load computes, as before); ``refresh`` computes and
overwrites (to re-time the kernels on a quiet machine, say). Deleting the folders is
always safe.

Invariants:

* The cache never fails a load: a folder that cannot be created or written, or a file that
  cannot be read or does not decode (truncated, corrupt, another format) is logged and
  the value computed (and written again where possible).
* A file is written whole or not at all (a temporary file in the same folder, renamed over
  the entry), and it repeats its key and a checksum of its value, both checked on reading.
* Two processes that need the same entry at once do not both compute it: the second waits
  on the first's ``flock`` of ``<key>.lock`` (released when the first ends, killed or not)
  and reads the entry it wrote, so both use the same value.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import logging
import os
import platform
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import torch

from runtime.model import kernels
from runtime.model.loader.cache import cache_root

__all__ = ["cached", "enabled", "entry_path", "key", "machine_facts", "mode", "root"]

log = logging.getLogger(__name__)

T = TypeVar("T")

FORMAT = 1  # the envelope of an entry; a change makes older files unreadable (recomputed)
# environment variables that change which code paths MKL, oneDNN, OpenMP or ATen take
_ENV_PREFIXES = ("MKL_", "KMP_", "OMP_", "ONEDNN_", "DNNL_", "ATEN_", "GOMP_")


def mode() -> str:
    """``"on"``, ``"off"`` or ``"refresh"``, from ``PIE_CTX_MACHINE_CACHE`` (read at every
    call)."""
    value = os.environ.get("PIE_CTX_MACHINE_CACHE", "1").strip().lower()
    if value in ("0", "off", "false", "no"):
        return "off"
    return "refresh" if value == "refresh" else "on"


def enabled() -> bool:
    """Whether entries are read (``PIE_CTX_MACHINE_CACHE`` not ``0`` / ``off`` /
    ``refresh``)."""
    return mode() == "on"


def root() -> Path:
    """The cache's folder (see the module doc)."""
    forced = os.environ.get("PIE_CTX_MACHINE_CACHE_DIR")
    return Path(forced).expanduser() if forced else cache_root()


def _digest(*parts: bytes | str) -> str:
    h = hashlib.blake2b(digest_size=16)
    for part in parts:
        data = part.encode() if isinstance(part, str) else part
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()


@functools.cache
def _static_facts() -> dict[str, str]:
    """The facts that cannot change while a process runs."""
    cpu_model, flags = kernels.cpu_facts()
    return {
        "machine": platform.machine(),
        "cpu": cpu_model,
        "cpu_flags": _digest(flags),
        "torch": torch.__version__,
        # the build: MKL's and oneDNN's versions, the CPU capability ATen dispatches to
        "torch_config": _digest(torch.__config__.show()),
        "kernels": " ".join(kernels.folder(s).name for s in kernels.SOURCES),
    }


def machine_facts() -> dict[str, str]:
    """What makes one machine's measurements differ from another's: the CPU's model and
    flags, torch's version and build configuration (MKL, oneDNN, the CPU capability), the
    build digests of pie-ctx's compiled kernels and whether they are on, the intra-op
    thread count, and the environment variables that steer MKL / oneDNN / OpenMP."""
    facts = dict(_static_facts())
    facts["kernels_on"] = str(kernels.enabled())
    facts["threads"] = str(torch.get_num_threads())
    env = sorted((k, v) for k, v in os.environ.items() if k.startswith(_ENV_PREFIXES))
    facts["env"] = _digest(json.dumps(env))
    return facts


def key(kind: str, inputs: dict[str, Any]) -> str:
    """The entry name of ``kind`` for ``inputs`` (JSON-ready data: the caller's inputs that
    decide the value) on this machine (:func:`machine_facts`)."""
    text = json.dumps({"kind": kind, "format": FORMAT, "inputs": inputs,
                       "machine": machine_facts()}, sort_keys=True, default=str)
    return _digest(text)


def source_digest(*paths: Path) -> str:
    """A digest of source files' bytes: the version of the code that computes a value."""
    return _digest(*(p.read_bytes() for p in paths))


def entry_path(kind: str, entry: str) -> Path:
    """Where entry ``entry`` (a :func:`key`) of ``kind`` lives."""
    return root() / kind / f"{entry}.json"


def _read(path: Path, entry: str, decode: Callable[[Any], T]) -> T | None:
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        log.info("machine cache: cannot read %s (%s); computing", path, e)
        return None
    try:
        doc = json.loads(raw)
        if doc["key"] != entry or doc["format"] != FORMAT:
            raise ValueError("another key or format")
        value = doc["value"]
        if doc["checksum"] != _digest(json.dumps(value, sort_keys=True)):
            raise ValueError("checksum mismatch")
        return decode(value)
    except Exception as e:  # any damage: a truncated or edited file, another format
        log.warning("machine cache: ignoring %s (%s: %s); computing it again", path,
                    type(e).__name__, e)
        return None


def _write(path: Path, entry: str, value: Any) -> None:
    doc = {"key": entry, "format": FORMAT, "value": value,
           "checksum": _digest(json.dumps(value, sort_keys=True))}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(doc, f)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, 0o644)  # (mkstemp's 0600) as any other file of the cache
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as e:  # read-only home, full disk: the next load computes again
        log.info("machine cache: cannot write %s (%s); not cached", path, e)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Hold ``path``'s flock (one process computes an entry at a time); no lock where the
    folder cannot be written (then each process computes on its own)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        held = open(path, "a")  # noqa: SIM115 - closed below, after the body ran
    except OSError:
        yield
        return
    try:
        fcntl.flock(held, fcntl.LOCK_EX)
        yield
    finally:
        held.close()  # releases the flock


def cached(kind: str, inputs: dict[str, Any], compute: Callable[[], T],
           encode: Callable[[T], Any], decode: Callable[[Any], T]) -> tuple[T, bool]:
    """The value for ``inputs``: from the cache when this machine computed it before, else
    ``compute()`` (then stored). Returns ``(value, hit)``.

    Args:
        kind: the cache's sub-folder (``"probe"``, ``"calibration"``).
        inputs: JSON-ready data holding every input that decides the value besides the
            machine (:func:`machine_facts` is added).
        compute: computes the value (its exceptions propagate; nothing is stored).
        encode: the value as JSON-ready data; ``decode`` turns that back into the value
            (and raises on anything malformed: the entry is then computed again).
    """
    if mode() == "off":
        return compute(), False
    entry = key(kind, inputs)
    path = entry_path(kind, entry)
    if mode() == "on" and (hit := _read(path, entry, decode)) is not None:
        return hit, True
    with _locked(path.with_suffix(".lock")):
        # whoever held the lock before us may have written the entry meanwhile
        if mode() == "on" and (hit := _read(path, entry, decode)) is not None:
            return hit, True
        value = compute()
        _write(path, entry, encode(value))
    return value, False
