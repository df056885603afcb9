"""A tiny random model behind a real engine, for SDK tests.

The model is a 2-layer Llama with hidden size 64 and a byte-level BPE tokenizer with a
ChatML template (see tests/model/loader_fixtures.py), loaded through the real HF-folder
loader, so SDK tests exercise the whole stack in well under a second per test.

Every test that takes the ``tiny_folder`` fixture runs once per dtype (fp32 and bf16; fp16
too for tests marked ``fp16``; see tests/conftest.py): the fixture is a :class:`TinyModel`,
a path that also carries the dtype its engines run in and the logits tolerance of that dtype.
"""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import numpy as np

from pie_ctx import Runtime
from runtime.boot import boot_engine

_FOLDERS: dict[bool, Path] = {}  # scaled -> folder

# How far one logit may move when the same tokens are computed another way (batched with
# others, chunked, through a cascade, from a snapshot), relative to the row's max |logit|:
# a few units in the last place of the dtype (fp32: 24 significant bits, fp16: 11, bf16: 8).
LOGIT_TOL = {"float32": 5e-5, "float16": 2.0**-8, "bfloat16": 2.0**-5}


class TinyModel(os.PathLike):
    """The tiny model's folder (usable as a path) and the dtype its engines run in."""

    def __init__(self, path: Path, dtype: str = "float32") -> None:
        self.path, self.dtype = path, dtype

    def __fspath__(self) -> str:
        return str(self.path)

    def __str__(self) -> str:
        return str(self.path)

    def __repr__(self) -> str:
        return f"TinyModel({self.path!s}, {self.dtype})"

    def tol(self, logits: Any = 1.0) -> float:
        """The absolute tolerance for logits (or values derived from them) of scale ``logits``
        (a number, or an array whose max |value| is the scale)."""
        scale = float(np.abs(np.asarray(logits, dtype=np.float64)).max())
        return LOGIT_TOL[self.dtype] * max(scale, 1.0)


def tiny_model_folder(tmp_root: Path, *, scaled: bool = False) -> Path:
    """The tiny model's HF folder, written once per session (``scaled``: weights drawn like
    a trained model's, see ``hf_reference_weights``)."""
    folder = _FOLDERS.get(scaled)
    if folder is None or not folder.exists():
        from tests.model.loader_fixtures import hf_reference_weights, write_tiny_hf_folder

        name = "tiny-llama-scaled" if scaled else "tiny-llama"
        folder = write_tiny_hf_folder(tmp_root / name, hf_reference_weights(seed=3, scaled=scaled))
        # Byte-level tokens make prompts long: give the tiny model room for them.
        config = json.loads((folder / "config.json").read_text())
        config["max_position_embeddings"] = 4096
        (folder / "config.json").write_text(json.dumps(config))
        _FOLDERS[scaled] = folder
    return folder


# PIE_CTX_TEST_TP=N runs every engine these helpers boot with tensor parallelism over N
# ranks (`make test-tp`: the SDK suite against a TP=2 engine, docs/scale-out.md).
TEST_TP = int(os.environ.get("PIE_CTX_TEST_TP", "1"))
# PIE_CTX_TEST_BACKEND=transformers runs them on the transformers backend (`make
# test-backend`: the SDK suite over transformers' own Llama, docs/models.md).
TEST_BACKEND = os.environ.get("PIE_CTX_TEST_BACKEND")


@asynccontextmanager
async def tiny_engine(folder: Path | TinyModel, *, page_size: int = 4, num_pages: int = 512,
                      **kw) -> AsyncIterator[Any]:
    if isinstance(folder, TinyModel):
        kw.setdefault("dtype", folder.dtype)
    if TEST_TP > 1:
        kw.setdefault("tp", TEST_TP)
    if TEST_BACKEND:
        kw.setdefault("backend", TEST_BACKEND)
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
