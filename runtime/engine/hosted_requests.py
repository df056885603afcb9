"""The engine's answers to the hosted-inferlet and store requests of the contract.

Owns: nothing; it turns ``SpawnInferlet``/``InferletNext``/``CancelInferlet`` into calls on
the ``InferletHost`` (None when the engine has no inferlet folder) and ``Store*`` into calls
on the ``InferletStore``. The engine adds :attr:`HostedRequests.table` to its handlers.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from pie_ctx.proto import messages as P
from pie_ctx.proto.errors import InferletNotFound
from runtime.engine.inferlet_store import InferletStore

__all__ = ["HostedRequests"]

NO_FOLDER = ("this engine has no inferlet folder, so nothing can be launched: start it with "
             "`pie-ctx serve --inferlets DIR` (or `pie-ctx run --inferlets DIR`)")


class HostedRequests:
    """Handlers for the launch and store requests.

    Args:
        store: the namespaced store.

    ``host`` (an ``InferletHost``, set by ``Engine.attach_host``) launches inferlets; while it
    is None every launch is refused.
    """

    def __init__(self, store: InferletStore) -> None:
        self.host: Any = None
        self.store = store
        self.table: dict[type, Callable[[Any, Any, str], Awaitable[Any]]] = {
            P.SpawnInferlet: self._spawn,
            P.InferletNext: self._next,
            P.CancelInferlet: self._cancel,
            P.StoreGet: self._get,
            P.StoreSet: self._set,
            P.StoreDelete: self._delete,
            P.StoreKeys: self._keys,
        }

    def _host(self) -> Any:
        if self.host is None:
            raise InferletNotFound(NO_FOLDER)
        return self.host

    async def _spawn(self, req: P.SpawnInferlet, owner: Any, ns: str) -> P.InferletStarted:
        return P.InferletStarted(id=self._host().spawn(req.name, list(req.argv), owner, ns).id)

    async def _next(self, req: P.InferletNext, owner: Any, ns: str) -> P.InferletEvent:
        return await self._host().next(req.id, req.cursor, owner)

    async def _cancel(self, req: P.CancelInferlet, owner: Any, ns: str) -> P.Ok:
        self._host().cancel(req.id, owner)
        return P.Ok()

    async def _get(self, req: P.StoreGet, owner: Any, ns: str) -> P.StoreValue:
        found = self.store.get(ns, req.key)
        if found is None:
            return P.StoreValue(found=False)
        return P.StoreValue(found=True, payload=found[0], text=found[1])

    async def _set(self, req: P.StoreSet, owner: Any, ns: str) -> P.Ok:
        await self.store.set(ns, req.key, req.payload, req.text)
        return P.Ok()

    async def _delete(self, req: P.StoreDelete, owner: Any, ns: str) -> P.StoreValue:
        return P.StoreValue(found=await self.store.delete(ns, req.key))

    async def _keys(self, req: P.StoreKeys, owner: Any, ns: str) -> P.StoreKeyList:
        return P.StoreKeyList(keys=self.store.keys(ns, req.prefix))
