"""Speculative decoding: lossless for greedy and for sampling, no trace of rejected tokens,
forks speculating together share passes, over both transports."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from pie_ctx import Context, Sampler, gather
from pie_ctx.speculate import PromptLookup
from runtime.sampling import filtered_probs
from tests.sdk.harness import sdk_runtime

GREEDY = Sampler.greedy()
TEXT = [5 + (i * 7) % 60 for i in range(40)]  # a prompt the model partly copies


class BadDrafter:
    """Proposes the next few tokens at random from a small set: mostly rejected."""

    def __init__(self, seed: int, pool: list[int], k: int = 3) -> None:
        self.rng = random.Random(seed)
        self.pool, self.k = pool, k
        self.accepted: list[int] = []
        self.rolled_back = 0

    def draft(self) -> list[int]:
        return [self.rng.choice(self.pool) for _ in range(self.k)]

    def accept(self, tokens) -> None:
        self.accepted.extend(tokens)

    def rollback(self, n: int) -> None:
        self.rolled_back += n


async def test_greedy_speculation_is_exactly_greedy(tiny_folder, transport):
    async with sdk_runtime(tiny_folder, transport) as (rt, engine):
        for prompt in (TEXT, TEXT[:10] * 4):
            spec = Context(rt).append(prompt)
            plain = Context(rt).append(prompt)
            a = await spec.generate(GREEDY, max_tokens=40, ignore_eos=True,
                                    speculator="prompt_lookup").tokens()
            b = await plain.generate(GREEDY, max_tokens=40, ignore_eos=True).tokens()
            assert a == b
            assert (spec.seq_len, spec.pending_tokens) == (plain.seq_len, plain.pending_tokens)
            bad = Context(rt).append(prompt)
            drafter = BadDrafter(1, list(range(5, 70)))
            assert await bad.generate(GREEDY, max_tokens=40, ignore_eos=True,
                                      speculator=drafter).tokens() == b
            assert drafter.accepted == b and drafter.rolled_back > 0
        engine.store.check_invariants()


async def test_rejected_tokens_leave_no_trace(tiny_folder, transport):
    async with sdk_runtime(tiny_folder, transport) as (rt, engine):
        spec = Context(rt).append(TEXT)
        plain = Context(rt).append(TEXT)
        await spec.generate(GREEDY, max_tokens=25, ignore_eos=True,
                            speculator=BadDrafter(3, list(range(5, 70)), k=5)).tokens()
        await plain.generate(GREEDY, max_tokens=25, ignore_eos=True).tokens()
        a = await spec.forward().input([7]).logits([0]).execute()
        b = await plain.forward().input([7]).logits([0]).execute()
        np.testing.assert_allclose(a.logits[0], b.logits[0], atol=1e-4)
        for ctx in (spec, plain):
            assert ctx.seq_len == len(TEXT) + 25 + 1
        engine.store.check_invariants()


async def test_speculative_sampling_has_exactly_plain_samplings_distribution(tiny_folder):
    """Chi-square over the joint distribution of the first two tokens, which one round
    drafts and verifies, with a drafter that is mostly wrong: 4,000 draws catch a 2%
    shift of probability mass (p < 0.001)."""
    allowed = [30, 31, 32, 33, 34, 35]
    prompt = TEXT[:12]

    def sampler(seed: int):
        return Sampler.top_k(3.0, 5, seed=seed)

    async with sdk_runtime(tiny_folder, "local", num_pages=4096) as (rt, _):
        # The exact distribution: p(t1) p(t2 | t1) from the model, through the sampler.
        async def logits_after(tokens: list[int]) -> np.ndarray:
            ctx = Context(rt).append(tokens[:-1])
            return (await ctx.forward().input(tokens[-1:]).logits([0]).execute()).logits[0]

        def probs(logits: np.ndarray) -> np.ndarray:
            masked = torch.full((len(logits),), float("-inf"))
            masked[allowed] = torch.tensor(logits)[allowed]
            return filtered_probs(masked[None], [sampler(0)])[0].numpy()

        p1 = probs(await logits_after(prompt))
        expected = {}
        for a in allowed:
            p2 = probs(await logits_after(prompt + [a]))
            for b in allowed:
                expected[(a, b)] = float(p1[a] * p2[b])

        async def one(seed: int) -> tuple[int, int]:
            async with Context(rt).append(prompt) as ctx:  # the round writes the prompt + draft
                toks = await ctx.generate(
                    sampler(seed), max_tokens=3, ignore_eos=True, allowed_tokens=allowed,
                    speculator=BadDrafter(seed, allowed, k=2)).tokens()
            return toks[0], toks[1]

        draws = []
        for start in range(0, 4000, 400):
            draws += await gather(*(one(s) for s in range(start, start + 400)))
    n = len(draws)
    counts = {cell: 0 for cell in expected}
    for d in draws:
        counts[d] += 1
    cells = [c for c in expected if expected[c] * n >= 5]
    rest = [c for c in expected if c not in cells]
    chi2 = sum((counts[c] - expected[c] * n) ** 2 / (expected[c] * n) for c in cells)
    if rest:  # pool the rare cells into one
        e = sum(expected[c] for c in rest) * n
        chi2 += (sum(counts[c] for c in rest) - e) ** 2 / e
    dof = len(cells) + (1 if rest else 0) - 1
    assert dof >= 10, dof  # the distribution is spread enough for the test to bite
    assert chi2 < _chi2_critical(dof, z=3.09), (chi2, dof)  # z = 3.09: p = 0.001


@pytest.mark.fp32_only("no model: decoding.verify alone")
@pytest.mark.parametrize("sampler", [Sampler.temperature(1.0), Sampler.top_p(0.7, 0.9),
                                     Sampler.top_k(1.5, 40), Sampler.min_p(1.0, 0.05),
                                     GREEDY])
def test_verify_produces_plain_decodings_tokens_and_uses_its_numbers(sampler):
    """Each row decoded as a plain step decodes it, the draft kept up to the first token
    that differs, and the generator left where plain decoding of the tokens produced
    leaves it: a draft never changes a seeded generation's tokens."""
    from runtime.engine.decoding import verify
    from runtime.sampling import sample_rows

    k, vocab = 6, 300
    logits = torch.randn(k + 1, vocab, generator=torch.Generator().manual_seed(1)) * 3.0

    def plain(n: int) -> tuple[list[int], torch.Tensor]:  # n rows decoded one step each
        gen = torch.Generator().manual_seed(42)
        tokens = [sample_rows(logits[j: j + 1], [sampler], [gen])[0] for j in range(n)]
        return tokens, gen.get_state()

    want, _ = plain(k + 1)
    cases = [(want[:k], k, want[k]), ([], 0, want[0])]  # all kept; no draft
    for m in range(k):  # token m wrong: kept m, then the row's own token
        wrong = (want[m] + 1) % vocab
        cases.append((want[:m] + [wrong] + want[m + 1: k], m, want[m]))
    cases.append((want[:k], 3, None))  # a kept stop token ends the group
    for draft, accepted, token in cases:
        stops = frozenset({want[2]}) if token is None else frozenset()
        gen = torch.Generator().manual_seed(42)
        rows = logits[: len(draft) + 1]
        assert verify(rows, draft, sampler, gen, stops) == (accepted, token)
        produced = accepted + (token is not None)
        assert torch.equal(gen.get_state(), plain(produced)[1]), (draft, accepted)


