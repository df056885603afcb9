"""Same seed, same tokens (issue 35): on the default model with ``deterministic=True`` (the
engine's default), a seeded generation at temperature 1 gives the same 256 tokens however
its tokens were computed:

* with a warm cache (a partial prefix hit), a cold one, and from a snapshot's pages;
* alone and in a batch of 8 unrelated contexts;
* with prefill chunks of 16, 64 and 512 tokens (the engine's step budget);
* in a fork of a flushed context and in a fresh context with the same history, and in the
  snapshot of it reopened by a restarted engine.

fp32 weights and KV run in the default suite (one engine, the scenarios batched together
where they allow it); int8 weights and/or int8 KV with ``PIE_CTX_SLOW=1``. The small
machinery check (a row alone vs the same row among others, per kernel) is in
tests/model/test_deterministic_kernels.py.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pie_ctx import Context, Runtime, Sampler
from runtime.boot import boot_engine

SLOW = os.environ.get("PIE_CTX_SLOW") == "1"
CONFIGS = [("fp32", "fp32")] + ([("int8", "int8"), ("int8", "fp32"), ("fp32", "int8")]
                                if SLOW else [])
TOKENS = 256  # generated per scenario
TAIL = 48  # generated after a fork / a fresh copy / a reopened snapshot
SEED = 11

_rng = np.random.default_rng(35)
PROMPT = [int(t) for t in _rng.integers(200, 40000, 300)]  # crosses a 256-key split
OTHERS = [[int(t) for t in _rng.integers(200, 40000, 30 + 17 * i)] for i in range(7)]


@asynccontextmanager
async def _engine(weights: str, kv: str, folder: Path) -> AsyncIterator[tuple[Any, Runtime]]:
    engine = boot_engine(None, weights=weights, kv_dtype=kv, num_pages=1024,
                         snapshot_dir=folder, progress=False)
    async with engine, Runtime.local(engine=engine) as rt:
        assert rt.info.deterministic and rt.info.kernels
        yield engine, rt


@contextmanager
def _steps(engine: Any, budget: int, *, cache: bool) -> Iterator[None]:
    """Prefill chunks of at most ``budget`` tokens; ``cache=False``: no prefix reuse (every
    page of a prompt is computed)."""
    store, scheduler = engine.store, engine.scheduler
    saved = scheduler.max_step_tokens
    scheduler.max_step_tokens = budget
    if not cache:
        store.attach_prefix = lambda *args, **kw: 0
    try:
        yield
    finally:
        scheduler.max_step_tokens = saved
        if not cache:
            del store.attach_prefix


async def _generate(ctx: Context, seed: int = SEED, n: int = TOKENS) -> list[int]:
    return await ctx.generate(Sampler.temperature(1.0, seed=seed), max_tokens=n,
                              ignore_eos=True).tokens()


async def _fresh(rt: Runtime, tokens: list[int], seed: int = SEED, n: int = TOKENS) -> list[int]:
    return await _generate(Context(rt).append(tokens), seed, n)


@pytest.mark.parametrize("weights,kv", CONFIGS, ids=[f"w{w}-kv{k}" for w, k in CONFIGS])
async def test_same_seed_same_tokens(weights: str, kv: str, tmp_path: Path) -> None:
    async with _engine(weights, kv, tmp_path) as (engine, rt):
        # A partial prefix hit: the cache holds the prompt's first 4 pages.
        warm = Context(rt).append(PROMPT[:70])
        await warm.flush()
        with _steps(engine, 512, cache=True):
            ref = await _fresh(rt, PROMPT)
        assert len(ref) == TOKENS

        # Cold, chunks of 16, in a batch of 8 unrelated contexts.
        with _steps(engine, 16, cache=False):
            batch = await asyncio.gather(_fresh(rt, PROMPT),
                                         *(_fresh(rt, o, seed=i) for i, o in enumerate(OTHERS)))
        assert batch[0] == ref, "in a batch of 8, chunks of 16"

        # Cold, chunks of 64, beside a fork of a flushed context and a fresh copy of it.
        history = PROMPT + ref[:32]
        parent = Context(rt).append(history)
        await parent.flush()
        await parent.save("det")
        with _steps(engine, 64, cache=False):
            chunk64, forked, fresh = await asyncio.gather(
                _fresh(rt, PROMPT), _generate(parent.fork(), 5, TAIL),
                _fresh(rt, history, 5, TAIL))
        assert chunk64 == ref, "chunks of 64"
        assert forked == fresh, "a fork vs a fresh context with the same history"

        # Cold, one chunk of 512 (the whole prompt).
        with _steps(engine, 512, cache=False):
            assert await _fresh(rt, PROMPT) == ref, "one chunk"

    # A restarted engine (the kernel choices kept with the snapshot folder) continues the
    # snapshot as the fork did.
    async with _engine(weights, kv, tmp_path) as (engine, rt):
        reopened = await Context.open(rt, "det")
        assert await _generate(reopened, 5, TAIL) == forked, "a reopened snapshot"


@pytest.mark.xfail(strict=False, reason="open (issue 35): on the default model in bf16 the "
                   "speculative and plain greedy outputs part at token 30; the tiny model's "
                   "bf16 rows are bit-identical alone, batched and chunked, cause not found")
async def test_bf16_greedy_speculation_is_plain_greedy() -> None:
    """A verify pass of k + 1 rows computes each row as a single-row step does, so greedy
    speculation in bf16 gives exactly plain greedy output (docs/decoding.md)."""
    engine = boot_engine(None, dtype="bfloat16", num_pages=256, progress=False)
    async with engine, Runtime.local(engine=engine) as rt:
        assert rt.info.deterministic
        text = ("List the colours: red, green, blue, red, green, blue, red, green, blue, "
                "red, green, blue, red, green")
        plain = await Context(rt).user(text).generate(max_tokens=TAIL, ignore_eos=True).tokens()
        spec = await Context(rt).user(text).generate(max_tokens=TAIL, ignore_eos=True,
                                                     speculator="prompt_lookup").tokens()
        assert spec == plain
