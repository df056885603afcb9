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


# --- the C++ kernel (runtime/model/kernels/sampling.cpp) against the torch code ---------

@pytest.fixture
def both(request, monkeypatch):
    """Run a test through the kernel and through the torch fallback."""
    from runtime.model import kernels

    monkeypatch.setattr(kernels, "ENABLED", request.param == "kernel")
    return request.param


@pytest.mark.parametrize("both", ["kernel", "torch"], indirect=True)
def test_both_paths_batch_independent_and_distributed(both: str) -> None:
    test_seeded_rows_independent_of_batch_composition()
    test_samples_follow_the_filtered_distribution()
    test_filters_that_keep_one_token_are_greedy(SamplerSpec(temperature=1.0, top_p=1e-6))


def _kernel():
    from runtime.model.kernels import sampling_ops

    kernel = sampling_ops()
    assert kernel is not None, "the sampling kernel did not build (see the log)"
    return kernel


def _args(params: list[SamplerSpec]):
    from runtime.sampling import _settings

    return _settings(params)


def _rows(n: int, vocab: int, seed: int, scale: float, peak: float) -> torch.Tensor:
    """Logit rows with a few dominant tokens at random places, like a model's."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, vocab, generator=g) * scale
    hot = torch.randint(0, vocab, (n, 8), generator=g)
    x.scatter_add_(1, hot, torch.rand(n, 8, generator=g) * peak)
    return x


SETTINGS = [SamplerSpec(temperature=0.7, top_p=0.9), SamplerSpec(temperature=1.0),
            SamplerSpec(temperature=1.0, top_k=40, top_p=0.95),
            SamplerSpec(temperature=1.2, min_p=0.05), SamplerSpec(temperature=0.5, top_k=3),
            SamplerSpec(temperature=1.0, top_p=0.5, min_p=0.2),
            SamplerSpec(temperature=0.9, top_k=3000, top_p=0.99)]


def _near_tie(x: torch.Tensor, p: SamplerSpec, u: float, eps: float = 3e-6) -> bool:
    """Whether the oracle's draw at ``u`` sits within ``eps`` of a boundary (a cdf step, the
    top-p reach or the min-p ratio), where fp32 rounding may pick either side."""
    from runtime.sampling import MIN_TEMPERATURE

    s = x.double() / max(p.temperature, MIN_TEMPERATURE)
    srt = torch.sort(s, descending=True).values
    k = p.top_k or srt.numel()
    probs = torch.softmax(srt[:k], dim=0)
    before = torch.cumsum(probs, 0) - probs
    kept = int((before < p.top_p).sum()) if p.top_p < 1 else k
    near = p.top_p < 1 and bool(((before - p.top_p).abs() < eps).any())
    probs = probs[:kept] / probs[:kept].sum()
    ratio = probs / probs[0]
    near |= p.min_p > 0 and bool(((ratio - p.min_p).abs() < eps).any())
    probs = probs[ratio >= p.min_p] if p.min_p > 0 else probs
    cdf = torch.cumsum(probs / probs.sum(), 0)
    # fp32 cumulative sums drift with their length (torch's and the kernel's apart)
    return near or bool(((cdf - u).abs() < eps * max(1.0, cdf.numel() / 500)).any())


@pytest.mark.parametrize("vocab, n", [(50, 200), (3000, 30), (49152, 12)])
def test_kernel_draws_what_the_torch_oracle_draws(vocab: int, n: int, monkeypatch) -> None:
    import runtime.sampling as sampling

    monkeypatch.setattr(sampling, "CANDIDATES", 10**9)  # the oracle: a full sort
    kernel = _kernel()
    compared = 0
    for si, p in enumerate(SETTINGS):
        for scale, peak in ((1.0, 0.0), (3.0, 12.0), (0.3, 4.0)):
            x = _rows(n, vocab, seed=si * 7 + int(scale * 10), scale=scale, peak=peak)
            g = torch.Generator().manual_seed(si)
            us = torch.rand(n, generator=g).tolist()
            got = kernel.sample(x, *_args([p] * n), us).tolist()
            for i in range(n):
                if _near_tie(x[i], p, us[i]):
                    continue
                compared += 1
                want = sampling._sample_row(x[i: i + 1], p, us[i])
                assert got[i] == want, (p, scale, peak, i)
    assert compared >= 0.5 * n * len(SETTINGS) * 3  # flat rows of 49,152 are all near a step


@pytest.mark.parametrize("vocab", [50, 3000, 49152])
def test_kernel_distribution_matches_the_oracle(vocab: int, monkeypatch) -> None:
    import runtime.sampling as sampling
    from runtime.model import kernels

    monkeypatch.setattr(sampling, "CANDIDATES", 10**9)
    n = 6
    for si, p in enumerate(SETTINGS):
        x = _rows(n, vocab, seed=100 + si, scale=2.0, peak=8.0)
        got = sampling.filtered_probs(x, [p] * n)
        monkeypatch.setattr(kernels, "ENABLED", False)
        want = sampling.filtered_probs(x, [p] * n)
        monkeypatch.setattr(kernels, "ENABLED", True)
        for i in range(n):
            if _near_tie(x[i], p, 0.5):  # a filter boundary may fall either way
                continue
            assert torch.allclose(got[i], want[i], atol=2e-6, rtol=1e-4), (p, i)
        assert torch.allclose(got.sum(-1), torch.ones(n), atol=1e-5)


def test_kernel_draws_follow_its_own_distribution() -> None:
    # the draw and filtered_probs (speculative verification) sample the same distribution
    kernel = _kernel()
    x = _rows(1, 40, seed=5, scale=1.5, peak=3.0)
    for p in (SamplerSpec(temperature=0.8, top_p=0.9), SamplerSpec(temperature=1.0, top_k=5, min_p=0.1)):
        probs = kernel.filtered_probs(x, *_args([p]))[0]
        n = 20000
        us = torch.rand(n, generator=torch.Generator().manual_seed(1)).tolist()
        got = kernel.sample(x.expand(n, -1).contiguous(), *_args([p] * n), us)
        freq = torch.bincount(got, minlength=40).float() / n
        assert (freq - probs).abs().max() < 0.015
        assert bool((freq[probs == 0] == 0).all())


@pytest.mark.parametrize("threads", [1, 2])
def test_kernel_rows_independent_of_batch(threads: int) -> None:
    kernel = _kernel()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for vocab in (50, 49152):
            x = _rows(8, vocab, seed=9, scale=2.0, peak=10.0)
            params = SETTINGS + [SamplerSpec(temperature=2.0, top_p=0.99)]
            us = torch.rand(8, generator=torch.Generator().manual_seed(2)).tolist()
            batch = kernel.sample(x, *_args(params), us).tolist()
            probs = kernel.filtered_probs(x, *_args(params))
            for i in range(8):
                alone = kernel.sample(x[i: i + 1].contiguous(), *_args(params[i: i + 1]), us[i: i + 1])
                assert int(alone) == batch[i]
                solo = kernel.filtered_probs(x[i: i + 1].contiguous(), *_args(params[i: i + 1]))
                assert torch.equal(solo[0], probs[i])
            # the same rows in another order and among other rows
            perm = [3, 0, 7, 1]
            y = torch.cat([x[perm], _rows(2, vocab, seed=1, scale=1.0, peak=0.0)])
            mixed = kernel.sample(y, *_args([params[i] for i in perm] + params[:2]),
                                  [us[i] for i in perm] + [0.5, 0.25]).tolist()
            assert mixed[:4] == [batch[i] for i in perm]
    finally:
        torch.set_num_threads(before)


def test_kernel_top_k_past_the_candidates_and_vanishing_temperature(monkeypatch) -> None:
    import runtime.sampling as sampling

    monkeypatch.setattr(sampling, "CANDIDATES", 10**9)
    kernel = _kernel()
    # a peaked row: the first candidate set is far smaller than top_k = 5000, so the kernel
    # finds the top-k mass over the whole vocabulary
    x = _rows(4, 49152, seed=3, scale=1.0, peak=20.0)
    p = SamplerSpec(temperature=1.0, top_k=5000, top_p=0.999)
    us = [0.1, 0.5, 0.9, 0.999]
    got = kernel.sample(x, *_args([p] * 4), us).tolist()
    for i in range(4):
        if not _near_tie(x[i], p, us[i]):
            assert got[i] == sampling._sample_row(x[i: i + 1], p, us[i])
    for t in (4.85e-101, 1e-45):
        q = SamplerSpec(temperature=t, top_p=0.9)
        assert kernel.sample(x, *_args([q] * 4), us).tolist() == x.argmax(-1).tolist()
        probs = kernel.filtered_probs(x, *_args([q] * 4))
        assert torch.equal(probs, torch.nn.functional.one_hot(x.argmax(-1), 49152).float())


@pytest.mark.parametrize("both", ["kernel", "torch"], indirect=True)
def test_top_p_is_taken_within_a_top_k_set_past_the_candidates(both: str, monkeypatch) -> None:
    """Top-p's mass is the top-k-restricted distribution's, also when top-k reaches past the
    candidate cut and the candidates alone decide the nucleus (the torch code once
    normalised over the whole vocabulary there, and kept 17% more tokens here)."""
    import runtime.sampling as sampling

    monkeypatch.setattr(sampling, "CANDIDATES", 256)
    g = torch.Generator().manual_seed(5)
    # 256 near-equal leaders hold 60% of the mass, ranks 256-2999 20%, the last 2,000 20%
    x = torch.cat([3.154 + 0.01 * torch.rand(256, generator=g),
                   -0.316 + 0.01 * torch.rand(2744, generator=g), torch.zeros(2000)])
    x = x[torch.randperm(5000, generator=g)][None, :]
    p = SamplerSpec(temperature=1.0, top_k=3000, top_p=0.5)
    # the exact support: the top-k set, normalised, then its smallest prefix reaching top_p
    srt = torch.sort(x[0].double(), descending=True)
    probs = torch.softmax(srt.values[:3000], dim=0)
    kept = int(((torch.cumsum(probs, 0) - probs) < 0.5).sum())
    assert kept == 182  # normalised over all 5,000: 213
    got = filtered_probs(x, [p])[0]
    assert set((got > 0).nonzero().flatten().tolist()) == set(srt.indices[:kept].tolist())
    assert float(got.sum()) == pytest.approx(1.0, abs=1e-5)
