"""``GenerationStream``: the messages of one generation, as the engine hands them out.

Owns: the receiving end of one generation's message stream. Closing it (or dropping it)
cancels the generation if it is still running; the engine then leaves the context exactly
as it was before the generation.
"""

from __future__ import annotations

import math
from typing import Any

import anyio

from pie_ctx.proto.messages import error_reply
from runtime.engine.jobs import Job, JobQueue, JobStatus

__all__ = ["GenerationStream"]


class GenerationStream:
    """Messages of one generation: ``async for msg in stream`` (see ``Passes.generate``)."""

    def __init__(self, jobs: JobQueue | None, job: Job | None, receive: Any) -> None:
        self._jobs = jobs
        self._job = job
        self._receive = receive

    @classmethod
    def failed(cls, error: BaseException) -> GenerationStream:
        """A stream that yields only the ``ErrorReply`` of a generation that never started."""
        send, receive = anyio.create_memory_object_stream[Any](math.inf)
        send.send_nowait(error_reply(error))
        send.close()
        return cls(None, None, receive)

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
        if self._jobs is not None and self._job is not None \
                and self._job.status is not JobStatus.DONE:
            self._jobs.cancel(self._job)
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
