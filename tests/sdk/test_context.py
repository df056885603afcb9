"""The Context API end to end, over both transports, on the tiny random model."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pie_ctx import Context, Sampler, gather
from pie_ctx.errors import (
    ContextClosed,
    InvalidArgument,
    OutOfPages,
    SnapshotExists,
    SnapshotNotFound,
)
from tests.sdk.harness import sdk_runtime

GREEDY = Sampler.greedy()


def chat(rt, *turns):
    ctx = Context(rt)
    for role, text in turns:
        getattr(ctx, role)(text)
    return ctx


async def test_fillers_render_like_the_chat_template(tiny_folder, transport):
    async with sdk_runtime(tiny_folder, transport) as (rt, _):
        ctx = Context(rt).system("be brief").user("hello there").assistant("hi").user("bye").cue()
        messages = [{"role": "system", "content": "be brief"},
                    {"role": "user", "content": "hello there"},
                    {"role": "assistant", "content": "hi"}, {"role": "user", "content": "bye"}]
        assert ctx.pending_tokens == rt.tokenizer.encode_chat(messages, add_generation_prompt=True)
        report = await ctx.flush()
        ps = rt.page_size
        assert report.tokens_written == ctx.seq_len == len(rt.tokenizer.encode_chat(messages, True))
        assert ctx.seq_len == ctx.num_committed_pages * ps + ctx.num_working_tokens
        assert ctx.pending_tokens == [] and ctx.num_working_tokens < ps


async def test_generate_streams_collects_and_stops(tiny_folder, transport):
    async with sdk_runtime(tiny_folder, transport) as (rt, _):
        a = chat(rt, ("user", "count"))
        a.cue()
        gen = a.generate(GREEDY, max_tokens=12, ignore_eos=True)
        deltas = [d async for d in gen]
        text = "".join(d.text for d in deltas)
        assert gen.finish_reason == "length" and len(gen.tokens_out) == 12
        assert text == gen.text_out == rt.tokenizer.decode(gen.tokens_out, skip_special_tokens=True)
        assert len(gen.logprobs) == 12 and all(lp <= 0 for lp in gen.logprobs)
        # The last sampled token is pending; the rest is in the KV cache.
        assert a.pending_tokens == gen.tokens_out[-1:]
        # A stop string spanning several tokens: excluded, nothing after it leaks.
        stop = text[3:7]
        b = chat(rt, ("user", "count"))
        b.cue()
        gen_b = b.generate(GREEDY, max_tokens=12, stop=[stop], ignore_eos=True)
        streamed = "".join([d.text async for d in gen_b])
        assert gen_b.finish_reason == "stop_string"
        assert streamed == text[: text.index(stop)]
        # A stop token id.
        c = chat(rt, ("user", "count"))
        c.cue()
        toks = await c.generate(GREEDY, max_tokens=12, stop=[gen.tokens_out[5]],
                                ignore_eos=True).tokens()
        assert toks == gen.tokens_out[:6]


@pytest.mark.fp16
async def test_fork_shares_and_matches(tiny_folder, transport):
    async with sdk_runtime(tiny_folder, transport) as (rt, engine):
        base = chat(rt, ("system", "s" * 40), ("user", "q"))
        base.cue()
        await base.flush()
        forks = [base.fork() for _ in range(4)]
        outs = await gather(*(f.generate(GREEDY, max_tokens=6).tokens() for f in forks))
        assert all(o == outs[0] for o in outs)
        solo = chat(rt, ("system", "s" * 40), ("user", "q"))
        solo.cue()
        assert await solo.generate(GREEDY, max_tokens=6).tokens() == outs[0]
        assert forks[0].num_committed_pages >= base.num_committed_pages
        seeded = [await base.fork().generate(Sampler.top_k(1.0, 20, seed=7), max_tokens=6).tokens()
                  for _ in range(2)]
        assert seeded[0] == seeded[1]


async def test_truncate_pending_then_kv_and_errors(tiny_folder, transport):
    async with sdk_runtime(tiny_folder, transport) as (rt, _):
        ctx = Context(rt).append(list(range(10, 19)))  # 9 tokens, page_size 4
        await ctx.flush()
        assert (ctx.seq_len, ctx.num_committed_pages, ctx.num_working_tokens) == (9, 2, 1)
        ctx.append([20, 21])
        await ctx.truncate(3)  # 2 pending + 1 working
        assert ctx.pending_tokens == [] and ctx.seq_len == 8 and ctx.num_working_tokens == 0
        with pytest.raises(InvalidArgument):
            await ctx.truncate(1)  # would reach a committed page
        assert ctx.seq_len == 8
        with pytest.raises(InvalidArgument):
            await ctx.truncate(-1)


@pytest.mark.fp16
async def test_snapshots_lifecycle(tiny_folder, transport):
    async with sdk_runtime(tiny_folder, transport) as (rt, _):
        base = chat(rt, ("system", "you know the handbook"))
        await base.save("hb")
        assert base.pending_tokens == [] and "hb" in await rt.snapshots()
        with pytest.raises(SnapshotExists):
            await base.save("hb")
        opened = await Context.open(rt, "hb")
        assert opened.seq_len == base.seq_len
        opened.user("when is breakfast?").cue()  # the conversation continues
        full = rt.tokenizer.encode_chat(
            [{"role": "system", "content": "you know the handbook"},
             {"role": "user", "content": "when is breakfast?"}], add_generation_prompt=True)
        assert opened.pending_tokens == full[base.seq_len:]
        taken = await Context.take(rt, "hb")
        assert taken.seq_len == base.seq_len and "hb" not in await rt.snapshots()
        for bad in (Context.open(rt, "hb"), Context.take(rt, "hb"), Context.delete(rt, "hb")):
            with pytest.raises(SnapshotNotFound):
                await bad
        await taken.save("hb2")
        await Context.delete(rt, "hb2")
        assert await rt.snapshots() == []


async def test_release_and_closed_errors(tiny_folder, transport):
    async with sdk_runtime(tiny_folder, transport) as (rt, engine):
        async with Context(rt).append([1, 2, 3]) as ctx:
            await ctx.flush()
        assert ctx.is_released
        for call in (lambda: ctx.user("x"), lambda: ctx.fork(), lambda: ctx.forward(),
                     lambda: ctx.generate(GREEDY), lambda: ctx.inner(), lambda: ctx.save("n")):
            with pytest.raises(ContextClosed):
                call()
        with pytest.raises(ContextClosed):
            await ctx.flush()
        await ctx.release()  # idempotent
        assert (await rt.stats()).num_contexts == 0


async def test_raw_handle_exact_semantics(tiny_folder, transport):
    async with sdk_runtime(tiny_folder, transport) as (rt, _):
        ctx = Context(rt)
        raw = ctx.inner()
        assert await raw.reserve_working_pages(3)
        assert (raw.num_working_pages, raw.num_working_tokens, raw.seq_len) == (3, 0, 0)
        await ctx.forward().input([5, 6, 7, 8, 9, 10]).defer_commit().execute()
        assert (raw.num_committed_pages, raw.num_working_pages, raw.num_working_tokens) == (0, 3, 6)
        with pytest.raises(InvalidArgument):
            await raw.commit_working_pages(2)  # the second page holds 2 of 4 tokens
        assert raw.num_working_pages == 3 and raw.num_committed_pages == 0
        await raw.commit_working_pages(1)
        assert (raw.num_committed_pages, raw.num_working_pages, raw.seq_len) == (1, 2, 6)
        with pytest.raises(InvalidArgument):
            await raw.truncate_working_page_tokens(3)  # only 2 working tokens
        await raw.truncate_working_page_tokens(1)
        assert raw.seq_len == 5 and raw.num_working_pages == 2
        await raw.release_working_pages(1)
        assert raw.num_working_pages == 1 and raw.seq_len == 5
        with pytest.raises(OutOfPages):
            await raw.reserve_working_pages(100_000)  # more than the pool holds: never fits
        stats = await rt.stats()
        spare = stats.num_pages_free + stats.num_pages_cached
        other = Context(rt).inner()
        assert not await other.reserve_working_pages(spare + 1)  # back-pressure: False
        assert other.num_working_pages == 0 and raw.num_working_pages == 1


@pytest.mark.fp16
async def test_forward_outputs(tiny_folder, transport):
    async with sdk_runtime(tiny_folder, transport) as (rt, _):
        ctx = Context(rt).append([3, 4, 5])
        out = await (ctx.forward().input([6, 7, 8])
                     .sample([0, 2], GREEDY).logits([2]).distribution(2, 5)
                     .logprobs(2, [1, 2, 3]).execute())
        row = out.logits[0]
        assert row.shape == (rt.info.vocab_size,) and out.tokens[1] == int(np.argmax(row))
        ids, probs = out.distributions[0]
        assert ids[0] == out.tokens[1] and probs == sorted(probs, reverse=True)
        shifted = row - row.max()
        lse = math.log(np.exp(shifted.astype(np.float64)).sum()) + row.max()
        assert out.logprobs[0] == pytest.approx([row[t] - lse for t in (1, 2, 3)], abs=1e-4)
        assert ctx.seq_len == 6
        # Explicit positions + an explicit causal mask equal the default pass.
        other = Context(rt).append([3, 4, 5])
        causal = [[j <= 3 + i for j in range(6)] for i in range(3)]
        out2 = await (other.forward().input_at([6, 7, 8], [3, 4, 5]).attention_mask(causal)
                      .logits([2]).execute())
        np.testing.assert_allclose(out2.logits[0], row, atol=tiny_folder.tol(row))
        for bad in (lambda: ctx.forward().execute(),
                    lambda: ctx.forward().input([1]).logits([1]).execute(),
                    lambda: ctx.forward().input([1, 2]).attention_mask([[True]]).execute(),
                    lambda: ctx.forward().input([10**9]).execute()):
            with pytest.raises(InvalidArgument):
                await bad()
        assert ctx.seq_len == 6


async def test_bad_arguments_raise_typed_errors(tiny_folder, transport):
    async with sdk_runtime(tiny_folder, transport) as (rt, _):
        ctx = Context(rt)
        for call in (lambda: ctx.user(3), lambda: ctx.append([-1]),
                     lambda: ctx.generate(GREEDY, max_tokens=0), lambda: Sampler.top_p(1.0, 2.0),
                     lambda: Sampler.temperature(-1), lambda: Sampler.top_k(1.0, 0),
                     lambda: ctx.generate(GREEDY, stop=[""]), lambda: ctx.save("")):
            with pytest.raises(InvalidArgument):
                call()
        with pytest.raises(InvalidArgument):
            await ctx.generate(GREEDY).text()  # nothing to continue from
        assert ctx.seq_len == 0
