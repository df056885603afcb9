"""Shared pieces of the hosted-inferlet tests: the test inferlets' folder and a runtime on
an engine that hosts them (in-process or over the socket)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import anyio

from runtime.hosted.host import host_inferlets
from tests.sdk.harness import new_runtime, sdk_owners

INFERLETS = Path(__file__).resolve().parent / "inferlets"


@asynccontextmanager
async def hosting(folder: Path, transport: str, n: int = 1, inferlets: Path = INFERLETS,
                  **kw: Any) -> AsyncIterator[tuple[list[Any], Any]]:
    """``n`` runtimes on a tiny engine that hosts ``inferlets``."""
    async with sdk_owners(folder, transport, 0, **kw) as (_, engine), AsyncExitStack() as stack:
        host_inferlets(engine, inferlets)
        rts = [await stack.enter_async_context(new_runtime(engine, transport)) for _ in range(n)]
        yield rts, engine


async def settled(engine: Any, timeout: float = 10.0) -> None:
    """Wait until no context is live (every launch released its own)."""
    with anyio.fail_after(timeout):
        while engine.stats().num_contexts:
            await anyio.sleep(0.01)
    engine.store.check_invariants()


__all__ = ["INFERLETS", "hosting", "new_runtime", "settled"]
