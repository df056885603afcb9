"""The engine over the real runner and a tiny random Llama: batching must not change any
token, prefix reuse must not change any logit, memory pressure must not change outputs."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from pie_ctx.proto import messages as P
from tests.sdk.harness import tiny_engine


async def new_ctx(engine) -> int:
    return (await engine.handle(P.CreateContext(), raise_errors=True)).ctx


async def generate(engine, ctx, tokens, n):
    done = None
    async for msg in await engine.generate(P.Generate(ctx=ctx, tokens=tokens, max_tokens=n,
                                                      stop_token_ids=[])):
        if isinstance(msg, P.ErrorReply):
            raise AssertionError(msg)
        done = msg
    return done.tokens


def prompts(k: int) -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [[int(t) for t in rng.integers(3, 250, size=int(rng.integers(5, 40)))] for _ in range(k)]


@pytest.mark.fp16
async def test_sixteen_concurrent_decodes_equal_solo_and_share_calls(tiny_folder):
    ps = prompts(16)
    async with tiny_engine(tiny_folder, page_size=4, num_pages=1024) as engine:
        solo = [await generate(engine, await new_ctx(engine), p, 16) for p in ps]
    async with tiny_engine(tiny_folder, page_size=4, num_pages=1024) as engine:
        ctxs = [await new_ctx(engine) for _ in ps]
        calls = engine.executor.num_model_calls
        together = await asyncio.gather(*(generate(engine, c, p, 16) for c, p in zip(ctxs, ps, strict=True)))
        calls = engine.executor.num_model_calls - calls
        assert together == solo
        # 16 tokens each: the prompts share the first call, then one call per decode step.
        assert calls <= 16 + 2, calls
        engine.store.check_invariants()


@pytest.mark.fp16
async def test_prefix_reuse_computes_only_the_suffix_with_equal_logits(tiny_folder):
    shared = prompts(1)[0] * 3  # 60-ish tokens
    shared = shared[: (len(shared) // 16) * 16]  # page aligned for page_size 16
    suffix = [7, 8, 9, 10, 11]
    async with tiny_engine(tiny_folder, page_size=16, num_pages=256) as engine:
        cold = await engine.handle(P.Forward(ctx=await new_ctx(engine), tokens=shared + suffix,
                                             reuse_prefix=True, logits=[len(shared) + 4]),
                                   raise_errors=True)
        a = await new_ctx(engine)
        await engine.handle(P.Forward(ctx=a, tokens=shared, reuse_prefix=True), raise_errors=True)
        await engine.handle(P.ReleaseContext(ctx=a), raise_errors=True)  # pages stay cached
        hit = await engine.handle(P.Forward(ctx=await new_ctx(engine), tokens=shared + suffix,
                                            reuse_prefix=True, logits=[len(shared) + 4]),
                                  raise_errors=True)
    assert cold.report.pages_reused == 0
    assert hit.report.pages_reused == len(shared) // 16
    assert hit.report.tokens_computed == len(suffix)
    want = np.frombuffer(cold.logits[0], "<f4")
    np.testing.assert_allclose(np.frombuffer(hit.logits[0], "<f4"), want,
                               atol=tiny_folder.tol(want))


@pytest.mark.fp16
async def test_oversubscribed_pool_gives_identical_outputs(tiny_folder):
    ps = prompts(12)

    async def run(num_pages):
        async with tiny_engine(tiny_folder, page_size=4, num_pages=num_pages) as engine:
            async def one(p):
                c = await new_ctx(engine)
                out = await generate(engine, c, p, 12)
                await engine.handle(P.ReleaseContext(ctx=c), raise_errors=True)
                return out
            outs = await asyncio.gather(*(one(p) for p in ps))
            engine.store.check_invariants()
            stats = engine.store.stats()
            assert stats.num_contexts == 0 and stats.num_pages_working == 0
            assert stats.num_pages_free + stats.num_pages_cached == num_pages
            return outs

    needed = sum(-(-(len(p) + 12) // 4) for p in ps)
    big = await run(4 * needed)
    small = await run(needed // 2)  # 2x oversubscribed; each request fits alone
    assert small == big


async def test_an_unstreamed_generation_is_one_chunk_with_everything(tiny_folder):
    """``Generate(stream=False)`` (what ``gen.text()`` asks for): the same tokens, text and
    log-probabilities as the streamed generation, in one chunk before the final message."""
    async with tiny_engine(tiny_folder) as engine:
        out = {}
        for stream in (True, False):
            ctx = await new_ctx(engine)
            req = P.Generate(ctx=ctx, tokens=prompts(1)[0], max_tokens=12,
                             stop_token_ids=[], top_logprobs=2, stream=stream)
            out[stream] = [m async for m in await engine.generate(req)]
        chunks = {s: [m for m in msgs if isinstance(m, P.GenerateChunk)]
                  for s, msgs in out.items()}
        assert len(chunks[True]) == 12 and len(chunks[False]) == 1
        (whole,) = chunks[False]
        assert whole.tokens == [t for c in chunks[True] for t in c.tokens]
        assert whole.text == "".join(c.text for c in chunks[True])
        # (the second run attaches the first's prompt pages: logits within rounding)
        np.testing.assert_allclose(whole.logprobs, [x for c in chunks[True] for x in c.logprobs],
                                   atol=tiny_folder.tol(20.0))
        assert len(whole.top_logprobs) == len(whole.entropy) == 12
        assert isinstance(out[False][-1], P.GenerateDone)
        assert out[False][-1].tokens == out[True][-1].tokens


async def _beside_a_long_prompt(folder, decode_share):
    """A generation decoding while a 200-token prompt is prefilled: its tokens, the
    prompt's last logits, and how many steps the decodes' share bounded."""
    rng = np.random.default_rng(3)
    long = [int(t) for t in rng.integers(3, 250, size=200)]
    async with tiny_engine(folder, page_size=4, num_pages=512, max_step_tokens=128,
                           decode_share=decode_share) as engine:
        gen_ctx, fwd_ctx = await new_ctx(engine), await new_ctx(engine)
        gen = asyncio.create_task(generate(engine, gen_ctx, [5, 6, 7], 40))
        while not engine.scheduler.active:  # the generation is running first
            await asyncio.sleep(0.001)
        fwd = await engine.handle(P.Forward(ctx=fwd_ctx, tokens=long, logits=[199]),
                                  raise_errors=True)
        tokens = await gen
        engine.store.check_invariants()
        return tokens, fwd.logits, engine.scheduler.share.num_bounded


async def test_a_long_prompt_beside_a_generation_is_bounded_and_changes_no_token(tiny_folder):
    tokens, logits, bounded = await _beside_a_long_prompt(tiny_folder, 0.5)
    free_tokens, free_logits, free_bounded = await _beside_a_long_prompt(tiny_folder, 0)
    assert bounded > 0 and free_bounded == 0
    assert tokens == free_tokens
    assert logits == free_logits  # the same bytes: rows do not depend on their batch


async def test_boot_refuses_a_bad_decode_share_before_loading(tiny_folder):
    from pie_ctx.proto.errors import InvalidArgument

    with pytest.raises(InvalidArgument, match="decode_share must be in"):
        async with tiny_engine(tiny_folder, decode_share=1.0):
            pass
