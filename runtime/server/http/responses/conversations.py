"""OpenAI's Conversations API (``/v1/conversations``), and the conversation a response runs
in (``conversation`` on ``POST /v1/responses``).

Owner: stored conversations. Each lives in its key's namespace (``store.Namespaces``), as
stored responses do, and is two things under its id:

* a record in the namespace's store (``conversations/<id>``): its metadata and its items
  (typed, ``items``), with a ``version`` bumped at every change;
* the snapshot ``conversations/<id>``: the context after the last response that ran in
  it, with the version and the header (model, instructions, tools) it holds. A response
  in the conversation opens it when both still match (no token computed for the
  history), else builds the context again from the items (the prefix cache finds what it
  can).

A response in a conversation appends its input and output items to it when it completes
(or stops at its output limit), as OpenAI does. Items added or deleted through
``/v1/conversations/{id}/items`` change the version, so the next response rebuilds.
Conversations do not expire; a key keeps at most ``MAX_CONVERSATIONS`` (past it, creating
one is refused until some are deleted) of at most ``MAX_CONVERSATION_ITEMS`` items each.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Annotated, Any

import anyio
import msgspec

import runtime.server.http.conversation.body as body
from pie_ctx import Context, Runtime
from pie_ctx.proto.errors import PieError, SnapshotNotFound, StoreFull
from runtime.server.http.conversation.errors import ApiError, guard
from runtime.server.http.conversation.keys import key_scope
from runtime.server.http.responses.items import Item, encode, json_response
from runtime.server.http.responses.schema import MAX_METADATA, input_items
from runtime.server.http.responses.store import (
    Namespaces,
    delete_parts,
    new_id,
    read_parts,
    valid_id,
    write_parts,
)

__all__ = ["Conversation", "Conversations", "ConversationRoutes", "page",
           "MAX_CONVERSATIONS", "MAX_CONVERSATION_ITEMS"]

log = logging.getLogger("pie_ctx.http")

MAX_CONVERSATIONS = 1000  # per API key
MAX_CONVERSATION_ITEMS = 10_000  # per conversation
MAX_ADDED = 20  # items one create call may add (OpenAI's limit)
_PREFIX = "conversations/"

Metadata = Annotated[dict[Annotated[str, msgspec.Meta(max_length=64)],
                          Annotated[str, msgspec.Meta(max_length=512)]],
                     msgspec.Meta(max_length=MAX_METADATA)]


class Conversation(msgspec.Struct, kw_only=True):
    """A stored conversation (see the module docstring)."""

    id: str
    created_at: int
    metadata: dict[str, str] = msgspec.field(default_factory=dict)
    items: list[Item] = msgspec.field(default_factory=list)
    version: int = 0  # bumped at every change of ``items``
    header: dict[str, Any] | None = None  # what the snapshot's context was built with
    snapshot_version: int = -1  # the version the snapshot holds (-1: none)

    @property
    def snapshot(self) -> str:
        return _PREFIX + self.id

    def fresh(self, header: dict[str, Any]) -> bool:
        """Whether its snapshot holds its items under ``header``."""
        return self.snapshot_version == self.version and self.header == header

    def body(self) -> dict[str, Any]:
        """OpenAI's conversation object."""
        return {"id": self.id, "object": "conversation", "created_at": self.created_at,
                "metadata": self.metadata}


_decode = msgspec.json.Decoder(Conversation).decode


def not_found(cid: str, param: str | None = None) -> ApiError:
    return ApiError(404, f"Conversation with id '{str(cid)[:80]}' not found.", param=param,
                    code="conversation_not_found")


