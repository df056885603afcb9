"""Probes (top logprobs, entropy, hidden states), select, and auto-cue, over both transports."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pie_ctx import Context, Sampler
from pie_ctx.errors import InvalidArgument
from runtime.model.reference import dense_forward
from tests.sdk.harness import sdk_runtime

GREEDY = Sampler.greedy()


def _reference(row: np.ndarray, k: int) -> tuple[list[tuple[int, float]], float]:
    lp = torch.log_softmax(torch.tensor(row).double(), dim=-1)
    values, ids = torch.topk(lp, k)
    entropy = float(-(lp.exp() * lp).sum())
    return list(zip(ids.tolist(), values.tolist(), strict=True)), entropy


@pytest.mark.native_only("compares hidden states with the native runner's dense reference")
async def test_forward_probes_equal_a_full_softmax(tiny_folder, transport):
    async with sdk_runtime(tiny_folder, transport) as (rt, engine):
        ctx = Context(rt).append([5, 6, 7, 8])
        out = await (ctx.forward().input([9, 10, 11]).logits([0, 2]).entropy([0, 2])
                     .top_logprobs([2], 5).top_logprobs([0], 2).hidden_states([1, 2]).execute())
        for row, ent in zip(out.logits, out.entropies, strict=True):
            assert ent == pytest.approx(_reference(row, 1)[1], abs=1e-4)
        for got, (row, k) in zip(out.top_logprobs, [(out.logits[1], 5), (out.logits[0], 2)],
                                 strict=True):
            want = _reference(row, k)[0]
            assert [t for t, _ in got] == [t for t, _ in want]
            assert [lp for _, lp in got] == pytest.approx([lp for _, lp in want], abs=1e-4)
        # hidden states: the final-norm output of the model, computed densely
        model = engine.executor.runner.model
        _, hidden = dense_forward(model, [5, 6, 7, 8, 9, 10, 11], return_hidden=True)
        for got, want in zip(out.hidden_states, hidden[5:7], strict=True):
            assert got.shape == (rt.info.hidden_size,)
            want = want.float().numpy()
            np.testing.assert_allclose(got, want, atol=max(1e-4, tiny_folder.tol(want)))


async def test_generate_top_logprobs_and_entropy_per_token(tiny_folder, transport):
    async with sdk_runtime(tiny_folder, transport) as (rt, _):
        gen = Context(rt).append([5, 6, 7]).generate(GREEDY, max_tokens=6, ignore_eos=True,
                                                     top_logprobs=3)
        deltas = [d async for d in gen]
        assert [len(d.top_logprobs) for d in deltas] == [1] * 6 == [len(d.entropy) for d in deltas]
        # Each step's probes are those of a full softmax over the logits a pass over the
        # same tokens gives.
        tokens = gen.tokens_out
        out = await Context(rt).append([5, 6]).forward().input([7] + tokens[:-1]).logits(
            list(range(6))).execute()
        for d, row in zip(deltas, out.logits, strict=True):
            (*_, (_, kth)), ent = _reference(row, 3)
            lp = torch.log_softmax(torch.tensor(row).double(), dim=-1)
            # The two computations may differ by the dtype's rounding (a bf16 near-tie can
            # swap places), never by more.
            tol = max(1e-4, 2 * tiny_folder.tol(row))
            got = d.top_logprobs[0]
            for t, v in got:
                assert v == pytest.approx(float(lp[t]), abs=tol)
            assert min(v for _, v in got) >= kth - tol  # nothing clearly likelier is missing
            assert [v for _, v in got] == sorted((v for _, v in got), reverse=True)
            assert got[0][0] == d.tokens[0]  # greedy: the top token, ties to the lower id
            assert d.entropy[0] == pytest.approx(ent, abs=max(1e-3, tol))
        assert len(gen.top_logprobs) == len(gen.entropies) == 6


_SCALE = [1.0]  # the largest |logit| _by_hand has seen (the scale of its dtype tolerance)


async def _by_hand(rt, prefix: list[int], option: list[int], conditional: bool) -> list[float]:
    """An option's token log-probabilities from one explicit forward pass over the whole
    sequence (the context's tokens and the option, or the option alone)."""
    full = prefix + option if conditional else option
    start = len(prefix) if conditional else 0
    out = await Context(rt).forward().input(full).logits(list(range(len(full)))).execute()
    values = []
    for j in range(len(option)):
        pos = start + j  # option token j sits at index pos of `full`
        if pos == 0:
            values.append(0.0)  # no context at all: the first token counts as 0
            continue
        row = torch.tensor(out.logits[pos - 1]).double()
        _SCALE[0] = max(_SCALE[0], float(row.abs().max()))
        values.append(float(torch.log_softmax(row, -1)[full[pos]]))
    return values


@pytest.mark.parametrize("method", ["token_length_normalized", "greedy_token",
                                    "unconditional_likelihood_normalized"])
async def test_select_scores_equal_those_computed_by_hand(tiny_folder, transport, method):
    async with sdk_runtime(tiny_folder, transport) as (rt, engine):
        prefix = [5, 6, 7, 8, 9, 10]
        options = [[40, 41], [40, 42, 43], [50], [40, 41, 44, 45, 46]]  # shared prefixes
        ctx = Context(rt).append(prefix)
        await ctx.flush()
        before = (ctx.seq_len, ctx.num_working_pages, engine.stats().num_pages_used)
        computed = engine.stats().tokens_computed
        best, scores = await ctx.select(options, method=method)
        # One pass; the shared prefix [40] was computed once (and [40, 41] once).
        tree_tokens = 8 * (2 if method.startswith("unconditional") else 1)
        assert engine.stats().tokens_computed - computed == tree_tokens
        assert (ctx.seq_len, ctx.num_working_pages, engine.stats().num_pages_used) == before
        cond = [await _by_hand(rt, prefix, o, True) for o in options]
        if method == "token_length_normalized":
            want = [sum(c) / len(c) for c in cond]
        elif method == "greedy_token":
            want = [c[0] for c in cond]
        else:
            unc = [await _by_hand(rt, prefix, o, False) for o in options]
            want = [sum(a - b for a, b in zip(c, u, strict=True)) / len(c)
                    for c, u in zip(cond, unc, strict=True)]
        # a log-probability moves by at most its logit's and its normaliser's moves
        assert scores == pytest.approx(want, abs=max(1e-3, 2 * tiny_folder.tol(_SCALE[0])))
        if method != "greedy_token":
            assert best == int(np.argmax(want))
        engine.store.check_invariants()


async def test_greedy_token_breaks_ties_with_later_tokens(tiny_folder, transport):
    async with sdk_runtime(tiny_folder, transport) as (rt, _):
        ctx = Context(rt).append([5, 6, 7])
        # Two options with the same first token: the second token decides.
        a, b = [40, 41], [40, 42]
        _, scores = await ctx.select([a, b], method="greedy_token")
        assert scores[0] == scores[1]
        best, _ = await ctx.select([a, b], method="greedy_token")
        _, by_mean = await ctx.select([a, b], method="token_length_normalized")
        assert best == int(np.argmax(by_mean))  # same first token: the second decides


async def test_select_then_assistant_is_the_idiom(tiny_folder, transport):
    async with sdk_runtime(tiny_folder, transport) as (rt, _):
        options = [" Paris", " Lyon", " Nice"]
        ctx = Context(rt).user("Capital of France?").cue()
        best, scores = await ctx.select(options)
        assert len(scores) == 3 and 0 <= best < 3 and all(math.isfinite(s) for s in scores)
        ctx.assistant(options[best].strip())
        await ctx.flush()
        for bad in ([], [""], [[]], "Paris", [[10**9]]):
            with pytest.raises(InvalidArgument):
                await ctx.select(bad)
        with pytest.raises(InvalidArgument):
            await ctx.select(options, method="best")


async def test_generate_cues_the_assistant_turn_itself(tiny_folder, transport):
    async with sdk_runtime(tiny_folder, transport) as (rt, _):
        cued = Context(rt).user("Write one sentence about the sea.").cue()
        auto = Context(rt).user("Write one sentence about the sea.")
        want = await cued.generate(GREEDY, max_tokens=8, ignore_eos=True).tokens()
        assert await auto.generate(GREEDY, max_tokens=8, ignore_eos=True).tokens() == want
        assert auto.seq_len == cued.seq_len
        raw = Context(rt).append("raw text, no template")  # raw tokens never trigger it
        before = raw.pending_tokens
        await raw.generate(GREEDY, max_tokens=2, ignore_eos=True).tokens()
        assert raw.seq_len == len(before) + 1
        opt_out = Context(rt).user("no cue please")
        n = len(opt_out.pending_tokens)
        await opt_out.generate(GREEDY, max_tokens=2, cue=False, ignore_eos=True).tokens()
        assert opt_out.seq_len == n + 1
        after_answer = Context(rt).user("hi").assistant("hello")  # nothing awaits an answer
        n = len(after_answer.pending_tokens)
        await after_answer.generate(GREEDY, max_tokens=2, ignore_eos=True).tokens()
        assert after_answer.seq_len == n + 1
