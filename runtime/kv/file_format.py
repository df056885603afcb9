"""The snapshot directory's file formats: what a page file and a manifest hold, and the
checks every read makes. Bytes in, records out: no file is opened here except to read a
manifest's head (``read_head``, ``foreign_manifests``); writing, renaming and syncing is
``runtime.kv.disk``'s (the crash-safe I/O).

Page file: ``magic "PIEPAGE1" | hash u64 | parent u64 | count u32 | payload u64 |
tokens i64*count | positions i64*count | extras u64*count | payload bytes | xxh3 u64``;
reading one recomputes its chained hash from its tokens, positions and extras.
Manifest: ``magic "PIESNAP1" | head_len u32 | head (msgpack) | xxh3 u64 | blob | xxh3 u64``
where the blob is the working tail's KV bytes then the last logits; the head alone is
read at boot, the blob when the snapshot is opened. A ``Fingerprint`` names everything that
decides a page's bytes: files are shared only between engines with equal fingerprints.
"""

from __future__ import annotations

import contextlib
import json
import struct
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import msgspec
import xxhash

from pie_ctx.proto.errors import SnapshotCorrupt
from runtime.kv.hashing import fold_extras, hash_page
from runtime.kv.types import PageHash

__all__ = ["FORMAT_VERSION", "Fingerprint", "ManifestHead", "PageRecord", "checksum",
           "foreign_manifests", "manifest_key", "manifest_parts", "page_front_fits",
           "page_parts", "parse_blob", "parse_page", "read_head", "verify_page"]

FORMAT_VERSION = 1
PAGE_MAGIC = b"PIEPAGE1"
SNAP_MAGIC = b"PIESNAP1"
PAGE_HEAD = struct.Struct("<8sQQIQ")  # magic, hash, parent, count, payload bytes
SNAP_HEAD = struct.Struct("<8sI")  # magic, head length
SUM = struct.Struct("<Q")


@dataclass(frozen=True, slots=True)
class Fingerprint:
    """Everything that decides a page's KV bytes. Files are shared only between engines
    with equal fingerprints."""

    model: str  # the model's name (for messages)
    weights_digest: str  # xxh3-128 of the model files
    weights: str  # projection weight format: fp32 | int8
    dtype: str  # compute dtype
    kv_dtype: str  # page format: fp32 | int8
    page_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    version: int = FORMAT_VERSION
    backend: str = "native"  # the runner that computed the pages: native | transformers

    @property
    def key(self) -> str:
        """16 hex digits naming this fingerprint's folder."""
        fields = asdict(self)
        if self.backend == "native":  # the folders of engines made before backends existed
            del fields["backend"]
        return xxhash.xxh3_64_hexdigest(json.dumps(fields, sort_keys=True).encode())

    def describe(self) -> str:
        """One line for messages: what differs between two fingerprints is visible."""
        return (f"model {self.model} (weights {self.weights_digest[:12]}, {self.weights}), "
                f"dtype {self.dtype}, kv {self.kv_dtype}, page size {self.page_size}, "
                f"{self.backend} backend")

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Fingerprint:
        return cls(**data)


@dataclass(frozen=True, slots=True)
class PageRecord:
    """One page read back from disk, verified."""

    page_hash: PageHash
    parent: int  # the parent page's hash, or the chain root (0 for fp32 chains)
    tokens: tuple[int, ...]
    positions: tuple[int, ...]
    extras: tuple[int, ...]
    payload: bytes | memoryview  # the page's KV bytes, exactly as in the pool