class Conversations:
    """The stored conversations of one namespace (``rt``)."""

    _locks: dict[tuple[int, str], anyio.Lock] = {}

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt

    def lock(self, cid: str) -> anyio.Lock:
        """The lock a change of ``cid`` is made under (read, change, write)."""
        return self._locks.setdefault((id(self.rt), cid), anyio.Lock())

    async def load(self, cid: str, *, param: str | None = None) -> Conversation:
        """The conversation ``cid``.

        Raises:
            ApiError: 404 when it is missing or not this namespace's.
        """
        text = await read_parts(self.rt.store, _PREFIX + cid) if valid_id(cid, "conv") \
            else None
        if text is None:
            raise not_found(cid, param)
        return _decode(text)

    async def save(self, conv: Conversation) -> None:
        """Write ``conv``'s record.

        Raises:
            ApiError: 503 when the key's store is full.
        """
        try:
            await write_parts(self.rt.store, _PREFIX + conv.id, encode(conv).decode())
        except StoreFull:
            raise ApiError(503, "this API key's store is full; delete some conversations or "
                                "responses", type="server_error",
                           code="engine_overloaded") from None

    async def create(self, metadata: Mapping[str, str], items: list[Item]) -> Conversation:
        """A new conversation holding ``items``.

        Raises:
            ApiError: 400 when the key has ``MAX_CONVERSATIONS`` already.
        """
        count = sum("#" not in k for k in await self.rt.store.keys(_PREFIX))
        if count >= MAX_CONVERSATIONS:
            raise ApiError(400, f"this API key keeps {MAX_CONVERSATIONS} conversations, the "
                                "most it may: delete some (DELETE /v1/conversations/{id})",
                           code="conversation_limit")
        conv = Conversation(id=new_id("conv"), created_at=int(time.time()),
                            metadata=dict(metadata), items=items)
        await self.save(conv)
        return conv

    async def delete(self, cid: str) -> None:
        """Remove ``cid``'s record and snapshot (call under its lock)."""
        await delete_parts(self.rt.store, _PREFIX + cid)
        self._locks.pop((id(self.rt), cid), None)
        try:
            await Context.delete(self.rt, _PREFIX + cid)
        except SnapshotNotFound:
            pass

    async def add(self, conv: Conversation, items: list[Item]) -> None:
        """Append ``items`` to ``conv`` (its record is written; call under its lock).

        Raises:
            ApiError: 400 past ``MAX_CONVERSATION_ITEMS``, or an item id it holds already.
        """
        if len(conv.items) + len(items) > MAX_CONVERSATION_ITEMS:
            raise ApiError(400, f"a conversation holds at most {MAX_CONVERSATION_ITEMS} items",
                           param="items")
        taken = {i.id for i in conv.items}
        for item in items:
            if item.id in taken:
                raise ApiError(400, f"the conversation has an item with id {item.id!r} "
                                    "already", param="items")
            taken.add(item.id)
        conv.items.extend(items)
        conv.version += 1
        await self.save(conv)

    async def record_turn(self, cid: str, seen: int, header: dict[str, Any], ctx: Context,
                          items: list[Item]) -> None:
        """A response in ``cid`` ended: append its ``items`` (input, then output), and save
        ``ctx`` as the conversation's snapshot when nothing changed the conversation since
        it was read at version ``seen``."""
        async with self.lock(cid):
            try:
                conv = await self.load(cid)
            except ApiError:
                return  # deleted while the response ran
            current = conv.version == seen
            await self.add(conv, items)
            if current:
                try:
                    await Context.delete(self.rt, conv.snapshot)  # the previous turn's
                except SnapshotNotFound:
                    pass
                try:
                    await ctx.save(conv.snapshot)
                except PieError as err:  # no room: the next turn builds it again
                    log.info("conversation %s: its snapshot was not saved: %s", cid, err)
                    return
                conv.header, conv.snapshot_version = header, conv.version
                await self.save(conv)


def page(items: list[Item], query: Mapping[str, str], default_order: str = "desc"
         ) -> dict[str, Any]:
    """One page of ``items`` as OpenAI lists them (``order``, ``limit`` 1-100, ``after``,
    ``before``).

    Raises:
        ApiError: 400 naming a bad parameter.
    """
    order = query.get("order", default_order)
    if order not in ("asc", "desc"):
        raise ApiError(400, "'order' is 'asc' or 'desc'", param="order")
    try:
        limit = int(query.get("limit", "20"))
    except ValueError:
        limit = 0
    if not 1 <= limit <= 100:
        raise ApiError(400, "'limit' is an integer from 1 to 100", param="limit")
    items = items[::-1] if order == "desc" else list(items)
    for cursor, after in (("after", True), ("before", False)):
        if cursor in query:
            ids = [i.id for i in items]
            if query[cursor] not in ids:
                raise ApiError(400, f"'{cursor}' names no item of this list", param=cursor)
            k = ids.index(query[cursor])
            items = items[k + 1:] if after else items[:k]
    chosen = items[:limit]
    return {"object": "list", "data": chosen,
            "first_id": chosen[0].id if chosen else None,
            "last_id": chosen[-1].id if chosen else None,
            "has_more": len(items) > limit}


