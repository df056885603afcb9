"""Attention scores out of a pass, and compaction, against the dense reference (fp32, 1e-5):
plain and masked passes, forks decoding together (the cascade), generations; the logits
after ``compact`` equal a dense pass that attends only to the kept keys at their
original positions."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from pie_ctx import Context, Sampler, ScoresSpec
from pie_ctx.errors import InvalidArgument
from runtime.model.reference import causal_mask, dense_forward
from tests.sdk.harness import sdk_runtime

pytestmark = [pytest.mark.fp32_only("scores and logits are held to 1e-5 in fp32"),
              pytest.mark.native_only("the dense reference is the native model's")]

TOL = 1e-5


def _dense_weights(engine, tokens, positions=None, mask=None) -> torch.Tensor:
    """Tensor[L, H, n, n] of the dense reference's softmax weights."""
    weights: list[torch.Tensor] = []
    dense_forward(engine.executor.runner.model, tokens, positions, mask, weights=weights)
    return torch.stack(weights)


def _expect(w: torch.Tensor, rows: list[int], layers=None, reduce="sum", heads="mean",
            by_layer=False) -> np.ndarray:
    """What a ScoresSpec asks, computed from the dense weights [L, H, n, n]."""
    sel = w[list(range(w.shape[0])) if layers is None else layers][:, :, rows]  # [l, H, r, n]
    if heads == "mean":
        sel = sel.mean(dim=1)  # [l, r, n]
    else:
        sel = sel.transpose(1, 2)  # [l, r, H, n]
    red = (lambda x, d: x.sum(d)) if reduce == "sum" else (lambda x, d: x.amax(d))
    sel = red(sel, 1)  # [l, (H,) n]
    return (sel if by_layer else red(sel, 0)).numpy()


async def test_forward_scores_equal_the_dense_softmax(tiny_folder, transport):
    async with sdk_runtime(tiny_folder, transport) as (rt, engine):
        prompt = list(range(5, 23))  # 18 tokens: committed pages and a working tail
        ctx = Context(rt).append(prompt)
        await ctx.flush()
        new = [30, 31, 32, 33]
        out = await (ctx.forward().input(new)
                     .attention_scores([1, 3])
                     .attention_scores([0, 2, 3], layers=[1], reduce="max", heads="all")
                     .attention_scores([3], by_layer=True)
                     .execute())
        w = _dense_weights(engine, prompt + new)
        n = len(prompt)
        want = [_expect(w, [n + 1, n + 3]),
                _expect(w, [n, n + 2, n + 3], layers=[1], reduce="max", heads="all"),
                _expect(w, [n + 3], by_layer=True)]
        for got, exp in zip(out.attention_scores, want, strict=True):
            assert got.shape == exp.shape
            np.testing.assert_allclose(got, exp, atol=TOL)
        # each layer's mean-head weights of one row sum to one
        np.testing.assert_allclose(out.attention_scores[2].sum(-1), 1.0, atol=TOL)


async def test_scores_of_a_masked_pass_at_chosen_positions(tiny_folder, transport):
    async with sdk_runtime(tiny_folder, transport) as (rt, engine):
        prompt = [5, 6, 7, 8, 9, 10, 11]
        ctx = Context(rt).append(prompt)
        await ctx.flush()
        rows = [[True, False, True, False, True, True, True, True, False],
                [True, True, False, False, False, False, True, False, True]]
        out = await (ctx.forward().input_at([40, 41], [3, 20]).attention_mask(rows)
                     .attention_scores([0, 1]).execute())
        mask = np.zeros((9, 9), dtype=bool)
        mask[:7, :7] = causal_mask(7)
        mask[7:] = rows
        w = _dense_weights(engine, prompt + [40, 41], list(range(7)) + [3, 20], mask)
        np.testing.assert_allclose(out.attention_scores[0], _expect(w, [7, 8]), atol=TOL)


async def test_generation_scores_over_forks_decoding_together(tiny_folder, transport):
    """Three forks of a committed prefix decode in one batch (the cascade path); each
    generation's scores are the sum over the rows that sampled its tokens."""
    async with sdk_runtime(tiny_folder, transport) as (rt, engine):
        base = Context(rt).append(list(range(3, 19)))  # 16 tokens: 4 committed pages
        await base.flush()
        forks = [base.fork().append([50 + i]) for i in range(3)]
        gens = [f.generate(Sampler.greedy(), max_tokens=5, ignore_eos=True,
                           attention_scores=True) for f in forks]
        await asyncio.gather(*(g.text() for g in gens))
        for i, g in enumerate(gens):
            seq = list(range(3, 19)) + [50 + i] + g.tokens_out[:-1]
            w = _dense_weights(engine, seq)
            p = 17  # the prompt's last row samples the first token, then each decode row
            rows = list(range(p - 1, p - 1 + len(g.tokens_out)))
            assert g.attention_scores.shape == (len(seq),)
            # a sum over the rows and every layer's weights: 1e-5 for each weight summed,
            # as below (with --deterministic off the forks go through the cascade, whose
            # merge rounds otherwise than the dense softmax: 1.5e-5 off in such a sum)
            np.testing.assert_allclose(g.attention_scores, _expect(w, rows),
                                       atol=TOL * len(rows) * w.shape[0])


