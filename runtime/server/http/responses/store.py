"""Stored responses: each one a durable snapshot of its context, namespaced per API key.

Owner: what ``/v1/responses`` keeps between requests, written against the public SDK only.

* **Namespaces.** Every caller's responses live in the snapshot namespace of the key it
  sent (its ``conversation.keys.key_scope``: a digest of the bearer token, never the
  token; ``http-anonymous`` without one), through a runtime of its own over the engine (``Runtime.over`` of a
  ``LocalTransport`` with that namespace). The engine keeps namespaces apart: a response
  id from another key names nothing here (404), whatever the id.
* **A response** is two things under its id: the snapshot ``responses/<id>`` (its context
  after the answer: ``Context.save``, so its pages are shared and refcounted, and a
  follow-up opens it and computes only its new items), and a record in the namespace's
  store (``rt.store``: the response body, its input items, the id it continued and the
  header it was built with, as JSON of the typed ``Record``), split into parts of at most
  ``PART_BYTES``. A record decodes straight into the typed items (``items``), records
  written before they were typed too (the JSON is the same).
* **Lifetime** (docs/http.md): a stored response expires ``TTL_S`` after it was created
  (30 days, as OpenAI keeps them), and a namespace keeps at most ``MAX_STORED`` of them: the
  oldest are deleted first (ids sort by creation time). ``DELETE`` removes one at once.
  Both survive restarts when the server has a snapshot directory (the default).
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Callable
from typing import Any

import anyio
import msgspec

from pie_ctx import Context, Runtime
from pie_ctx.proto.errors import OutOfPages, PieError, SnapshotNotFound, StoreFull
from pie_ctx.transport import LocalTransport
from runtime.server.http.conversation.errors import ApiError
from runtime.server.http.responses.items import Item, ResponseBody, encode

__all__ = ["Namespaces", "Record", "Records", "new_response_id", "TTL_S", "MAX_STORED",
           "new_id", "read_parts", "write_parts", "delete_parts"]

TTL_S = 30 * 24 * 3600  # a stored response's lifetime
MAX_STORED = 1000  # stored responses per namespace (API key); the oldest go first
MAX_NAMESPACES = 1024  # distinct keys served at once (past it: 503)
PART_BYTES = 60_000  # a record's part in the store (under max_store_value_bytes)
_PREFIX = "responses/"


def new_id(prefix: str) -> str:
    """``prefix_`` + the creation time (ns, hex) + 64 random bits: ids sort by age."""
    return f"{prefix}_{time.time_ns():016x}{secrets.token_hex(8)}"


def new_response_id() -> str:
    """A new response id (``resp_...``)."""
    return new_id("resp")


def valid_id(value: Any, prefix: str) -> bool:
    """Whether ``value`` is an id :func:`new_id` could have made with ``prefix``."""
    n = len(prefix) + 1
    return (isinstance(value, str) and value.startswith(prefix + "_") and len(value) == n + 32
            and all(c in "0123456789abcdef" for c in value[n:]))


# ----------------------------------------------------------------------- stored values


async def read_parts(store: Any, key: str) -> str | None:
    """The text :func:`write_parts` stored under ``key`` (None: none, or a part is gone)."""
    raw = await store.get(key)
    if not isinstance(raw, str):
        return None
    head = json.loads(raw)
    parts = [head["data"]]
    for k in range(1, head["parts"]):
        part = await store.get(f"{key}#{k}")
        if not isinstance(part, str):
            return None
        parts.append(part)
    return "".join(parts)


async def write_parts(store: Any, key: str, text: str) -> None:
    """Store ``text`` under ``key`` in parts of at most ``PART_BYTES`` (the head, which
    names the count, written last: a reader never sees a part missing).

    Raises:
        StoreFull: the namespace's store has no room.
    """
    parts = [text[i:i + PART_BYTES] for i in range(0, len(text), PART_BYTES)] or [""]
    for k in range(1, len(parts)):
        await store.set(f"{key}#{k}", parts[k])
    await store.set(key, json.dumps({"parts": len(parts), "data": parts[0]}))


async def delete_parts(store: Any, key: str) -> bool:
    """Remove what :func:`write_parts` stored under ``key``; False if there was nothing."""
    found = False
    for name in await store.keys(key):
        if name == key or name.startswith(f"{key}#"):
            found = await store.delete(name) or found
    return found


def not_found(rid: str, param: str | None = None) -> ApiError:
    """OpenAI's 404 for a response id this caller cannot see (missing, expired, another
    key's: they read the same)."""
    return ApiError(404, f"Response with id '{rid[:80]}' not found.", param=param,
                    code="response_not_found")


# ------------------------------------------------------------------------- namespaces


