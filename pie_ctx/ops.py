"""Per-context operation ordering.

Owns: the FIFO chain of one context's operations. Some SDK calls are synchronous
(``Context(rt)``, ``fork()``, ``save()``) but need the runtime; they queue their work here
and it runs in the runtime's task group. Every operation of a context, awaited or queued,
runs after the ones called before it, so ``base.fork(); await base.flush()`` forks the
state before the flush, as the code reads.

Liveness: an operation that holds its place while it streams (a generation) gives the
chain a ``drain``: whoever waits behind it reads the stream to its end instead of waiting
for a consumer that may never come, so an abandoned generator can delay the next
operation by the rest of its generation, never forever.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Generator
from typing import Any

import anyio

from pie_ctx.proto.errors import ContextClosed

__all__ = ["Op", "OpChain"]


class Op:
    """The completion of one queued operation; ``await op`` returns its result or raises.

    ``observed`` is set once someone awaited it, so an error nobody saw can be reported
    later (see ``ContextCore``).
    """

    __slots__ = ("done", "result", "error", "observed", "drain")

    def __init__(self) -> None:
        self.done = anyio.Event()
        self.result: Any = None
        self.error: BaseException | None = None
        self.observed = False
        # For an operation that ends only when a stream does: reads it to the end.
        self.drain: Callable[[], Awaitable[None]] | None = None

    def __await__(self) -> Generator[Any, None, Any]:
        return self._wait().__await__()

    async def _wait(self) -> Any:
        self.observed = True
        await self.done.wait()
        if self.error is not None:
            raise self.error
        return self.result

    def finish(self, error: BaseException | None = None, result: Any = None) -> None:
        """Complete the operation (idempotent: the first call wins)."""
        if self.done.is_set():
            return
        self.result, self.error = result, error
        self.done.set()


async def _after(prev: Op | None) -> None:
    """Wait until ``prev`` has completed, reading its stream to the end if it has one."""
    while prev is not None and not prev.done.is_set():
        if prev.drain is not None:
            await prev.drain()
        else:
            await prev.done.wait()


class OpChain:
    """FIFO of operations on one context."""

    __slots__ = ("_tail",)

    def __init__(self, after: Op | None = None) -> None:
        self._tail: Op | None = after

    def enqueue(self, body: Callable[[], Awaitable[Any]]) -> tuple[Op, Callable[[], Awaitable[None]]]:
        """Reserve the next place in the chain.

        Returns:
            ``(op, run)``: ``run()`` waits for the previous operation, runs ``body`` and
            completes ``op``; call it (or spawn it) exactly once.
        """
        prev, op = self._tail, Op()
        self._tail = op

        async def run() -> None:
            try:
                await _after(prev)
                op.finish(result=await body())
            except Exception as exc:  # delivered to whoever awaits the op
                op.finish(exc)
            finally:  # cancelled before it finished (its task, or the whole runtime)
                op.finish(ContextClosed("this operation was cancelled before it finished"))

        return op, run

    async def run(self, body: Callable[[], Awaitable[Any]]) -> Any:
        """Run ``body`` in order, in the caller's task, and return its result."""
        op, run = self.enqueue(body)
        await run()
        return await op

    def acquire(self) -> tuple[Op, Callable[[], Awaitable[None]]]:
        """Take the chain for an operation that ends later (a streamed generation).

        Returns:
            ``(op, wait)``: ``await wait()`` until it is this operation's turn; then
            ``op.finish(...)`` when the operation ends. Set ``op.drain`` so operations
            queued behind it never depend on someone consuming the stream.
        """
        prev, op = self._tail, Op()
        self._tail = op

        async def wait() -> None:
            await _after(prev)

        return op, wait