class ManifestHead(msgspec.Struct, frozen=True, kw_only=True):
    """The small part of a manifest, read at boot for every snapshot."""

    version: int
    fingerprint: str  # the Fingerprint.key of the engine that saved it
    namespace: str
    name: str
    pages: list[int]  # committed page hashes, root first
    tokens: list[int]  # the committed pages' contents, to verify every page on reopen
    positions: list[int]
    extras: list[int]
    tail_tokens: list[int]
    tail_positions: list[int]
    tail_extras: list[int]
    tail_pages: int  # working pages whose bytes are in the blob
    tail_bytes: int
    logits_bytes: int  # 0: no last logits saved
    meta: str
    saved_at: float
    adapter: int = 0  # the LoRA adapter key its pages were computed under (0: none)


def checksum(*parts: bytes | memoryview) -> bytes:
    """The xxh3-64 trailer every file ends with, over ``parts``."""
    h = xxhash.xxh3_64()
    for p in parts:
        h.update(p)
    return SUM.pack(h.intdigest())


def manifest_key(namespace: str, name: str) -> str:
    """The file stem of a snapshot's manifest (names may hold any character)."""
    return xxhash.xxh3_128_hexdigest(f"{namespace}\0{name}".encode())


def read_head(path: Path) -> ManifestHead:
    """Read and verify a manifest's head (not its blob).

    Raises:
        SnapshotCorrupt: unreadable, truncated or failing its checksum.
    """
    try:
        with open(path, "rb") as f:
            front = f.read(SNAP_HEAD.size)
            if len(front) < SNAP_HEAD.size:
                raise SnapshotCorrupt(f"manifest {path} is truncated")
            magic, size = SNAP_HEAD.unpack(front)
            if magic != SNAP_MAGIC:
                raise SnapshotCorrupt(f"manifest {path} is not a snapshot manifest")
            packed = f.read(size)
            check = f.read(SUM.size)
    except OSError as e:
        raise SnapshotCorrupt(f"manifest {path} cannot be read: {e}") from None
    if len(packed) != size or checksum(front, packed) != check:
        raise SnapshotCorrupt(f"manifest {path} is corrupt (head checksum mismatch)")
    try:
        return msgspec.msgpack.decode(packed, type=ManifestHead)
    except msgspec.DecodeError as e:
        raise SnapshotCorrupt(f"manifest {path} is corrupt ({e})") from None


def page_parts(page_hash: int, parent: int, tokens: Sequence[int], positions: Sequence[int],
               extras: Sequence[int], payload: bytes | memoryview) -> list[bytes | memoryview]:
    """The bytes of one page file: header, tokens/positions/extras, KV payload, checksum."""
    n = len(tokens)
    payload = memoryview(payload).cast("B")
    head = PAGE_HEAD.pack(PAGE_MAGIC, page_hash, parent, n, payload.nbytes)
    body = struct.pack(f"<{n}q{n}q{n}Q", *tokens, *positions, *extras)
    return [head, body, payload, checksum(head, body, payload)]


def corrupt(path: Path, why: str) -> SnapshotCorrupt:
    """The error of a page file that fails a check."""
    return SnapshotCorrupt(f"page file {path} is corrupt ({why})")


def verify_page(path: Path, page_hash: int, payload_bytes: int, front: memoryview,
                 payload: memoryview, check: memoryview) -> PageRecord:
    """The checks of a page file split as its header says (``front``: header, tokens,
    positions, extras): checksum, name, payload size, and the chained hash recomputed.

    Raises:
        SnapshotCorrupt: naming ``path`` and the failed check.
    """
    _, h, parent, n, size = PAGE_HEAD.unpack_from(front)
    if checksum(front, payload) != check:
        raise corrupt(path, "checksum mismatch")
    if h != page_hash or size != payload_bytes:
        raise corrupt(path, f"holds page {h:016x} of {size} bytes, expected "
                             f"{page_hash:016x} of {payload_bytes}")
    values = struct.unpack_from(f"<{n}q{n}q{n}Q", front, PAGE_HEAD.size)
    tokens, positions, extras = values[:n], values[n:2 * n], values[2 * n:]
    if n == 0 or hash_page(parent, tokens, positions, fold_extras(extras)) != h:
        raise corrupt(path, "its tokens do not hash to its name")
    return PageRecord(PageHash(h), parent, tokens, positions, extras, payload)


