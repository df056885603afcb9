"""``rt.store``: small values shared by the inferlets of one namespace, durable on disk.

Owns: the store's files under ``<snapshot dir>/store/`` (or a dict, for an engine whose
snapshots live in memory) and the index of every namespace's keys and sizes.

Invariants:

* Namespaced like snapshots: a key of one namespace is invisible from another.
* Crash-safe like snapshots: a value is written to a temporary file, fsynced, renamed over
  the key's file and the folder fsynced, so after a crash (SIGKILL, power loss) a key holds
  its old value or its new one, never a torn one; a file whose checksum fails is skipped
  (and logged) when the namespace is loaded.
* Bounded: a value is at most ``max_value_bytes`` (``ValueTooLarge``); one namespace holds at
  most ``max_keys`` keys and ``max_bytes`` bytes (``StoreFull``). A refused write changes
  nothing.
* Writes to one namespace are serialized (one lock), so concurrent sets of one key end with
  one of the values, whole.
* Shared (``shared=True``: a snapshot folder several engines use, docs/scale-out.md): the
  files are the truth, not this engine's index. ``get`` and ``keys`` read them, so a value
  another engine set is seen at once; concurrent sets of one key from two engines end with
  the last rename's value, whole. The limits count what this engine has seen.
"""

from __future__ import annotations

import base64
import logging
import os
import zlib
from dataclasses import dataclass
from pathlib import Path

import anyio

from pie_ctx.proto.errors import InvalidArgument, StoreFull, ValueTooLarge

__all__ = ["InferletStore", "StoreLimits"]

log = logging.getLogger("pie_ctx.store")

_MAGIC = b"PCS1"
_HEADER = len(_MAGIC) + 1 + 4  # magic, text flag, crc32 of the payload
_MAX_KEY_BYTES = 128


@dataclass(frozen=True, slots=True)
class StoreLimits:
    """The store's bounds (reported in ``EngineInfo``)."""

    max_value_bytes: int = 64 << 10
    max_keys: int = 10_000
    max_bytes: int = 64 << 20


def check_key(key: object) -> str:
    """``key`` if it is a valid store key.

    Raises:
        InvalidArgument: not a str of 1-128 UTF-8 bytes without control characters.
    """
    if not isinstance(key, str):
        raise InvalidArgument(f"a store key is a str, got {type(key).__name__}")
    if not 0 < len(key.encode()) <= _MAX_KEY_BYTES or any(ord(c) < 32 or ord(c) == 127
                                                          for c in key):
        raise InvalidArgument(f"store key {key[:40]!r} must be 1-{_MAX_KEY_BYTES} UTF-8 bytes "
                              "without control characters")
    return key


def _encode_name(text: str) -> str:
    return base64.urlsafe_b64encode(text.encode()).decode().rstrip("=") or "_"


def _decode_name(name: str) -> str:
    return base64.urlsafe_b64decode(name + "=" * (-len(name) % 4)).decode()


class _Namespace:
    def __init__(self, folder: Path | None) -> None:
        self.folder = folder
        self.values: dict[str, tuple[bytes, bool]] = {}
        self.num_bytes = 0
        self.lock = anyio.Lock()

    @staticmethod
    def cost(key: str, payload: bytes) -> int:
        return len(key.encode()) + len(payload)


