"""``HostedTransport``: the in-process transport of a hosted inferlet.

Owns: nothing in the engine; it carries one launch's requests from the inferlet's own event
loop (on its own thread) to the engine's loop, and the replies and generation messages back.

Threads: ``request`` and ``generate`` are called on the inferlet's loop; every engine call
runs on the engine's loop (``asyncio.run_coroutine_threadsafe``), so the engine is only ever
touched from its own thread, as with a socket client. Cancelling an await here cancels the
engine-side call; closing the transport releases the launch's owner.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Coroutine
from typing import Any

from pie_ctx.proto import messages as P
from pie_ctx.proto.errors import ProtocolError
from pie_ctx.proto.messages import raise_if_error
from pie_ctx.transport import LocalTransport

__all__ = ["HostedTransport"]

_END = object()


class HostedTransport(LocalTransport):
    """One launch's connection to the engine, across two event loops.

    A ``LocalTransport`` (the same engine, info, tokenizer and ``release_soon``, which is
    safe from any thread) whose engine calls hop to the engine's loop.

    Args:
        engine: the running engine.
        engine_loop: the loop the engine runs on.
        owner: the launch's engine owner.
        namespace: the launch's namespace.
        is_open: False once the launch was cancelled (its owner is already released).
    """

    def __init__(self, engine: Any, engine_loop: asyncio.AbstractEventLoop, owner: Any,
                 namespace: str, is_open: Callable[[], bool]) -> None:
        super().__init__(engine, namespace=namespace)
        self._owner = owner  # the launch's, made by the host (not a fresh one)
        self._loop = engine_loop
        self._is_open = is_open

    def _check_open(self) -> None:
        if self._closed or not self._is_open():
            raise ProtocolError("this inferlet's runtime is closed (it ended or was cancelled)")

    async def _call(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._loop))

    async def request(self, req: Any) -> Any:
        self._check_open()
        return raise_if_error(await self._call(
            self._engine.handle(req, owner=self._owner, namespace=self._namespace)))

    async def generate(self, req: P.Generate) -> Any:
        self._check_open()
        here = asyncio.get_running_loop()
        queue: asyncio.Queue[Any] = asyncio.Queue()

        def put(msg: Any) -> None:
            with contextlib.suppress(RuntimeError):  # our loop already closed
                here.call_soon_threadsafe(queue.put_nowait, msg)

        async def pump() -> None:  # on the engine's loop
            try:
                stream = await self._engine.generate(req, owner=self._owner,
                                                     namespace=self._namespace)
                try:
                    async for msg in stream:
                        put(msg)
                finally:
                    stream.close()
            except Exception as err:  # a bug: the inferlet hears it as the stream's error
                put(P.error_reply(err))
            finally:
                put(_END)

        return _BridgedStream(queue, asyncio.run_coroutine_threadsafe(pump(), self._loop))

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True

        async def release() -> None:
            self._engine.release_owner(self._owner)

        with contextlib.suppress(RuntimeError, asyncio.CancelledError):  # the engine stopped
            await self._call(release())


class _BridgedStream:
    """A generation's messages, arriving from the engine's loop."""

    def __init__(self, queue: asyncio.Queue[Any], pump: Any) -> None:
        self._queue = queue
        self._pump = pump

    def __aiter__(self) -> _BridgedStream:
        return self

    async def __anext__(self) -> Any:
        msg = await self._queue.get()
        if msg is _END:
            self._queue.put_nowait(_END)  # stay at the end for any later read
            raise StopAsyncIteration
        return msg

    async def aclose(self) -> None:
        self._pump.cancel()  # cancels the engine-side stream: the generation stops

    def __del__(self) -> None:
        self._pump.cancel()
