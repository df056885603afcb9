"""The one narrow interface between the SDK and a runtime.

A transport carries ``pie_ctx.proto.messages`` requests to an engine and brings replies back.
Two implementations: :class:`LocalTransport` (an engine in this process) and
``pie_ctx.socket_transport.SocketTransport`` (an engine behind ``pie-ctx serve``). The SDK
only ever calls the methods of :class:`Transport`, so every SDK test runs against both, and
both give the same answers and the same errors (the SDK checks arguments with the
contract's ``pie_ctx.proto.checks`` before a request reaches either). A closed transport
refuses every request at once with ``ProtocolError``.

Importing this module does not import torch.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol, runtime_checkable

from pie_ctx.proto import messages as P
from pie_ctx.proto.errors import ProtocolError
from pie_ctx.proto.messages import raise_if_error


@runtime_checkable
class Transport(Protocol):
    """What the SDK needs from a runtime."""

    @property
    def info(self) -> P.EngineInfo:
        """Model name, page size, limits (fixed for the transport's life)."""
        ...

    @property
    def tokenizer(self) -> Any:
        """A tokenizer with ``encode``, ``decode``, ``render_chat``, ``stop_token_ids``."""
        ...

    async def request(self, req: Any) -> Any:
        """Send one non-streaming request; return its reply or raise its typed error."""
        ...

    async def generate(self, req: P.Generate) -> GenerateStream:
        """Start a generation; the stream yields ``GenerateChunk`` then ``GenerateDone``."""
        ...

    def release_soon(self, ctx: int) -> None:
        """Release a context without awaiting (safe from ``__del__`` and other threads)."""
        ...

    async def aclose(self) -> None:
        """Release everything this transport's owner still holds (not snapshots)."""
        ...


class GenerateStream(Protocol):
    def __aiter__(self) -> AsyncIterator[Any]: ...

    async def aclose(self) -> None: ...


class LocalTransport:
    """An engine in this process. Each transport is one owner: closing it releases its
    contexts (snapshots stay).

    Args:
        engine: a running ``runtime.engine.Engine`` (inside ``async with engine``).
        namespace: the snapshot namespace this owner sees.
    """

    def __init__(self, engine: Any, *, namespace: str = "default") -> None:
        self._engine = engine
        self._owner = object()
        self._namespace = namespace
        self._info: P.EngineInfo = engine.info()
        self._closed = False

    @property
    def info(self) -> P.EngineInfo:
        return self._info

    @property
    def tokenizer(self) -> Any:
        return self._engine.tokenizer

    @property
    def engine(self) -> Any:
        return self._engine

    @property
    def owner(self) -> Any:
        """What this transport's requests carry as their owner (``engine.add_tenant``)."""
        return self._owner

    def _check_open(self) -> None:
        if self._closed:
            raise ProtocolError("this transport is closed (its runtime ended)")

    async def request(self, req: Any) -> Any:
        self._check_open()
        return raise_if_error(
            await self._engine.handle(req, owner=self._owner, namespace=self._namespace)
        )

    async def generate(self, req: P.Generate) -> Any:
        self._check_open()
        return await self._engine.generate(req, owner=self._owner, namespace=self._namespace)

    def release_soon(self, ctx: int) -> None:
        if not self._closed:
            self._engine.release_soon(ctx)

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            self._engine.release_owner(self._owner)
