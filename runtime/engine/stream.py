"""``GenerationStream``: the messages of one generation, as the engine hands them out.

Owns: the receiving end of one generation's message stream. Closing it (or dropping it)
cancels the generation if it is still running; the engine then leaves the context exactly
as it was before the generation.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import anyio

from runtime.engine.jobs import Job, JobStatus

if TYPE_CHECKING:
    from runtime.engine.engine import Engine

__all__ = ["GenerationStream"]


class GenerationStream:
    """Messages of one generation: ``async for msg in stream`` (see ``Engine.generate``)."""

    def __init__(self, engine: Engine, job: Job | None, receive: Any) -> None:
        self._engine = engine
        self._job = job
        self._receive = receive

    def __aiter__(self) -> GenerationStream:
        return self

    async def __anext__(self) -> Any:
        try:
            return await self._receive.receive()
        except anyio.EndOfStream:
            raise StopAsyncIteration from None
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Cancel the generation if it is still running (idempotent, sync)."""
        if self._job is not None and self._job.status is not JobStatus.DONE:
            self._engine.cancel(self._job)
        self._receive.close()

    async def aclose(self) -> None:
        self.close()

    async def __aenter__(self) -> GenerationStream:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        job = self._job
        if job is not None and job.status is not JobStatus.DONE:
            job.cancelled = True  # the scheduler drops it at the next step boundary
