"""The KV-head rule on the default model (SmolLM2-135M: 9 q heads, 3 KV heads): N=2 is
refused with the sizes that work, N=3 (one KV head per rank) gives TP=1's greedy tokens."""

from __future__ import annotations

import anyio
import pytest

from pie_ctx import Context, Runtime, Sampler
from pie_ctx.errors import InvalidArgument
from runtime.boot import boot_engine

pytestmark = pytest.mark.real_model


async def _greedy(tp: int) -> list[list[int]]:
    engine = boot_engine(None, num_pages=64, progress=False, tp=tp)
    with anyio.fail_after(240):
        async with engine, Runtime.local(engine=engine) as rt:
            base = Context(rt).user("Name three colours.")
            await base.flush()
            fork = base.fork()
            return [await c.generate(Sampler.greedy(), max_tokens=8, ignore_eos=True).tokens()
                    for c in (base, fork)]


def test_two_ranks_refused_with_the_sizes_that_work():
    with pytest.raises(InvalidArgument, match=r"9 query heads, 3 KV heads .* "
                                              r"--tensor-parallel 1, 3"):
        boot_engine(None, num_pages=8, progress=False, tp=2)


async def test_three_ranks_match_one_greedy():
    assert await _greedy(3) == await _greedy(1)
