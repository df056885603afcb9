"""The engine's LoRA adapters by name: load, unload, and the name -> key a context runs.

Owns: the table ``name -> adapter`` the clients see (``EngineInfo.adapters``). The model
runner holds the weights (``ModelRunner.load_adapter``); the page store holds each
context's adapter key (``PageState.adapter``), which is what makes pages of two adapters
distinct. Loading reads and fuses the folder on the model thread, so a step never sees a
half-loaded adapter.

Unload policy: **fail, never wait.** Unloading an adapter that a live context (or a
running or queued request's context) still uses raises :class:`AdapterInUse` and changes
nothing; release those contexts first. The check and the removal happen in one turn of
the event loop, so no context can start using the adapter in between. Snapshots do not
hold an adapter: one saved under an unloaded adapter stays on disk, and opening it raises
:class:`AdapterNotFound` until an adapter with the same weights is loaded again (under any
name: an adapter's identity is its weights).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import anyio

from pie_ctx.proto import messages as P
from pie_ctx.proto.errors import AdapterInUse, AdapterNotFound, InvalidArgument

if TYPE_CHECKING:
    from runtime.kv.store import PageStore
    from runtime.model.runner_protocol import Runner

__all__ = ["Adapters"]


def _info(adapter: Any) -> P.AdapterInfo:
    return P.AdapterInfo(name=adapter.name, path=adapter.path, rank=adapter.rank,
                         alpha=adapter.alpha, targets=list(adapter.targets),
                         key=f"{adapter.key:016x}")


class Adapters:
    """The loaded adapters of one engine.

    Args:
        runner: the model runner (``load_adapter``/``unload_adapter``/``adapters``).
        store: the page store (which contexts use which adapter key).
        model_name: the engine's model, compared with an adapter's base model.
        on_model_thread: runs a callable on the model thread and waits (blocking).
        on_change: called with the new list of ``AdapterInfo`` after a load or unload.
    """

    def __init__(self, runner: Runner, store: PageStore, model_name: str,
                 on_model_thread: Callable[..., Any],
                 on_change: Callable[[list[P.AdapterInfo]], None]) -> None:
        self._runner = runner
        self._store = store
        self._model_name = model_name
        self._on_model_thread = on_model_thread
        self._on_change = on_change
        self._lock = anyio.Lock()  # one load or unload at a time

    def infos(self) -> list[P.AdapterInfo]:
        """The loaded adapters, by name."""
        return [_info(a) for _, a in sorted(self._runner.adapters.items())]

    def key_of(self, name: str) -> int:
        """The key of adapter ``name`` ("" = the base model: 0).

        Raises:
            AdapterNotFound: no adapter of that name is loaded.
        """
        if name == "":
            return 0
        adapter = self._runner.adapters.get(name)
        if adapter is None:
            raise AdapterNotFound(f"no adapter named {name!r} is loaded; loaded: "
                                  f"{sorted(self._runner.adapters) or 'none'} (load it with "
                                  "rt.load_adapter or `pie-ctx serve --adapter NAME=PATH`)")
        return adapter.key

    def check_loaded(self, key: int, what: str) -> None:
        """Refuse ``what`` (a snapshot) whose pages were computed under an unloaded adapter.

        Raises:
            AdapterNotFound: no adapter with that key is loaded.
        """
        if key and not self._runner.has_adapter_key(key):
            raise AdapterNotFound(f"{what} was saved under a LoRA adapter (id {key:016x}) that "
                                  "is not loaded; load the same adapter (any name) first")

    def load_now(self, name: str, path: str) -> P.AdapterInfo:
        """Load at boot, before the engine runs (blocking, on the calling thread)."""
        _check_name(name)
        adapter = self._runner.load_adapter(name, str(path), self._model_name)
        self._on_change(self.infos())
        return _info(adapter)

    async def load(self, name: str, path: str) -> P.AdapterInfo:
        """Read, check and fuse a PEFT folder, then serve it as ``name``.

        Raises:
            InvalidArgument: a bad name, or ``name`` is already loaded.
            ModelError: the folder is not a supported LoRA of this model.
        """
        _check_name(name)
        if not isinstance(path, str) or not path:
            raise InvalidArgument("adapter path must be a non-empty str (a PEFT folder)")
        async with self._lock:
            if name in self._runner.adapters:
                raise InvalidArgument(f"an adapter named {name!r} is already loaded; unload "
                                      "it first or pick another name")
            adapter = await anyio.to_thread.run_sync(
                self._on_model_thread, self._runner.load_adapter, name, path, self._model_name)
            self._on_change(self.infos())
            return _info(adapter)

    async def unload(self, name: str) -> None:
        """Stop serving ``name`` (see the module docstring: fails while in use).

        Raises:
            AdapterNotFound: no adapter of that name is loaded.
            AdapterInUse: live contexts use it; nothing changed.
        """
        async with self._lock:
            key = self.key_of(name)
            shared = any(a.key == key and n != name for n, a in self._runner.adapters.items())
            if not shared:  # another name with the same weights keeps the pages valid
                users = sum(1 for _, state in self._store.context_states()
                            if state.adapter == key)
                if users:
                    raise AdapterInUse(
                        f"adapter {name!r} is used by {users} live context(s) (or their "
                        "running requests); release them, then unload it")
            self._runner.unload_adapter(name)
            self._on_change(self.infos())


def _check_name(name: object) -> None:
    if not isinstance(name, str) or not name or len(name) > 256 or name.strip() != name \
            or "/" in name:
        raise InvalidArgument(f"adapter name must be a non-empty str without '/' or surrounding "
                              f"spaces (at most 256 characters), got {name!r}")
