"""The snapshot registry: named, frozen context states that outlive their inferlet.

Owns: the mapping ``(namespace, name) -> ContextState``. A snapshot holds trie references
and working pages exactly like a context (it *is* a context state nobody can mutate), so
the page accounting never needs a special case for it. The registry itself never touches
pages: ``PageStore`` forks into it (``save``), forks out of it (``open``), moves a state
out of it in O(1) (``take``) or releases it (``delete``).

Invariant: names are non-empty strings, unique within a namespace.
"""

from __future__ import annotations

from collections.abc import Iterator

from pie_ctx.errors import InvalidArgument, SnapshotExists, SnapshotNotFound
from runtime.kv.context import ContextState

__all__ = ["SnapshotRegistry", "DEFAULT_NAMESPACE"]

DEFAULT_NAMESPACE = "default"


def _key(name: object, namespace: object) -> tuple[str, str]:
    if not isinstance(name, str) or not name:
        raise InvalidArgument(f"snapshot name must be a non-empty str, got {name!r}")
    if not isinstance(namespace, str) or not namespace:
        raise InvalidArgument(f"snapshot namespace must be a non-empty str, got {namespace!r}")
    return namespace, name


class SnapshotRegistry:
    """Engine-wide ``(namespace, name) -> ContextState`` map with typed errors."""

    __slots__ = ("_states",)

    def __init__(self) -> None:
        """Create an empty registry."""
        self._states: dict[tuple[str, str], ContextState] = {}

    def __len__(self) -> int:
        return len(self._states)

    def __iter__(self) -> Iterator[tuple[tuple[str, str], ContextState]]:
        return iter(list(self._states.items()))

    def check_free(self, name: str, namespace: str) -> tuple[str, str]:
        """Validate a name for ``save``; return its key.

        Raises:
            InvalidArgument: empty or non-str name/namespace.
            SnapshotExists: the name is taken in this namespace.
        """
        key = _key(name, namespace)
        if key in self._states:
            raise SnapshotExists(
                f"snapshot {name!r} already exists in namespace {namespace!r}; "
                "delete it first or pick another name"
            )
        return key

    def get(self, name: str, namespace: str) -> ContextState:
        """The state saved under this name.

        Raises:
            InvalidArgument: empty or non-str name/namespace.
            SnapshotNotFound: no such snapshot.
        """
        key = _key(name, namespace)
        state = self._states.get(key)
        if state is None:
            raise SnapshotNotFound(
                f"no snapshot {name!r} in namespace {namespace!r}; "
                f"saved names: {self.names(namespace)}"
            )
        return state

    def put(self, key: tuple[str, str], state: ContextState) -> None:
        """Store a state under a key returned by ``check_free``."""
        self._states[key] = state

    def pop(self, name: str, namespace: str) -> ContextState:
        """Remove and return a snapshot (errors as ``get``)."""
        state = self.get(name, namespace)
        del self._states[(namespace, name)]
        return state

    def names(self, namespace: str) -> list[str]:
        """Sorted snapshot names in one namespace."""
        return sorted(name for ns, name in self._states if ns == namespace)
