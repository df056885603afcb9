"""The snapshot registry: named, frozen context states that outlive their inferlet.

Owns: the mapping ``(namespace, name) -> Snapshot``, and the names of saves still being
written (``reserve``: taken, but neither listed nor openable). A *resident* snapshot's page
state holds trie references and working pages exactly like a context (it *is* a context
state nobody can mutate), so the page accounting never needs a special case for it. Beside
the pages a snapshot carries what a reopened context needs to continue: the SDK's opaque
``meta`` (its conversation) and the logits of the last token written. A *durable* snapshot
also has its manifest on disk (``head``); it may then be *spilled*: ``state`` is None and
its pages and logits are on disk only, until it is opened again. This is the only table of
snapshots; nothing else keeps per-snapshot data.

The registry never touches pages: ``PageStore`` forks into it (``save_snapshot``), forks
out of it (``open_snapshot``), moves a state out of it in O(1) (``take_snapshot``), releases
it (``delete_snapshot``) and spills or restores it (the disk tier).

Invariants: names are non-empty strings, unique within a namespace, counting reserved
ones; a snapshot is resident (``state``), durable (``head``) or both; resident durable
snapshots are in ``resident`` in least-recently-used order.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from pie_ctx.proto.errors import (
    InvalidArgument,
    SnapshotExists,
    SnapshotIncompatible,
    SnapshotNotFound,
)
from runtime.kv.context import PageState

__all__ = ["Snapshot", "SnapshotRegistry", "DEFAULT_NAMESPACE", "snapshot_key"]

DEFAULT_NAMESPACE = "default"


@dataclass(slots=True)
class Snapshot:
    """One saved context: its pages and what continuing from it needs."""

    state: PageState | None  # None: spilled (durable, on disk only)
    meta: str = ""  # opaque to the runtime; the SDK keeps the conversation here
    last_logits: Any = None  # float32 [vocab] of the last token written, or None
    head: Any = None  # the durable manifest's head (runtime.kv.file_format.ManifestHead), or None

    @property
    def adapter(self) -> int:
        """The LoRA adapter key its pages were computed under (0: none)."""
        if self.state is not None:
            return self.state.adapter
        return int(getattr(self.head, "adapter", 0))

    @property
    def pages(self) -> PageState:
        """The page state of a resident snapshot (the store restores a spilled one first)."""
        if self.state is None:
            raise RuntimeError("the snapshot is spilled: restore it before using its pages")
        return self.state


def snapshot_key(name: object, namespace: object) -> tuple[str, str]:
    """``(namespace, name)``, checked."""
    if not isinstance(name, str) or not name:
        raise InvalidArgument(f"snapshot name must be a non-empty str, got {name!r}")
    if not isinstance(namespace, str) or not namespace:
        raise InvalidArgument(f"snapshot namespace must be a non-empty str, got {namespace!r}")
    return namespace, name


class SnapshotRegistry:
    """Engine-wide ``(namespace, name) -> Snapshot`` map with typed errors."""

    __slots__ = ("_snapshots", "_reserved", "resident", "foreign", "sync")

    def __init__(self) -> None:
        """Create an empty registry."""
        self._snapshots: dict[tuple[str, str], Snapshot] = {}
        self._reserved: dict[tuple[str, str], Any] = {}  # name -> its save being written
        # resident durable snapshots, least recently used first: what spills first
        self.resident: OrderedDict[tuple[str, str], Snapshot] = OrderedDict()
        # (namespace, name) -> why this engine cannot open it (saved by another model)
        self.foreign: dict[tuple[str, str], str] = {}
        # A snapshot folder shared with other engines: called with a key before it is
        # looked up, to bring the entry in line with the manifest on disk (another engine
        # may have saved, replaced or deleted it). None: this engine's table is the truth.
        self.sync: Callable[[tuple[str, str]], None] | None = None

    def __len__(self) -> int:
        return len(self._snapshots)

    def __iter__(self) -> Iterator[tuple[tuple[str, str], Snapshot]]:
        return iter(list(self._snapshots.items()))

    def check_free(self, name: str, namespace: str) -> tuple[str, str]:
        """Validate a name for saving; return its key.

        Raises:
            InvalidArgument: empty or non-str name/namespace.
            SnapshotExists: the name is taken in this namespace.
        """
        key = snapshot_key(name, namespace)
        if self.sync is not None and key not in self._reserved:
            self.sync(key)
        if key in self._snapshots or key in self._reserved:
            raise SnapshotExists(
                f"snapshot {name!r} already exists in namespace {namespace!r}; "
                "delete it first or pick another name"
            )
        return key

    def get(self, name: str, namespace: str) -> Snapshot:
        """The snapshot saved under this name.

        Raises:
            InvalidArgument: empty or non-str name/namespace.
            SnapshotNotFound: no such snapshot.
        """
        key = snapshot_key(name, namespace)
        if self.sync is not None and key not in self._reserved:
            self.sync(key)
        snap = self._snapshots.get(key)
        if snap is None:
            if key in self.foreign:
                raise SnapshotIncompatible(
                    f"snapshot {name!r} in namespace {namespace!r} cannot be opened by this "
                    f"engine: {self.foreign[key]}")
            raise SnapshotNotFound(
                f"no snapshot {name!r} in namespace {namespace!r}; "
                f"saved names: {self.names(namespace)}"
            )
        return snap

    def put(self, key: tuple[str, str], snap: Snapshot) -> None:
        """Store a snapshot under a key returned by ``check_free`` (or reserved)."""
        self._reserved.pop(key, None)
        self._snapshots[key] = snap
        self.touch(key, snap)

    def reserve(self, key: tuple[str, str], save: Any) -> None:
        """Hold a name returned by ``check_free`` while its save (a
        ``runtime.kv.durable.SaveJob``) is written: the name is taken, but the snapshot is
        neither listed nor openable until ``put``."""
        self._reserved[key] = save

    def unreserve(self, key: tuple[str, str]) -> Any:
        """Give up a reserved name (its save failed); returns its save."""
        return self._reserved.pop(key)

    def reserved(self) -> list[Any]:
        """Saves being written (their snapshot states hold pages too)."""
        return list(self._reserved.values())

    def touch(self, key: tuple[str, str], snap: Snapshot) -> None:
        """Note a use of a resident durable snapshot (the last to spill)."""
        if snap.head is not None and snap.state is not None:
            self.resident[key] = snap
            self.resident.move_to_end(key)

    def pop(self, name: str, namespace: str) -> Snapshot:
        """Remove and return a snapshot (errors as ``get``)."""
        snap = self.get(name, namespace)
        return self.forget((namespace, name)) or snap

    def entry(self, key: tuple[str, str]) -> Snapshot | None:
        """The entry under ``key`` as this engine holds it (no sync, no error)."""
        return self._snapshots.get(key)

    def forget(self, key: tuple[str, str]) -> Snapshot | None:
        """Remove the entry under ``key`` (no sync, no error); returns it."""
        snap = self._snapshots.pop(key, None)
        self.resident.pop(key, None)
        return snap

    def names(self, namespace: str) -> list[str]:
        """Sorted snapshot names in one namespace."""
        return sorted(name for ns, name in self._snapshots if ns == namespace)
