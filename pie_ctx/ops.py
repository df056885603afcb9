"""Per-context operation ordering.

Owns: the FIFO chain of one context's operations. Some SDK calls are synchronous
(``Context(rt)``, ``fork()``, ``save()``) but need the runtime; they queue their work here
and it runs in the runtime's task group. Every operation of a context, awaited or queued,
runs after the ones called before it, so ``base.fork(); await base.flush()`` forks the
state before the flush, as the code reads.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Generator
from typing import Any

import anyio

__all__ = ["Op", "OpChain"]


class Op:
    """The completion of one queued operation; ``await op`` returns its result or raises."""

    __slots__ = ("done", "result", "error")

    def __init__(self) -> None:
        self.done = anyio.Event()
        self.result: Any = None
        self.error: BaseException | None = None

    def __await__(self) -> Generator[Any, None, Any]:
        return self._wait().__await__()

    async def _wait(self) -> Any:
        await self.done.wait()
        if self.error is not None:
            raise self.error
        return self.result


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
                if prev is not None:
                    await prev.done.wait()
                op.result = await body()
            except Exception as exc:  # delivered to whoever awaits the op
                op.error = exc
            finally:
                op.done.set()

        return op, run

    async def run(self, body: Callable[[], Awaitable[Any]]) -> Any:
        """Run ``body`` in order, in the caller's task, and return its result."""
        op, run = self.enqueue(body)
        await run()
        return await op

    def acquire(self) -> tuple[Op, Callable[[], Awaitable[None]]]:
        """Take the chain for an operation that ends later (a streamed generation).

        Returns:
            ``(op, wait)``: ``await wait()`` until it is this operation's turn; then set
            ``op.done`` (after filling ``result``/``error``) when the operation ends.
        """
        prev, op = self._tail, Op()
        self._tail = op

        async def wait() -> None:
            if prev is not None:
                await prev.done.wait()

        return op, wait