def parse_page(path: Path, page_hash: int, payload_bytes: int, data: bytes) -> PageRecord:
    """A whole page file's bytes, checked: length, magic, then ``verify_page``.

    Raises:
        SnapshotCorrupt: naming ``path`` and the failed check.
    """
    if len(data) < PAGE_HEAD.size + SUM.size:
        raise corrupt(path, f"truncated to {len(data)} bytes")
    magic, _, _, n, size = PAGE_HEAD.unpack_from(data)
    if magic != PAGE_MAGIC:
        raise corrupt(path, "not a page file")
    front = PAGE_HEAD.size + 24 * n
    if len(data) != front + size + SUM.size:
        raise corrupt(path, f"{len(data)} bytes, its header says {front + size + SUM.size}")
    view = memoryview(data)
    return verify_page(path, page_hash, payload_bytes, view[:front],
                       view[front:front + size], view[front + size:])


def page_front_fits(meta: bytes | bytearray, payload_bytes: int) -> bool:
    """Whether ``meta`` (a page file's bytes before its payload, as read for a payload of
    ``payload_bytes``) is a page header whose tokens end exactly where the payload starts."""
    magic, _, _, n, size = PAGE_HEAD.unpack_from(meta)
    return magic == PAGE_MAGIC and len(meta) == PAGE_HEAD.size + 24 * n and size == payload_bytes


def manifest_parts(head: ManifestHead, tail: bytes | memoryview,
                   logits: bytes | memoryview) -> list[bytes | memoryview]:
    """The bytes of one manifest: magic and head with its checksum, then the blob (the
    working tail's KV bytes and the last logits) with its own."""
    packed = msgspec.msgpack.encode(head)
    front = SNAP_HEAD.pack(SNAP_MAGIC, len(packed))
    tail, logits = memoryview(tail).cast("B"), memoryview(logits).cast("B")
    return [front, packed, checksum(front, packed), tail, logits, checksum(tail, logits)]


def parse_blob(path: Path, head: ManifestHead, data: bytes) -> tuple[bytes, bytes]:
    """A whole manifest's bytes, checked: its working-tail KV bytes and last logits.

    Raises:
        SnapshotCorrupt: truncated, or the blob fails its checksum.
    """
    packed = msgspec.msgpack.encode(head)
    start = SNAP_HEAD.size + len(packed) + SUM.size
    end = start + head.tail_bytes + head.logits_bytes
    if len(data) != end + SUM.size:
        raise SnapshotCorrupt(f"manifest {path} is corrupt ({len(data)} bytes, expected "
                              f"{end + SUM.size})")
    if checksum(memoryview(data)[start:end]) != data[end:]:
        raise SnapshotCorrupt(f"manifest {path} is corrupt (checksum mismatch)")
    return data[start:start + head.tail_bytes], data[start + head.tail_bytes:end]


def foreign_manifests(root: Path, fingerprint: Fingerprint) -> dict[tuple[str, str], str]:
    """Snapshots in ``root`` saved by engines with other fingerprints: ``(namespace, name)
    -> why this engine cannot use them``. Unreadable entries are skipped."""
    out: dict[tuple[str, str], str] = {}
    for fmt in sorted(root.glob("*/FORMAT.json")):
        folder = fmt.parent
        if folder.name == fingerprint.key:
            continue
        try:
            other = Fingerprint.from_json(json.loads(fmt.read_text()))
        except (OSError, ValueError, TypeError):
            continue
        why = (f"it was saved by {other.describe()}; this engine runs "
               f"{fingerprint.describe()}")
        for path in (folder / "snapshots").glob("*.snap"):
            with contextlib.suppress(SnapshotCorrupt):  # only named in messages
                head = read_head(path)
                out.setdefault((head.namespace, head.name), why)
    return out
