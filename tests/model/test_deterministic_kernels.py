"""Batch-invariant numerics, part by part (the end-to-end check on the default model is
tests/precision/test_deterministic.py).

* The projection kernels ``choose_kernels(deterministic=True)`` picks give a row the same
  bits alone, among 7 others, among 299, at any position (fp32, int8, bf16).
* The fused decode step gives a row the same logits and K/V as the eager forward in a
  batch of 9 and as a prefill chunk (fp32, int8 and GGUF block weights).
* A deterministic runner's logits for a row are the same bits whether its prompt ran in one
  chunk or in chunks of 16 or 5, alone or batched with other prefills and decodes, and in
  a fork decoding beside its siblings (the paged kernel's shared splits) or alone; for
  fp32 and int8 pools; and they agree with the free runner's to rounding.
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import (
    PagedSeq,
    free_list,
    make_hf_model,
    make_runner,
    random_tokens,
)

from runtime.model import fused_step, kernels
from runtime.model.blocks import BlockWeight
from runtime.model.gguf_weights import quantize_q8_0
from runtime.model.kernel_choice import choose_kernels
from runtime.model.matmul import Int8Weight, Projection
from runtime.model.runner import ModelRunner

needs_kernels = pytest.mark.skipif(kernels.ops() is None, reason="pie-ctx's kernels not built")

SIZES = (1, 2, 3, 5, 8, 17, 64, 299)


@pytest.mark.parametrize("form", ["fp32", "int8", "bf16", "q4", "q8"])
@pytest.mark.parametrize("shape", [(96, 64), (64, 160), (960, 576)])
def test_chosen_projection_kernels_are_row_count_invariant(form: str, shape) -> None:
    """Each form's candidates, GGUF blocks included (``blocks`` computes 4 output rows a
    pass for calls under 4 rows, one otherwise: a row must get the same bits either way)."""
    out_f, in_f = shape
    gen = torch.Generator().manual_seed(out_f + in_f)
    w = torch.randn(out_f, in_f, generator=gen) * 0.05
    if form in ("q4", "q8"):
        if in_f % 32:
            pytest.skip("GGUF blocks hold 32 inputs")
        weight = (BlockWeight.quantize_q4_1(w) if form == "q4" else quantize_q8_0(w))
    else:
        weight = Int8Weight.quantize(w) if form == "int8" else w.to(
            torch.bfloat16 if form == "bf16" else torch.float32)
    proj = Projection(weight, torch.randn(out_f, generator=gen) if form == "fp32" else None,
                      pack=form == "fp32")
    lines = choose_kernels([proj], deterministic=True)
    assert "deterministic" in lines[0]
    x = torch.randn(max(SIZES), in_f, generator=gen).to(
        torch.bfloat16 if form == "bf16" else torch.float32)
    # every row (half precision hides most last-bit differences in its rounding)
    alone = torch.cat([proj(x[i: i + 1]) for i in range(max(SIZES))])
    for m in SIZES:
        assert torch.equal(proj(x[:m]), alone[:m]), (lines, m)
        shifted = proj(torch.cat([x[1:m], x[:1]]))  # row 0 last
        assert torch.equal(shifted, torch.cat([alone[1:m], alone[:1]])), (lines, m)


def _runner(model, kv_dtype: str, deterministic: bool, num_pages: int = 160) -> ModelRunner:
    return make_runner(model, num_pages=num_pages, kv_dtype=kv_dtype,
                       deterministic=deterministic)


def _chunked(runner: ModelRunner, tokens: list[int], chunk: int,
             company: list[list[int]] = ()) -> torch.Tensor:
    """Logits of every row of ``tokens``, prefilled ``chunk`` tokens a step, each step batched
    with a chunk of every ``company`` prompt (their rows dropped)."""
    free = free_list(runner, seed=chunk)
    seq = PagedSeq(runner, free)
    others = [PagedSeq(runner, free) for _ in company]
    out = []
    for a in range(0, len(tokens), chunk):
        part = tokens[a: a + chunk]
        batch = [seq.step(part)]
        for o, prompt in zip(others, company, strict=True):
            batch.append(o.step(prompt[a: a + chunk] or prompt[-1:], logits=[0]))
        logits = runner.forward(batch)
        out.append(logits[: len(part)])
        seq.advance(len(part))
        for o, prompt in zip(others, company, strict=True):
            o.advance(len(prompt[a: a + chunk] or prompt[-1:]))
    return torch.cat(out)


@needs_kernels
@pytest.mark.parametrize("kv_dtype", ["fp32", "int8"])
def test_a_rows_logits_do_not_depend_on_chunks_or_batch(kv_dtype: str) -> None:
    model = make_hf_model("llama3", seed=4, max_position_embeddings=1024)
    runner = _runner(model, kv_dtype, deterministic=True)
    assert runner.deterministic and runner.backend.deterministic
    tokens = random_tokens(300, seed=1)  # crosses a 256-key split
    whole = _chunked(runner, tokens, 512)
    assert torch.equal(_chunked(runner, tokens, 16), whole)
    assert torch.equal(_chunked(runner, tokens, 5, [random_tokens(40, seed=2),
                                                   random_tokens(9, seed=3)]), whole)
    # the last row as a decode after the rest (a fork's first step), and in a short chunk
    free = free_list(runner, seed=9)
    seq = PagedSeq(runner, free)
    seq.run(tokens[:-1], logits=[0])
    assert torch.equal(seq.run(tokens[-1:])[0], whole[-1])
    seq = PagedSeq(runner, free)
    seq.run(tokens[:-13], logits=[0])
    assert torch.equal(seq.run(tokens[-13:]), whole[-13:])
    free_runner = _runner(model, kv_dtype, deterministic=False)
    # (int8 pages: a last-bit difference can move an entry by one quantization step)
    tol = 1e-4 if kv_dtype == "fp32" else 1e-2
    torch.testing.assert_close(_chunked(free_runner, tokens, 64), whole, rtol=tol, atol=tol)


@needs_kernels
def test_forks_decoding_together_match_a_fork_alone() -> None:
    model = make_hf_model("llama3", seed=5, max_position_embeddings=1024)
    runner = _runner(model, "fp32", deterministic=True)
    free = free_list(runner)
    parent = PagedSeq(runner, free)
    parent.run(random_tokens(320, seed=6))  # 20 full pages: one full shared split

    def fork() -> PagedSeq:
        return PagedSeq(runner, free, pages=list(parent.pages[:20]), num_cached=320)

    forks = [fork() for _ in range(4)]
    together = runner.forward([f.step([7 + i]) for i, f in enumerate(forks)])
    alone = fork()
    assert torch.equal(runner.forward([alone.step([7])])[0], together[0])
    assert torch.equal(runner.forward([alone.step([9])])[0], together[2])


def _kv_of(runner: ModelRunner, seq: PagedSeq, position: int) -> torch.Tensor:
    """Every layer's K and V entries of ``seq``'s token at ``position``."""
    page, slot = divmod(position, runner.page_size)
    return runner.pool_kv[seq.pages[page], slot].clone()


@needs_kernels
@pytest.mark.parametrize("weights,kv", [("fp32", "fp32"), ("int8", "fp32"), ("gguf", "fp32"),
                                        ("fp32", "int8"), ("fp32", "bf16")])
def test_a_row_is_the_same_fused_eager_and_in_a_prefill(weights: str, kv: str,
                                                         monkeypatch) -> None:
    """The fused step (one C++ call) gives a row the bits the eager forward gives it: alone,
    in a batch of 4, among 8 others with drafts (more rows than MAX_ROWS: under
    deterministic numerics fused too when every chunk-bucket kernel has a C++ form) and
    as the last row of a prefill chunk: logits and K/V."""
    monkeypatch.setattr(fused_step, "ENABLED", True)
    model = make_hf_model("qwen2", seed=12, max_position_embeddings=1024)  # q/k/v biases
    runner = make_runner(model, num_pages=160, kv_dtype=kv, deterministic=True)
    if weights != "fp32":  # (gguf: Q4_1 blocks made at load)
        runner = ModelRunner(runner.config, model.state_dict(), runner.pool_kv, 16,
                             weight_format=weights, calibration=random_tokens(64, seed=9),
                             deterministic=True)
    prompt, nxt = random_tokens(40, seed=13), 17
    free = free_list(runner, seed=3)

    def prefilled(tokens: list[int]) -> PagedSeq:
        seq = PagedSeq(runner, free)
        seq.run(tokens, logits=[0])
        return seq

    def steps() -> int:
        return runner._step.steps if isinstance(runner._step, fused_step.FusedStep) else 0

    def forward(batch: list, fused: bool) -> torch.Tensor:
        monkeypatch.setattr(fused_step, "ENABLED", fused)
        before = steps()
        out = runner.forward(batch)
        assert steps() == before + int(fused), "ran fused" if fused else "ran eagerly"
        return out

    # alone: a fused step of one row (the 1-row bucket)
    alone = prefilled(prompt)
    before = steps()
    want = alone.run([nxt])[0]
    assert steps() == before + 1, "the step ran fused"
    chunks = runner._step.chunks  # the chunk bucket's kernels all have a C++ form
    kv = _kv_of(runner, alone, len(prompt))
    # among 3 others: a fused step of 4 rows (the batch bucket)
    others = [prefilled(random_tokens(20 + i, seed=20 + i)) for i in range(8)]
    seq = prefilled(prompt)
    out = forward([seq.step([nxt])] + [o.step([5]) for o in others[:3]], fused=True)
    assert torch.equal(out[0], want)
    assert torch.equal(_kv_of(runner, seq, len(prompt)), kv)
    for o in others[:3]:
        o.advance(1)
    # among 8 others with drafts: more rows than MAX_ROWS, fused (when it takes them) and
    # eager; 8 x 8 + 1 rows is the chunk bucket
    draft = [6] * 8
    for fused in (True, False) if chunks else (False,):
        seq = prefilled(prompt)
        out = forward([seq.step([nxt])] + [o.step(draft) for o in others], fused=fused)
        assert torch.equal(out[0], want)
        assert torch.equal(_kv_of(runner, seq, len(prompt)), kv)
    # the last row of a prefill chunk, after a first chunk of 16: fused and eager
    for fused in (True, False) if chunks else (False,):
        seq = PagedSeq(runner, free)
        seq.run(prompt[:16], logits=[0])
        out = forward([seq.step(prompt[16:] + [nxt])], fused=fused)
        seq.advance(len(prompt) - 16 + 1)
        assert torch.equal(out[-1], want)
        assert torch.equal(_kv_of(runner, seq, len(prompt)), kv)