async def test_scores_spec_errors_are_typed(tiny_folder):
    async with sdk_runtime(tiny_folder) as (rt, _):
        ctx = Context(rt).append([5, 6, 7])
        with pytest.raises(InvalidArgument, match="reduce"):
            ctx.forward().input([8]).attention_scores([0], reduce="mean")
        with pytest.raises(InvalidArgument, match="layer"):
            ctx.forward().input([8]).attention_scores([0], layers=[99])
        with pytest.raises(InvalidArgument, match="query"):
            await ctx.forward().input([8]).attention_scores([3]).execute()
        with pytest.raises(InvalidArgument, match="no queries"):
            ctx.generate(attention_scores=ScoresSpec(queries=[0]))
        assert await ctx.tokens() == [5, 6, 7]


# ---------------------------------------------------------------------------- compact


def _kept_mask(n: int, keep: list[int], extra: int) -> np.ndarray:
    """Dense mask: the original tokens causal (their K/V saw everything before them), the
    ``extra`` new rows attend only the kept keys, and causally each other."""
    mask = np.zeros((n + extra, n + extra), dtype=bool)
    mask[:n, :n] = causal_mask(n)
    for r in range(extra):
        mask[n + r, keep] = True
        mask[n + r, n:n + r + 1] = True
    return mask


@pytest.mark.parametrize("keep", [
    [0, 1, 2, 3, 4, 5, 6, 7, 12, 19, 20, 21],  # two leading pages shared, then scattered
    [0, 3, 9, 10, 11, 15, 16, 17, 18, 19, 20, 21],  # nothing shared
    list(range(0, 22, 2)) + [21],  # every other token
])
async def test_logits_after_compact_equal_a_dense_pass_over_the_kept_keys(tiny_folder,
                                                                          transport, keep):
    async with sdk_runtime(tiny_folder, transport) as (rt, engine):
        prompt = list(range(7, 29))  # 22 tokens, page size 4
        ctx = Context(rt).append(prompt)
        await ctx.flush()
        state = await ctx.compact(keep)
        assert state.seq_len == len(keep) and state.next_position == 22
        assert await ctx.tokens() == [prompt[i] for i in keep]
        assert await ctx.positions() == keep
        out = await ctx.forward().input([60, 61]).logits([0, 1]).execute()
        assert (await ctx.positions())[-2:] == [22, 23]  # after the last position
        n = len(prompt)
        logits = dense_forward(engine.executor.runner.model, prompt + [60, 61],
                               list(range(n)) + [22, 23], _kept_mask(n, keep, 2))
        for got, want in zip(out.logits, logits[n:], strict=True):
            # 1e-5 of the logits' scale (~15 here): fp32 rounding of another summation order
            want = want.numpy()
            np.testing.assert_allclose(got, want, atol=TOL * np.abs(want).max())
        engine.store.check_invariants()


async def test_compact_keeps_shared_pages_and_forks_and_snapshots_work(tiny_folder):
    async with sdk_runtime(tiny_folder) as (rt, engine):
        prompt = list(range(7, 29))
        ctx = Context(rt).append(prompt)
        await ctx.flush()
        keep = list(range(8)) + [15, 20, 21]
        fork = ctx.fork()
        await fork.compact([(0, 8), 15, range(20, 22)])  # ranges and indices mixed
        assert await fork.positions() == keep
        assert fork.num_committed_pages == 2  # the two wholly kept pages, shared
        # generate with nothing pending recomputes the last token's logits over kept keys
        a = await fork.fork().generate(Sampler.greedy(), max_tokens=3, ignore_eos=True).tokens()
        fork.save("compacted")
        await fork.tokens()
        opened = await Context.open(rt, "compacted")
        assert await opened.positions() == keep
        b = await opened.generate(Sampler.greedy(), max_tokens=3, ignore_eos=True).tokens()
        assert a == b
        assert await ctx.tokens() == prompt  # the original is untouched
        engine.store.check_invariants()


async def test_bad_keep_is_a_typed_error_that_changes_nothing(tiny_folder, transport):
    async with sdk_runtime(tiny_folder, transport) as (rt, _):
        ctx = Context(rt).append([5, 6, 7, 8, 9])
        await ctx.flush()
        for keep in ([], [2, 1], [0, 0], [0, 5], "ab"):
            with pytest.raises(InvalidArgument):
                await ctx.compact(keep)
        for keep in ([], [3, 1], [0, 9]):
            with pytest.raises(InvalidArgument):
                await ctx.inner().compact(keep)
        assert await ctx.tokens() == [5, 6, 7, 8, 9]
        assert await ctx.positions() == [0, 1, 2, 3, 4]


async def test_scores_of_a_prompt_split_into_chunks_and_int8_pages(tiny_folder):
    """A pass longer than a step is computed in chunks, each seeing a longer context; the
    chunks' scores are padded and summed. On int8 pages the keys are read back as the
    pass reads them (the dense oracle quantizes them the same way)."""
    for kv_dtype in ("fp32", "int8"):
        async with sdk_runtime(tiny_folder, max_step_tokens=8, kv_dtype=kv_dtype) as (rt, engine):
            tokens = list(range(5, 27))
            out = await (Context(rt).forward().input(tokens)
                         .attention_scores([3, 10, 17, 21]).execute())
            weights: list[torch.Tensor] = []
            dense_forward(engine.executor.runner.model, tokens, weights=weights,
                          kv_dtype=kv_dtype)
            want = _expect(torch.stack(weights), [3, 10, 17, 21])
            # a sum of 4 rows x every layer's weights: 1e-5 for each weight summed
            np.testing.assert_allclose(out.attention_scores[0], want,
                                       atol=TOL * 4 * len(weights), err_msg=kv_dtype)
