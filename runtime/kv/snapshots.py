"""The snapshot registry: named, frozen context states that outlive their inferlet.

Owns: the mapping ``(namespace, name) -> Snapshot``. A snapshot's page state holds trie
references and working pages exactly like a context (it *is* a context state nobody can
mutate), so the page accounting never needs a special case for it. Beside the pages a
snapshot carries what a reopened context needs to continue: the SDK's opaque ``meta`` (its
conversation) and the logits of the last token written. This is the only table of
snapshots; nothing else keeps per-snapshot data.

The registry never touches pages: ``PageStore`` forks into it (``save_snapshot``), forks
out of it (``open_snapshot``), moves a state out of it in O(1) (``take_snapshot``) or
releases it (``delete_snapshot``).

Invariant: names are non-empty strings, unique within a namespace.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from pie_ctx.proto.errors import InvalidArgument, SnapshotExists, SnapshotNotFound
from runtime.kv.context import PageState

__all__ = ["Snapshot", "SnapshotRegistry", "DEFAULT_NAMESPACE"]

DEFAULT_NAMESPACE = "default"


@dataclass(slots=True, frozen=True)
class Snapshot:
    """One saved context: its pages and what continuing from it needs."""

    state: PageState
    meta: str = ""  # opaque to the runtime; the SDK keeps the conversation here
    last_logits: Any = None  # float32 [vocab] of the last token written, or None


def _key(name: object, namespace: object) -> tuple[str, str]:
    if not isinstance(name, str) or not name:
        raise InvalidArgument(f"snapshot name must be a non-empty str, got {name!r}")
    if not isinstance(namespace, str) or not namespace:
        raise InvalidArgument(f"snapshot namespace must be a non-empty str, got {namespace!r}")
    return namespace, name


class SnapshotRegistry:
    """Engine-wide ``(namespace, name) -> Snapshot`` map with typed errors."""

    __slots__ = ("_snapshots",)

    def __init__(self) -> None:
        """Create an empty registry."""
        self._snapshots: dict[tuple[str, str], Snapshot] = {}

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
        key = _key(name, namespace)
        if key in self._snapshots:
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
        key = _key(name, namespace)
        snap = self._snapshots.get(key)
        if snap is None:
            raise SnapshotNotFound(
                f"no snapshot {name!r} in namespace {namespace!r}; "
                f"saved names: {self.names(namespace)}"
            )
        return snap

    def put(self, key: tuple[str, str], snap: Snapshot) -> None:
        """Store a snapshot under a key returned by ``check_free``."""
        self._snapshots[key] = snap

    def pop(self, name: str, namespace: str) -> Snapshot:
        """Remove and return a snapshot (errors as ``get``)."""
        snap = self.get(name, namespace)
        del self._snapshots[(namespace, name)]
        return snap

    def names(self, namespace: str) -> list[str]:
        """Sorted snapshot names in one namespace."""
        return sorted(name for ns, name in self._snapshots if ns == namespace)
