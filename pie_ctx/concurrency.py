"""Backend-neutral helpers for inferlets (they run under asyncio and trio alike)."""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any

import anyio

__all__ = ["gather"]


async def gather(*awaitables: Awaitable[Any]) -> list[Any]:
    """Await all concurrently; results in argument order. The first error cancels the rest
    and is raised (like ``asyncio.gather`` inside a task group)."""
    results: list[Any] = [None] * len(awaitables)

    async def run(i: int, aw: Awaitable[Any]) -> None:
        results[i] = await aw

    async with anyio.create_task_group() as tg:
        for i, aw in enumerate(awaitables):
            tg.start_soon(run, i, aw)
    return results
