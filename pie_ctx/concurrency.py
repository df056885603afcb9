"""Backend-neutral helpers for inferlets (they run under asyncio and trio alike)."""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any

import anyio

__all__ = ["gather"]


async def gather(*awaitables: Awaitable[Any]) -> list[Any]:
    """Await all concurrently; return their results in argument order.

    Every awaitable runs to its end: one failing does not cancel the others, so work they
    had started (a save, a delete) is never left half-done. Then, if any failed, the first
    error (the earliest to happen) is raised as itself, not wrapped in an
    ``ExceptionGroup``; a note on it counts the others. Cancelling ``gather`` itself
    cancels them all.
    """
    results: list[Any] = [None] * len(awaitables)
    errors: list[Exception] = []

    async def run(i: int, aw: Awaitable[Any]) -> None:
        try:
            results[i] = await aw
        except Exception as exc:  # delivered after everyone has finished
            errors.append(exc)

    async with anyio.create_task_group() as tg:
        for i, aw in enumerate(awaitables):
            tg.start_soon(run, i, aw)
    if errors:
        first = errors[0]
        if len(errors) > 1:
            first.add_note(f"{len(errors) - 1} more of the gathered awaitables failed too")
        raise first
    return results
