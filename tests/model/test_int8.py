"""int8 weights (``weights="int8"``): the kernels, their choice at load, and the whole model
against the fp32 oracle within int8's stated tolerance (docs/models.md).

The tolerance on the tiny random models (random weights, no structure for smoothing to use,
so harsher than a trained model): a row's largest logit error, relative to its largest
|logit| in transformers' fp32 logits, at most ``INT8_REL_MAX`` on every row and
``INT8_REL_MEDIAN`` on the median row; the greedy choice equal on at least ``INT8_AGREE``
of the rows. The real model's budget (perplexity, greedy agreement) is in
tests/model/test_int8_real.py.
"""

from __future__ import annotations

import logging

import pytest
import torch
from tiny_models import ARCHS, PagedSeq, config_of, free_list, make_hf_model, random_tokens

from pie_ctx.errors import InvalidArgument
from runtime.model import kernel_choice
from runtime.model.kernel_choice import choose_kernels
from runtime.model.matmul import ROW_BUCKETS, Int8Weight, Projection
from runtime.model.model import Transformer
from runtime.model.quant import quantize_int8
from runtime.model.runner import ModelRunner, SeqInput

INT8_REL_MAX = 0.2
INT8_REL_MEDIAN = 0.06
INT8_AGREE = 0.85