def _chi2_critical(dof: int, z: float) -> float:
    """The chi-square value exceeded with the normal tail probability of ``z``
    (Wilson-Hilferty: accurate to a fraction of a percent for dof > 10)."""
    h = 2.0 / (9.0 * dof)
    return dof * (1.0 - h + z * h ** 0.5) ** 3


class _Recorder:
    """Wraps the runner to record how many contexts each model call carried."""

    def __init__(self, runner) -> None:
        self.runner, self.sizes = runner, []

    def forward(self, batch, **kw):
        self.sizes.append(len(batch))
        return self.runner.forward(batch, **kw)


@pytest.mark.fp16
async def test_forks_speculating_together_share_each_pass(tiny_folder, transport):
    async with sdk_runtime(tiny_folder, transport) as (rt, engine):
        base = Context(rt).append(TEXT)
        await base.flush()
        alone = _Recorder(engine.executor.runner)
        engine.executor.runner = alone
        ref = await base.fork().generate(GREEDY, max_tokens=20, ignore_eos=True,
                                         speculator="prompt_lookup").tokens()
        together = _Recorder(alone.runner)
        engine.executor.runner = together
        forks = [base.fork() for _ in range(4)]
        outs = await gather(*(f.generate(GREEDY, max_tokens=20, ignore_eos=True,
                                         speculator="prompt_lookup").tokens() for f in forks))
        assert all(o == ref for o in outs)
        # Rounds of different forks share model calls (how many share depends on timing:
        # a round arriving while a step runs joins the next one).
        assert max(together.sizes) >= 2
        assert len(together.sizes) < 4 * len(alone.sizes)


def test_prompt_lookup_proposes_what_followed_the_last_ngram():
    spec = PromptLookup([1, 2, 3, 4, 5, 9, 2, 3], ngram=2, max_draft=3)
    assert spec.draft() == [4, 5, 9]
    spec.accept([4])
    assert spec.draft() == [5, 9, 2]
    assert PromptLookup([1, 2, 3]).draft() == []


@pytest.mark.parametrize("bad", [3, "lookup", object()])
async def test_a_bad_speculator_is_refused(tiny_folder, bad):
    from pie_ctx.errors import InvalidArgument

    async with sdk_runtime(tiny_folder, "local") as (rt, _):
        with pytest.raises(InvalidArgument):
            Context(rt).append([1, 2]).generate(speculator=bad)