class Namespaces:
    """One runtime per API key over the engine, each in its own snapshot namespace.

    The runtimes live in tasks of the app's runtime (``spawn``), so they close with it.
    """

    def __init__(self, engine: Any, spawn: Callable[[], Runtime]) -> None:
        self.engine, self._base = engine, spawn
        self._runtimes: dict[str, Runtime] = {}
        self._lock = anyio.Lock()
        self.scopes: list[anyio.CancelScope] = []  # the holding tasks (close() cancels them)

    async def runtime(self, namespace: str) -> Runtime:
        """The runtime of ``namespace`` (a ``key_scope``; opened on first use)."""
        rt = self._runtimes.get(namespace)
        if rt is not None:
            return rt
        async with self._lock:
            rt = self._runtimes.get(namespace)
            if rt is not None:
                return rt
            if len(self._runtimes) >= MAX_NAMESPACES:
                raise ApiError(503, "too many API keys in use at once on this server",
                               type="server_error", code="engine_overloaded")
            ready = anyio.Event()
            held: dict[str, Runtime] = {}

            scope = anyio.CancelScope()
            self.scopes.append(scope)

            async def hold() -> None:
                try:
                    with scope:
                        async with Runtime.over(LocalTransport(
                                self.engine, namespace=namespace)) as opened:
                            held["rt"] = opened
                            ready.set()
                            await anyio.sleep_forever()
                finally:
                    self._runtimes.pop(namespace, None)
                    ready.set()

            self._base().start_soon(hold)
            await ready.wait()
            if "rt" not in held:
                raise ApiError(503, "the server is stopping", type="server_error")
            self._runtimes[namespace] = held["rt"]
            return held["rt"]

    def close(self) -> None:
        """Close every namespace's runtime (the app is stopping)."""
        for scope in self.scopes:
            scope.cancel()


# ---------------------------------------------------------------------------- records


class Record(msgspec.Struct, kw_only=True):
    """A stored response: its body, its input items, what it continued. Stored as JSON
    under its id (records written before they were typed hold no ``id`` field)."""

    id: str = ""
    response: ResponseBody
    input_items: list[Item]
    previous: str | None
    header: dict[str, Any]  # model, instructions and tools its context was built with
    created: float

    @property
    def snapshot(self) -> str:
        return _PREFIX + self.id

    def conversation_items(self) -> list[Item]:
        """Its input items, then its output items: what it adds to the conversation."""
        return self.input_items + list(self.response.output)


_decode_record = msgspec.json.Decoder(Record).decode


class Records:
    """The stored responses of one namespace (``rt``)."""

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt

    async def load(self, rid: str, *, param: str | None = None) -> Record:
        """The live record of ``rid``.

        Raises:
            ApiError: 404 when it is missing, expired or not this namespace's.
        """
        if not valid_id(rid, "resp"):
            raise not_found(str(rid), param)
        text = await read_parts(self.rt.store, _PREFIX + rid)
        if text is None:
            raise not_found(rid, param)
        record = _decode_record(text)
        record.id = rid
        if time.time() - record.created > TTL_S:
            await self.delete(rid)
            raise not_found(rid, param)
        return record

    async def chain(self, record: Record) -> list[Record]:
        """``record`` and every response it continued, oldest first.

        Raises:
            ApiError: 404 when one of them is gone (expired or deleted).
        """
        chain = [record]
        while chain[-1].previous is not None:
            chain.append(await self.load(chain[-1].previous, param="previous_response_id"))
        return chain[::-1]

    async def save(self, ctx: Context, record: Record) -> None:
        """Save ``ctx`` as the record's snapshot, then the record; reclaim what is past
        the namespace's bound or its lifetime first."""
        await self._reclaim()
        for attempt in range(8):
            try:
                await ctx.save(record.snapshot)
                break
            except OutOfPages:  # stored responses hold pool pages (a pool without a disk)
                if attempt == 7 or not await self._drop_oldest(exclude=record.id):
                    raise
        text = encode(record).decode()
        for attempt in range(8):
            try:
                await write_parts(self.rt.store, _PREFIX + record.id, text)
                return
            except StoreFull:
                if attempt == 7 or not await self._drop_oldest(exclude=record.id):
                    await self.delete(record.id)
                    raise ApiError(503, "this API key's stored responses are full; delete "
                                        "some (DELETE /v1/responses/{id})",
                                   type="server_error", code="engine_overloaded") from None

    async def delete(self, rid: str) -> bool:
        """Remove ``rid``'s record and snapshot; False if there was none."""
        found = await delete_parts(self.rt.store, _PREFIX + rid)
        try:
            await Context.delete(self.rt, _PREFIX + rid)
            found = True
        except SnapshotNotFound:
            pass
        return found

    async def _ids(self) -> list[str]:
        return [k[len(_PREFIX):] for k in await self.rt.store.keys(_PREFIX) if "#" not in k]

    async def _drop_oldest(self, exclude: str) -> bool:
        ids = [i for i in await self._ids() if i != exclude]
        if not ids:
            return False
        await self.delete(ids[0])
        return True

    async def _reclaim(self) -> None:
        """Delete the expired responses and the oldest past ``MAX_STORED - 1``."""
        ids = await self._ids()
        cutoff = time.time_ns() - TTL_S * 1_000_000_000
        drop = len(ids) - (MAX_STORED - 1)
        for k, rid in enumerate(ids):
            try:
                born = int(rid[5:21], 16)
            except ValueError:
                born = 0
            if k >= drop and born >= cutoff:
                break  # ids sort by age: the rest are younger
            try:
                await self.delete(rid)
            except PieError:
                pass
