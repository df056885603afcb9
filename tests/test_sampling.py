"""Sampling: validation, greedy, filters, seeded reproducibility independent of the batch."""

from __future__ import annotations

import math

import msgspec
import pytest
import torch

from pie_ctx.errors import InvalidArgument
from pie_ctx.proto.messages import SamplerSpec
from runtime.sampling import (
    filtered_probs,
    logprobs,
    make_generator,
    sample_rows,
    top_k_distribution,
)


def _logits(n: int = 4, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, vocab, generator=g) * 2.0


@pytest.mark.parametrize("kw", [dict(temperature=-0.1), dict(temperature=float("nan")),
                                dict(top_k=-1), dict(top_p=0.0), dict(top_p=1.5),
                                dict(min_p=-0.1), dict(min_p=1.0), dict(min_p=1.1), dict(seed=-1)])
def test_invalid_params_raise(kw: dict[str, float]) -> None:
    with pytest.raises(InvalidArgument):
        SamplerSpec(**kw)


def test_params_roundtrip_msgspec() -> None:
    p = SamplerSpec(temperature=0.7, top_p=0.9, seed=3)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(p), type=SamplerSpec) == p


def test_greedy_rows_are_argmax() -> None:
    x = _logits()
    assert sample_rows(x, [SamplerSpec()] * 4, [None] * 4) == x.argmax(-1).tolist()


@pytest.mark.parametrize("p", [SamplerSpec(temperature=1.0, top_k=1),
                               SamplerSpec(temperature=1.0, top_p=1e-6),
                               SamplerSpec(temperature=0.8, min_p=0.999999)])
def test_filters_that_keep_one_token_are_greedy(p: SamplerSpec) -> None:
    x = _logits(6, seed=1)
    gens = [make_generator(i) for i in range(6)]
    assert sample_rows(x, [p] * 6, gens) == x.argmax(-1).tolist()  # type: ignore[arg-type]


def test_seeded_rows_independent_of_batch_composition() -> None:
    x = _logits(5, vocab=200, seed=2)
    p = SamplerSpec(temperature=1.3, top_k=50, top_p=0.95, min_p=0.01, seed=11)
    alone = [sample_rows(x[2:3], [p], [make_generator(11)])[0] for _ in range(3)]
    assert len(set(alone)) == 1
    mixed = [SamplerSpec(), SamplerSpec(temperature=0.5, seed=1), p,
             SamplerSpec(temperature=2.0, seed=5), SamplerSpec()]
    gens = [None, make_generator(1), make_generator(11), make_generator(5), None]
    assert sample_rows(x, mixed, gens)[2] == alone[0]  # type: ignore[arg-type]


def test_generator_advances_one_draw_per_step() -> None:
    x = _logits(1, vocab=100, seed=3)
    p = SamplerSpec(temperature=1.0, seed=4)
    g1, g2 = make_generator(4), make_generator(4)
    seq1 = [sample_rows(x, [p], [g1])[0] for _ in range(20)]
    seq2 = [sample_rows(x, [p], [g2])[0] for _ in range(20)]
    assert seq1 == seq2 and len(set(seq1)) > 1


def test_samples_follow_the_filtered_distribution() -> None:
    logits = torch.log(torch.tensor([0.5, 0.25, 0.15, 0.07, 0.03]))
    n = 4000
    x = logits.expand(n, -1)
    gens = [make_generator(i) for i in range(n)]
    # top_p=0.8: keeps {0, 1, 2} (mass before token 2 is 0.75 < 0.8), renormalised
    got = sample_rows(x, [SamplerSpec(temperature=1.0, top_p=0.8)] * n, gens)  # type: ignore[arg-type]
    counts = torch.bincount(torch.tensor(got), minlength=5).float() / n
    want = torch.tensor([0.5, 0.25, 0.15, 0.0, 0.0]) / 0.9
    assert (counts - want).abs().max() < 0.03
    # top_k=2 then min_p=0.6: keeps {0} only when 0.25/0.75*... -> p1/p0 = 0.5 < 0.6
    got = sample_rows(x[:50], [SamplerSpec(temperature=1.0, top_k=2, min_p=0.6)] * 50, gens[:50])  # type: ignore[arg-type]
    assert set(got) == {0}
    # temperature sharpens: T=0.25 raises p0 to 0.5^4 / sum(p^4)
    got = sample_rows(x, [SamplerSpec(temperature=0.25)] * n, gens)  # type: ignore[arg-type]
    p4 = torch.tensor([0.5, 0.25, 0.15, 0.07, 0.03]) ** 4
    assert abs(got.count(0) / n - (p4[0] / p4.sum()).item()) < 0.03


def test_length_mismatch_raises() -> None:
    with pytest.raises(InvalidArgument):
        sample_rows(_logits(2), [SamplerSpec()], [None])


def test_logprobs_and_top_k_distribution() -> None:
    row = torch.tensor([2.0, 1.0, 0.0, -1.0])
    lp = logprobs(row, [0, 3])
    z = math.log(sum(math.exp(v) for v in (2.0, 1.0, 0.0, -1.0)))
    assert lp == pytest.approx([2.0 - z, -1.0 - z], abs=1e-6)
    ids, probs = top_k_distribution(row, 2)
    assert ids == [0, 1]
    assert probs == pytest.approx([math.exp(2.0 - z), math.exp(1.0 - z)], abs=1e-6)
    with pytest.raises(InvalidArgument):
        logprobs(row, [4])
    with pytest.raises(InvalidArgument):
        top_k_distribution(row, 0)


def test_candidate_prefilter_draws_exactly_what_a_full_sort_draws(monkeypatch):
    import runtime.sampling as sampling

    torch.manual_seed(0)
    logits = torch.randn(6, 5000) * torch.tensor([1.0, 3.0, 12.0, 12.0, 3.0, 12.0])[:, None]
    settings = [SamplerSpec(temperature=0.8, top_p=0.95), SamplerSpec(temperature=1.0, min_p=0.05),
                SamplerSpec(temperature=1.0, top_k=50), SamplerSpec(temperature=0.7, top_p=0.5),
                SamplerSpec(temperature=1.0), SamplerSpec(temperature=1.3, top_k=3000, top_p=0.9)]
    for params in ([s] * 6 for s in settings):
        draws = {}
        for candidates in (256, 10**9):
            monkeypatch.setattr(sampling, "CANDIDATES", candidates)
            draws[candidates] = [
                sample_rows(logits, params, [torch.Generator().manual_seed(t * 6 + i) for i in range(6)])
                for t in range(20)]
        assert draws[256] == draws[10**9], params[0]


@pytest.mark.parametrize("t", [4.85e-101, 1e-45, 5e-324])
def test_vanishing_temperature_samples_the_argmax(t: float) -> None:
    # a temperature that fp32 rounds to 0 (or that makes x / t overflow) used to give NaN
    # probabilities and fail the step; its limit is the argmax, for both vocab paths
    for vocab in (50, 3000):
        x = _logits(3, vocab=vocab, seed=7) * 10
        p = SamplerSpec(temperature=t, top_p=0.9, seed=3)
        drawn = sample_rows(x, [p] * 3, [make_generator(3 + i) for i in range(3)])
        assert drawn == x.argmax(dim=-1).tolist()
        probs = filtered_probs(x, [p] * 3)
        assert torch.equal(probs, torch.nn.functional.one_hot(x.argmax(-1), vocab).float())