def _weight(out_f: int = 96, in_f: int = 64, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(out_f, in_f, generator=g)


def _rows(n: int, in_f: int = 64, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, in_f, generator=torch.Generator().manual_seed(seed))


def test_int8_weight_round_trip_within_half_a_step() -> None:
    w = _weight()
    q = Int8Weight.quantize(w)
    assert q.q.dtype == torch.int8 and q.scale.shape == (96,)
    err = (q.dequantize() - w).abs()
    assert (err <= q.scale[:, None] / 2 + 1e-7).all()
    assert q.nbytes == 96 * 64 + 96 * 4


@pytest.mark.parametrize("form", ["float", "int8"])
@pytest.mark.parametrize("bias", [False, True])
def test_every_candidate_kernel_computes_the_same_projection(form: str, bias: bool) -> None:
    w = _weight()
    b = torch.randn(96) if bias else None
    p = Projection(Int8Weight.quantize(w) if form == "int8" else w, b, pack=True)
    names = p.candidate_names()
    assert names[0] == ("int_mm" if form == "int8" else "mkl")
    for rows in (1, 8, 300):
        x = _rows(rows)
        want = torch.nn.functional.linear(x, p.weight.dequantize() if form == "int8" else w, b)
        ref = p.kernel(names[0])(x)
        for name in names:
            if not all(p.allowed(name, i) for i in range(len(ROW_BUCKETS))) and rows > 1:
                continue  # fbgemm serves one row only
            got = p.kernel(name)(x)
            assert got.shape == (rows, 96)
            assert torch.allclose(got, ref, rtol=1e-5, atol=1e-5), name
        # int8: activations quantized per row cost ~1% of the output's scale, no more
        scale = want.abs().max()
        assert (ref - want).abs().max() <= (0.02 if form == "int8" else 1e-5) * scale


def test_int8_rows_do_not_depend_on_their_batch() -> None:
    """Per-row activation scales and exact integer products: a row's result is the same bits
    whatever rows share its call (within one kernel)."""
    p = Projection(Int8Weight.quantize(_weight()))
    x = _rows(8)
    other = torch.cat([x[:3], _rows(5, seed=7) * 100])  # same first rows, wild neighbours
    assert torch.equal(p(x)[:3], p(other)[:3])


def test_choose_kernels_routes_each_bucket_to_a_timed_candidate(caplog) -> None:
    kernel_choice._CHOSEN.clear()
    projections = [Projection(Int8Weight.quantize(_weight(seed=i))) for i in range(3)]
    projections += [Projection(_weight(seed=9), pack=True)]
    with caplog.at_level(logging.INFO, logger="runtime.model.kernel_choice"):
        lines = choose_kernels(projections)
    assert len(lines) == 2 and all("1 row:" in line and "256 rows:" in line for line in lines)
    assert any("projection kernels" in r.message for r in caplog.records)
    for p in projections:
        assert len(p.kernel_names) == len(ROW_BUCKETS)
        for bucket, name in enumerate(p.kernel_names):
            assert name in p.candidate_names() and p.allowed(name, bucket)
    # the int8 members share one choice; the layouts no bucket chose are dropped
    assert len({tuple(p.kernel_names) for p in projections[:3]}) == 1
    assert all(p.layout_names <= set(p.kernel_names) for p in projections)
    # a second model with the same shapes reuses the choice without timing again
    again = [Projection(Int8Weight.quantize(_weight(seed=5)))]
    assert choose_kernels(again) == [lines[0]]
    assert again[0].kernel_names == projections[0].kernel_names


def _int8_runner(hf_model, calibration: list[int]) -> ModelRunner:
    cfg = config_of(hf_model)
    pool = torch.zeros(96, 16, cfg.num_layers, 2, cfg.num_kv_heads, cfg.head_dim)
    return ModelRunner(cfg, hf_model.state_dict(), pool, 16, weight_format="int8",
                       calibration=calibration)


@pytest.mark.parametrize("arch", ARCHS)
def test_int8_model_within_tolerance_of_fp32_oracle(arch: str) -> None:
    hf_model = make_hf_model(arch, seed=1)
    runner = _int8_runner(hf_model, random_tokens(200, seed=11))
    assert runner.weight_format == "int8"
    tokens = random_tokens(60, seed=2)
    seq = PagedSeq(runner, free_list(runner))
    ours = torch.cat([seq.run(tokens[:40]), seq.run(tokens[40:50])]
                     + [seq.run([t]) for t in tokens[50:]])  # prefill chunks, then decodes
    with torch.no_grad():
        ref = hf_model(torch.tensor([tokens])).logits[0]
    rel = (ours - ref).abs().amax(-1) / ref.abs().amax(-1)  # [rows]
    agree = (ours.argmax(-1) == ref.argmax(-1)).float().mean().item()
    assert rel.max().item() <= INT8_REL_MAX, rel.max().item()
    assert rel.median().item() <= INT8_REL_MEDIAN, rel.median().item()
    assert agree >= INT8_AGREE, agree
    assert runner.model.weight_bytes() < 0.4 * Transformer(
        config_of(hf_model), hf_model.state_dict(), torch.device("cpu"),
        torch.float32).weight_bytes()


def test_int8_refuses_what_it_cannot_do() -> None:
    hf_model = make_hf_model("llama3")
    cfg, weights = config_of(hf_model), hf_model.state_dict()
    pool = torch.zeros(4, 16, cfg.num_layers, 2, cfg.num_kv_heads, cfg.head_dim)
    with pytest.raises(InvalidArgument, match="weights must be one of fp32, int8"):
        ModelRunner(cfg, weights, pool, 16, weight_format="int4")
    with pytest.raises(InvalidArgument, match="calibration"):
        ModelRunner(cfg, weights, pool, 16, weight_format="int8")
    model = Transformer(cfg, weights, torch.device("cpu"), torch.float32)
    model.device = torch.device("cuda")  # (no CUDA needed: refused before any work)
    with pytest.raises(InvalidArgument, match="CPU"):
        quantize_int8(model, [1, 2, 3])
    model.device = torch.device("cpu")
    quantize_int8(model, [1, 2, 3])
    with pytest.raises(InvalidArgument, match="already int8"):
        quantize_int8(model, [1, 2, 3])


def test_a_step_that_needs_no_logits_runs_with_int8_weights() -> None:
    """A step of prompt chunks that end no prompt asks for no logit row: the lm_head is
    skipped (int8's kernel cannot quantize zero rows; eight long flushes failed so)."""
    hf_model = make_hf_model(ARCHS[0], seed=1)
    runner = _int8_runner(hf_model, random_tokens(200, seed=11))
    tokens = random_tokens(20, seed=2)
    logits = runner.forward([SeqInput(tokens, list(range(20)), [0, 1], 0, [])])
    assert logits.shape == (0, runner.config.vocab_size)
