"""A tiny random model behind a real engine, for SDK tests.

The model is a 2-layer Llama with hidden size 64 and a byte-level BPE tokenizer with a
ChatML template (see tests/model/loader_fixtures.py), loaded through the real HF-folder
loader, so SDK tests exercise the whole stack in well under a second per test.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

from pie_ctx import Runtime
from runtime.engine.boot import boot_engine

_FOLDER: Path | None = None


def tiny_model_folder(tmp_root: Path) -> Path:
    global _FOLDER
    if _FOLDER is None or not _FOLDER.exists():
        from tests.model.loader_fixtures import hf_reference_weights, write_tiny_hf_folder

        folder = write_tiny_hf_folder(tmp_root / "tiny-llama", hf_reference_weights(seed=3))
        # Byte-level tokens make prompts long: give the tiny model room for them.
        config = json.loads((folder / "config.json").read_text())
        config["max_position_embeddings"] = 4096
        (folder / "config.json").write_text(json.dumps(config))
        _FOLDER = folder
    return _FOLDER


@asynccontextmanager
async def tiny_engine(folder: Path, *, page_size: int = 4, num_pages: int = 512,
                      **kw) -> AsyncIterator[Any]:
    engine = boot_engine(str(folder), page_size=page_size, num_pages=num_pages,
                         progress=False, **kw)
    async with engine:
        yield engine


@asynccontextmanager
async def tiny_runtime(folder: Path, **kw) -> AsyncIterator[Runtime]:
    async with tiny_engine(folder, **kw) as engine, Runtime.local(engine=engine) as rt:
        yield rt


@asynccontextmanager
async def sdk_runtime(folder: Path, transport: str = "local", **kw):
    """Yield ``(rt, engine)`` with the SDK talking to the engine in-process or over a socket."""
    async with sdk_owners(folder, transport, 1, **kw) as (rts, engine):
        yield rts[0], engine


@asynccontextmanager
async def sdk_owners(folder: Path, transport: str = "local", n: int = 2, **kw):
    """Yield ``([rt, ...], engine)``: ``n`` runtimes, each its own owner on one engine
    (in-process, or each over its own connection to a server)."""
    async with tiny_engine(folder, **kw) as engine, AsyncExitStack() as stack:
        if transport != "local":
            from runtime.server.testing import serve_in_background

            srv = await stack.enter_async_context(serve_in_background(engine, run_engine=False))
            _ADDRESSES[id(engine)] = srv.address
        rts = [await stack.enter_async_context(new_runtime(engine, transport)) for _ in range(n)]
        yield rts, engine
        _ADDRESSES.pop(id(engine), None)


_ADDRESSES: dict[int, str] = {}  # engine -> the address it is served on (sdk_owners)


def new_runtime(engine: Any, transport: str) -> Any:
    """Another owner on an engine of ``sdk_owners``: ``async with new_runtime(...) as rt``."""
    if transport == "local":
        return Runtime.local(engine=engine)
    return Runtime.connect(_ADDRESSES[id(engine)])