# ----------------------------------------------------------------------------- routes


class _Create(body.Body, kw_only=True):
    items: Annotated[list[Any], msgspec.Meta(max_length=MAX_ADDED)] | None = None
    metadata: Metadata | None = None


class _Update(body.Body, kw_only=True):
    metadata: Metadata


class _AddItems(body.Body, kw_only=True):
    items: Annotated[list[Any], msgspec.Meta(min_length=1, max_length=MAX_ADDED)]


_ACCEPTS = {
    "items": f"a list of at most {MAX_ADDED} items, as /v1/responses' 'input' takes them",
    "metadata": f"an object of at most {MAX_METADATA} string values (keys of at most 64 "
                "characters, values of at most 512)",
}


class ConversationRoutes:
    """The ``/v1/conversations`` routes over the per-key namespaces."""

    def __init__(self, namespaces: Namespaces) -> None:
        from starlette.routing import Route

        self.namespaces = namespaces
        base = "/v1/conversations"
        self.routes = [
            Route(base, guard(self.create), methods=["POST"]),
            Route(base + "/{cid}", guard(self.get), methods=["GET"]),
            Route(base + "/{cid}", guard(self.update), methods=["POST"]),
            Route(base + "/{cid}", guard(self.delete), methods=["DELETE"]),
            Route(base + "/{cid}/items", guard(self.list_items), methods=["GET"]),
            Route(base + "/{cid}/items", guard(self.add_items), methods=["POST"]),
            Route(base + "/{cid}/items/{iid}", guard(self.get_item), methods=["GET"]),
            Route(base + "/{cid}/items/{iid}", guard(self.delete_item), methods=["DELETE"]),
        ]

    async def _store(self, request: Any) -> Conversations:
        return Conversations(await self.namespaces.runtime(key_scope(request.headers)))

    async def _body(self, request: Any, kind: type[Any]) -> Any:
        return body.decode(await body.read_body(request), kind, _ACCEPTS)

    async def create(self, request: Any) -> Any:
        req = await self._body(request, _Create)
        items = input_items(req.items, keep_ids=True) if req.items else []
        store = await self._store(request)
        return json_response((await store.create(req.metadata or {}, items)).body())

    async def get(self, request: Any) -> Any:
        store = await self._store(request)
        return json_response((await store.load(request.path_params["cid"])).body())

    async def update(self, request: Any) -> Any:
        req = await self._body(request, _Update)
        store = await self._store(request)
        cid = request.path_params["cid"]
        async with store.lock(cid):
            conv = await store.load(cid)
            conv.metadata = dict(req.metadata)
            await store.save(conv)
        return json_response(conv.body())

    async def delete(self, request: Any) -> Any:
        store = await self._store(request)
        cid = request.path_params["cid"]
        async with store.lock(cid):
            await store.load(cid)  # 404 unless it is this key's
            await store.delete(cid)
        return json_response({"id": cid, "object": "conversation.deleted", "deleted": True})

    async def list_items(self, request: Any) -> Any:
        store = await self._store(request)
        conv = await store.load(request.path_params["cid"])
        return json_response(page(conv.items, request.query_params))

    async def add_items(self, request: Any) -> Any:
        req = await self._body(request, _AddItems)
        items = input_items(req.items, keep_ids=True)
        store = await self._store(request)
        cid = request.path_params["cid"]
        async with store.lock(cid):
            await store.add(await store.load(cid), items)
        return json_response({"object": "list", "data": items, "first_id": items[0].id,
                      "last_id": items[-1].id, "has_more": False})

    async def _item(self, request: Any, conv: Conversation) -> int:
        iid = request.path_params["iid"]
        for k, item in enumerate(conv.items):
            if item.id == iid:
                return k
        raise ApiError(404, f"Item with id '{iid[:80]}' not found.", param="item_id",
                       code="item_not_found")

    async def get_item(self, request: Any) -> Any:
        store = await self._store(request)
        conv = await store.load(request.path_params["cid"])
        return json_response(conv.items[await self._item(request, conv)])

    async def delete_item(self, request: Any) -> Any:
        store = await self._store(request)
        cid = request.path_params["cid"]
        async with store.lock(cid):
            conv = await store.load(cid)
            del conv.items[await self._item(request, conv)]
            conv.version += 1
            await store.save(conv)
        return json_response(conv.body())