class InferletStore:
    """Every namespace's store.

    Args:
        root: the folder to keep values in (created if missing), or None to keep them in
            memory for the engine's life.
        limits: the bounds.
    """

    def __init__(self, root: Path | None, limits: StoreLimits | None = None,
                 shared: bool = False) -> None:
        self.root = root
        self.shared = shared and root is not None
        self.limits = limits or StoreLimits()
        self._spaces: dict[str, _Namespace] = {}

    def _space(self, namespace: str) -> _Namespace:
        space = self._spaces.get(namespace)
        if space is None:
            folder = None if self.root is None else self.root / _encode_name(namespace)
            space = _Namespace(folder)
            if folder is not None and folder.is_dir():
                for file in folder.iterdir():
                    if file.name.startswith("."):
                        continue  # a temporary file a crash left behind
                    loaded = _read(file)
                    if loaded is None:
                        log.warning("store: skipping unreadable file %s", file)
                        continue
                    key = _decode_name(file.name)
                    space.values[key] = loaded
                    space.num_bytes += space.cost(key, loaded[0])
            self._spaces[namespace] = space
        return space

    def get(self, namespace: str, key: str) -> tuple[bytes, bool] | None:
        """``(payload, is_text)`` of ``key``, or None."""
        space = self._space(namespace)
        if self.shared and space.folder is not None:
            self._reread(space, check_key(key))
        return space.values.get(check_key(key))

    def keys(self, namespace: str, prefix: str = "") -> list[str]:
        """The keys starting with ``prefix``, sorted."""
        space = self._space(namespace)
        if self.shared and space.folder is not None and space.folder.is_dir():
            on_disk = set()
            for file in space.folder.iterdir():
                if not file.name.startswith("."):
                    try:
                        on_disk.add(_decode_name(file.name))
                    except ValueError:
                        continue
            for key in on_disk ^ set(space.values):
                self._reread(space, key)
        return sorted(k for k in space.values if k.startswith(prefix))

    def _reread(self, space: _Namespace, key: str) -> None:
        """A shared store: take ``key``'s value from its file (another engine may have set
        or deleted it)."""
        assert space.folder is not None
        loaded = _read(space.folder / _encode_name(key))
        old = space.values.pop(key, None)
        if old is not None:
            space.num_bytes -= space.cost(key, old[0])
        if loaded is not None:
            space.values[key] = loaded
            space.num_bytes += space.cost(key, loaded[0])

    async def set(self, namespace: str, key: str, payload: bytes, text: bool) -> None:
        """Store ``payload`` under ``key`` (replacing any value), durably before returning.

        Raises:
            InvalidArgument: a bad key.
            ValueTooLarge: ``payload`` is over ``max_value_bytes``.
            StoreFull: the namespace has no room for it.
        """
        check_key(key)
        lim = self.limits
        if len(payload) > lim.max_value_bytes:
            raise ValueTooLarge(f"store value of {len(payload)} bytes is over the "
                                f"{lim.max_value_bytes}-byte limit (rt.info.max_store_value_bytes); "
                                "keep the bulk elsewhere and store its name")
        space = self._space(namespace)
        async with space.lock:
            old = space.values.get(key)
            growth = space.cost(key, payload) - (0 if old is None else space.cost(key, old[0]))
            if old is None and len(space.values) >= lim.max_keys:
                raise StoreFull(f"this namespace's store holds {lim.max_keys} keys already "
                                "(rt.info.max_store_keys); delete keys you no longer need")
            if space.num_bytes + growth > lim.max_bytes:
                raise StoreFull(f"this namespace's store would hold {space.num_bytes + growth} "
                                f"bytes, over {lim.max_bytes} (rt.info.max_store_bytes); "
                                "delete keys you no longer need")
            if space.folder is not None:
                await anyio.to_thread.run_sync(_write, space.folder, key, payload, text)
            space.values[key] = (payload, text)
            space.num_bytes += growth

    async def delete(self, namespace: str, key: str) -> bool:
        """Remove ``key``; False if it was not there."""
        check_key(key)
        space = self._space(namespace)
        async with space.lock:
            old = space.values.get(key)
            if old is None:
                return False
            if space.folder is not None:
                await anyio.to_thread.run_sync(_remove, space.folder, key)
            del space.values[key]
            space.num_bytes -= space.cost(key, old[0])
            return True


def _read(file: Path) -> tuple[bytes, bool] | None:
    try:
        data = file.read_bytes()
        _decode_name(file.name)
    except (OSError, ValueError):
        return None
    if len(data) < _HEADER or not data.startswith(_MAGIC):
        return None
    payload = data[_HEADER:]
    if zlib.crc32(payload) != int.from_bytes(data[5:9], "little"):
        return None
    return payload, data[4] == 1


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write(folder: Path, key: str, payload: bytes, text: bool) -> None:
    new = not folder.exists()
    folder.mkdir(parents=True, exist_ok=True)
    if new:
        _fsync_dir(folder.parent)
    name = _encode_name(key)
    tmp = folder / f".{name}.{os.getpid()}.{os.urandom(4).hex()}.tmp"  # (engines may share it)
    data = _MAGIC + bytes([1 if text else 0]) + zlib.crc32(payload).to_bytes(4, "little") + payload
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, folder / name)
    _fsync_dir(folder)


def _remove(folder: Path, key: str) -> None:
    try:
        os.unlink(folder / _encode_name(key))
    except FileNotFoundError:
        return
    _fsync_dir(folder)
