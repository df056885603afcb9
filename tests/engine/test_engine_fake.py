"""Engine behaviour over the fake runner: batching, reuse, pressure, cancellation."""

from __future__ import annotations

import asyncio

import pytest

from pie_ctx.errors import InvalidArgument
from pie_ctx.proto import messages as P
from tests.engine.fake import make_engine


async def create(engine) -> int:
    return (await engine.handle(P.CreateContext(), raise_errors=True)).ctx


async def gen(engine, ctx, tokens, max_tokens=8, **kw):
    chunks, done = [], None
    async for msg in await engine.generate(P.Generate(ctx=ctx, tokens=tokens, max_tokens=max_tokens, **kw)):
        if isinstance(msg, P.GenerateChunk):
            chunks.append(msg)
        else:
            done = msg
    return chunks, done


async def test_flush_then_generate_uses_cached_last_logits():
    async with make_engine() as engine:
        a = await create(engine)
        r = await engine.handle(P.Forward(ctx=a, tokens=list(range(1, 11))), raise_errors=True)
        assert r.state.seq_len == 10 and r.report.tokens_computed == 10
        _, done = await gen(engine, a, [], max_tokens=5, stop_token_ids=[])
        # Same as generating with the prompt in one go.
        b = await create(engine)
        _, done2 = await gen(engine, b, list(range(1, 11)), max_tokens=5, stop_token_ids=[])
        assert done.tokens == done2.tokens
        assert done.state.seq_len == 10 + 4  # last sampled token is pending
        assert done.pending == done.tokens[-1:]
        engine.store.check_invariants()


async def test_concurrent_generations_match_solo_and_share_model_calls():
    prompts = [[(i * 7 + k) % 50 + 1 for k in range(5 + i)] for i in range(16)]
    async with make_engine(num_pages=256) as engine:
        solo = []
        for p in prompts:
            c = await create(engine)
            _, d = await gen(engine, c, p, max_tokens=12, stop_token_ids=[])
            solo.append(d.tokens)
    async with make_engine(num_pages=256) as engine:
        ctxs = [await create(engine) for _ in prompts]
        calls_before = engine.executor.num_model_calls
        results = await asyncio.gather(*(gen(engine, c, p, max_tokens=12, stop_token_ids=[])
                                         for c, p in zip(ctxs, prompts, strict=True)))
        assert [d.tokens for _, d in results] == solo
        calls = engine.executor.num_model_calls - calls_before
        assert calls <= 14, calls  # ~one call per step, not per context
        engine.store.check_invariants()


async def test_prefix_reuse_skips_compute():
    prompt = list(range(1, 18))  # 17 tokens, page_size 4 -> 4 full pages before the last token
    async with make_engine() as engine:
        a = await create(engine)
        r1 = await engine.handle(P.Forward(ctx=a, tokens=prompt, reuse_prefix=True, logits=[16]),
                                 raise_errors=True)
        await engine.handle(P.ReleaseContext(ctx=a), raise_errors=True)
        b = await create(engine)
        r2 = await engine.handle(P.Forward(ctx=b, tokens=prompt, reuse_prefix=True, logits=[16]),
                                 raise_errors=True)
        assert r1.report.pages_reused == 0 and r1.report.tokens_computed == 17
        assert r2.report.pages_reused == 4 and r2.report.tokens_computed == 1
        assert r2.logits == r1.logits
        engine.store.check_invariants()


@pytest.mark.parametrize("max_step_tokens", [64, 6])
async def test_a_burst_of_one_new_prompt_computes_it_once(max_step_tokens):
    """Requests that arrive together with the same uncached prompt wait for the one
    computing it and attach its pages (in one step or over several chunks)."""
    prompt = list(range(1, 18))  # 4 full pages of 4, then the last token
    other = list(range(30, 47))
    async with make_engine(max_step_tokens=max_step_tokens) as engine:
        ctxs = [await create(engine) for _ in range(6)]
        replies = await asyncio.gather(*(
            engine.handle(P.Forward(ctx=c, tokens=other if i == 5 else prompt,
                                    reuse_prefix=True, logits=[16]), raise_errors=True)
            for i, c in enumerate(ctxs)))
        same = replies[:5]
        assert sum(r.report.tokens_computed for r in same) == 17 + 4  # once, then 1 each
        assert sorted(r.report.pages_reused for r in same) == [0, 4, 4, 4, 4]
        assert all(r.logits == same[0].logits for r in same)
        assert replies[5].report.tokens_computed == 17  # an unrelated prompt never waits
        engine.store.check_invariants()


async def test_oversubscribed_completes_identically():
    prompts = [[(i * 5 + k) % 40 + 1 for k in range(9)] for i in range(12)]

    async def run(num_pages):
        async with make_engine(num_pages=num_pages, page_size=4) as engine:
            async def one(p):
                c = await create(engine)
                _, d = await gen(engine, c, p, max_tokens=12, stop_token_ids=[])
                await engine.handle(P.ReleaseContext(ctx=c), raise_errors=True)
                return d.tokens
            out = await asyncio.gather(*(one(p) for p in prompts))
            engine.store.check_invariants()
            assert engine.store.stats().num_pages_working == 0
            return out, engine.scheduler.num_preemptions

    big, _ = await run(256)
    small, preemptions = await run(30)  # each needs ~6 pages, 12 of them need ~72
    assert small == big


