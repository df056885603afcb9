"""``Runtime``: what an inferlet receives as ``rt``.

Owns: one transport (one owner on the engine side) and a task group for the context
operations the SDK starts without awaiting (``fork()``, ``Context(rt)``, ``save()``).
Closing the runtime releases every context its inferlet left open; snapshots stay. After
that, every operation on its contexts raises ``ContextClosed`` at once.

Usage::

    async with Runtime.local() as rt:            # boots the default model in-process
        ctx = Context(rt).user("Hi").cue()
        print(await ctx.generate(Sampler.greedy(), max_tokens=32).text())
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio

from pie_ctx.proto import messages as P
from pie_ctx.proto.errors import ContextClosed, single_exception
from pie_ctx.transport import LocalTransport, Transport

__all__ = ["Runtime"]


class Runtime:
    """A connection to an engine, in this process or behind ``pie-ctx serve``."""

    def __init__(self, transport: Transport, task_group: Any) -> None:
        self.transport = transport
        self._tg = task_group
        self._closed = False

    @property
    def closed(self) -> bool:
        """True once the runtime's block has ended (its contexts are released)."""
        return self._closed

    # ------------------------------------------------------------------ constructors

    @classmethod
    @asynccontextmanager
    async def local(cls, model: str | None = None, *, page_size: int = 16,
                    num_pages: int | None = None, snapshot_dir: str | os.PathLike | None = None,
                    engine: Any = None, **engine_kw: Any) -> AsyncIterator[Runtime]:
        """Boot an engine in this process (or use ``engine``, already running) for one owner.

        Args:
            model: model reference (None = the default SmolLM2-135M-Instruct).
            page_size: tokens per page.
            num_pages: pool size (default: what ``kv_memory_gb`` holds).
            snapshot_dir: an existing folder where snapshots are durable: they survive the
                runtime and are bounded by the disk, not the pool. None (the default): in
                memory, for this runtime's life (docs/snapshots.md).
            engine: an existing, running engine to share (then ``model`` etc. are ignored).
            **engine_kw: more ``boot_engine`` settings (``kv_memory_gb``, ``weights``...).

        Raises:
            StorageError: ``snapshot_dir`` is missing, read-only, or in use by another engine.
        """
        if engine is not None:
            async with cls._over(LocalTransport(engine)) as rt:
                yield rt
            return
        # The documented lazy entry point into the runtime package: torch loads only here.
        from runtime.engine.boot import boot_engine

        booted = boot_engine(model, page_size=page_size, num_pages=num_pages,
                             snapshot_dir=snapshot_dir, **engine_kw)
        async with booted, cls._over(LocalTransport(booted)) as rt:
            yield rt

    @classmethod
    @asynccontextmanager
    async def connect(cls, address: str, *, token: str | None = None,
                      namespace: str | None = None) -> AsyncIterator[Runtime]:
        """Connect to ``pie-ctx serve`` at ``address`` (see docs/server.md)."""
        from pie_ctx.socket_transport import SocketTransport

        async with SocketTransport.open(address, token=token, namespace=namespace) as transport, \
                cls._over(transport) as rt:
            yield rt

    @classmethod
    @asynccontextmanager
    async def _over(cls, transport: Transport) -> AsyncIterator[Runtime]:
        rt: Runtime | None = None
        try:
            async with anyio.create_task_group() as tg:
                rt = cls(transport, tg)
                yield rt
        except BaseExceptionGroup as group:
            # The task group wraps whatever the inferlet raised; give it back unwrapped.
            raise single_exception(group) from None
        finally:
            if rt is not None:
                rt._closed = True
            # Everything the inferlet left open is released by closing its owner.
            with anyio.CancelScope(shield=True):
                await transport.aclose()

    # ----------------------------------------------------------------------- queries

    @property
    def info(self) -> P.EngineInfo:
        """Model name, page size, vocabulary size, limits and stop tokens of the engine."""
        return self.transport.info

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer (``encode``, ``decode``, ``render_chat``...)."""
        return self.transport.tokenizer

    @property
    def page_size(self) -> int:
        """Tokens per KV page (fixed for the engine's life)."""
        return self.transport.info.page_size

    @property
    def model_name(self) -> str:
        """The loaded model's name."""
        return self.transport.info.model_name

    async def snapshots(self) -> list[str]:
        """Names of the saved snapshots this runtime can see."""
        return (await self.transport.request(P.ListSnapshots())).names

    async def stats(self) -> P.EngineStats:
        """Engine-wide counters: pages free/used/cached, hit rate, tokens, time."""
        return await self.transport.request(P.GetStats())

    def spawn(self, fn: Callable[[], Awaitable[Any]]) -> None:
        """Run ``fn()`` in the background, inside this runtime's lifetime.

        Raises:
            ContextClosed: the runtime is closed.
        """
        if self._closed:
            raise ContextClosed("this runtime is closed (its inferlet ended)")
        self._tg.start_soon(fn)