async def test_stop_string_and_stop_token():
    async with make_engine() as engine:
        a = await create(engine)
        chunks, done = await gen(engine, a, [1, 2, 3], max_tokens=30, stop_token_ids=[])
        text = "".join(c.text for c in chunks)
        stop = text[3:5]
        b = await create(engine)
        chunks, done = await gen(engine, b, [1, 2, 3], max_tokens=30, stop_token_ids=[],
                                 stop_strings=[stop])
        streamed = "".join(c.text for c in chunks)
        assert done.finish_reason == "stop_string"
        assert streamed == text[: text.index(stop)]


async def test_errors_change_nothing():
    async with make_engine() as engine:
        a = await create(engine)
        await engine.handle(P.Forward(ctx=a, tokens=[1, 2, 3]), raise_errors=True)
        before = engine.store.state(engine.records.get(a, None).cid)
        for bad in (P.Forward(ctx=a, tokens=[999]), P.Forward(ctx=a, tokens=[]),
                    P.Forward(ctx=a, tokens=[1], logits=[3]),
                    P.Forward(ctx=a, tokens=[1, 2], mask=[[True]]),
                    P.TruncateTokens(ctx=a, num_tokens=99), P.CommitPages(ctx=a, num_pages=1),
                    P.Forward(ctx=12345, tokens=[1])):
            reply = await engine.handle(bad)
            assert isinstance(reply, P.ErrorReply), bad
        assert engine.store.state(engine.records.get(a, None).cid) == before
        engine.store.check_invariants()


async def test_cancelled_generation_leaves_context_unchanged():
    async with make_engine() as engine:
        a = await create(engine)
        await engine.handle(P.Forward(ctx=a, tokens=[1, 2, 3]), raise_errors=True)
        before = engine.store.state(engine.records.get(a, None).cid)
        free_before = engine.store.stats().num_pages_free

        first = asyncio.Event()

        async def consume():
            async for msg in await engine.generate(P.Generate(ctx=a, tokens=[4], max_tokens=200,
                                                        stop_token_ids=[])):
                assert isinstance(msg, P.GenerateChunk), msg
                first.set()
                await asyncio.sleep(10)

        task = asyncio.create_task(consume())
        await first.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.05)
        assert engine.store.state(engine.records.get(a, None).cid) == before
        engine.store.check_invariants()
        stats = engine.store.stats()
        # The shadow's committed pages stay cached (findable), everything else came back.
        assert stats.num_pages_free + stats.num_pages_cached == free_before
        assert stats.num_pages_working == 1 and stats.num_contexts == 1


async def test_custom_mask_pages_do_not_dedup_with_causal():
    async with make_engine() as engine:
        a = await create(engine)
        b = await create(engine)
        toks = [1, 2, 3, 4, 5]
        causal = [[j <= i for j in range(5)] for i in range(5)]
        ra = await engine.handle(P.Forward(ctx=a, tokens=toks, logits=[4]), raise_errors=True)
        rb = await engine.handle(P.Forward(ctx=b, tokens=toks, mask=causal, logits=[4]),
                                 raise_errors=True)
        assert ra.logits == rb.logits  # same attention pattern, same numbers
        ta = engine.store.page_table(engine.records.get(a, None).cid)
        tb = engine.store.page_table(engine.records.get(b, None).cid)
        assert ta[0] != tb[0]  # ...but different page hashes: never shared
        engine.store.check_invariants()


async def test_never_fits_fails_at_once():
    async with make_engine(num_pages=4, page_size=4) as engine:
        a = await create(engine)
        reply = await engine.handle(P.Forward(ctx=a, tokens=list(range(1, 30))))
        assert isinstance(reply, P.ErrorReply) and reply.kind == "OutOfPages"
        msgs = [m async for m in await engine.generate(P.Generate(ctx=a, tokens=[1], max_tokens=100))]
        assert isinstance(msgs[-1], P.ErrorReply) and msgs[-1].kind == "OutOfPages"


async def test_out_of_range_seed_fails_the_request_not_the_step():
    async with make_engine() as engine:
        a = await create(engine)
        with pytest.raises(InvalidArgument):  # a sampler validates itself on construction
            P.SamplerSpec(temperature=1.0, seed=2**63)
        bad = "temperature=1"  # what a client that skipped the SDK might send in-process
        msgs = [m async for m in await engine.generate(P.Generate(ctx=a, tokens=[1], sampler=bad))]
        assert isinstance(msgs[-1], P.ErrorReply) and msgs[-1].kind == "InvalidArgument"
        reply = await engine.handle(P.Forward(ctx=a, tokens=[1, 2], sample=[
            P.SampleSpec(index=1, sampler=bad)]))
        assert isinstance(reply, P.ErrorReply) and reply.kind == "InvalidArgument"
        _, done = await gen(engine, a, [1, 2], max_tokens=3, stop_token_ids=[])
        assert len(done.tokens) == 3
