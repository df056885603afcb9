"""Paged equivalences: any chunking, page size, batch mix or mask == the dense reference.

Every test runs on unquantized pages, on int8 pages and on bf16 pages (``kv_dtype``); for
int8 and bf16 the dense reference rounds each K/V entry the same way, and the tolerance
allows for an entry whose fp32 rounding lands it on the other side of an int8 (or bf16)
step (``TOL_INT8``).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny_models import PagedSeq, free_list, make_hf_model, make_runner, random_tokens

from pie_ctx.errors import InvalidArgument
from runtime.model import kernels
from runtime.model.reference import causal_mask, dense_forward
from runtime.model.runner import ModelRunner, SeqInput

TOL = 2e-5
TOL_INT8 = 1e-4
TOL_BF16 = 1e-3  # bf16 K/V keep 8 bits of mantissa: ~2e-3 per entry, ~3e-4 after the sums
KV = {"kv_dtype": "fp32"}  # the format of the runners this module's current test builds


@pytest.fixture(scope="module")
def hf_model() -> torch.nn.Module:
    return make_hf_model("llama3", seed=7, num_layers=2)


@pytest.fixture
def sdpa_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """For the tests of run prefixes (lone decodes reading a run of pages in place): with
    pie-ctx's own kernel, fp32 lone decodes take that instead (tests/model/test_kernels.py)."""
    monkeypatch.setattr(kernels, "ENABLED", False)


@pytest.fixture
def no_fused_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """For the tests of the cascade's groups: the fused decode step
    (runtime/model/fused_step.py) takes forks that share a few pages itself."""
    from runtime.model import fused_step

    monkeypatch.setattr(fused_step, "ENABLED", False)


@pytest.fixture(autouse=True, params=["fp32", "int8", "bf16"],
                ids=["kv_fp32", "kv_int8", "kv_bf16"])
def kv_dtype(request: pytest.FixtureRequest) -> str:
    KV["kv_dtype"] = request.param
    return request.param


def _runner(hf_model: torch.nn.Module, page_size: int) -> ModelRunner:
    return make_runner(hf_model, page_size=page_size, num_pages=max(64, 400 // page_size),
                       kv_dtype=KV["kv_dtype"])


def _dense(runner: ModelRunner, *args, **kw) -> torch.Tensor:
    return dense_forward(runner.model, *args, kv_dtype=runner.kv_dtype, **kw)


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape
    tol = {"fp32": TOL, "int8": TOL_INT8, "bf16": TOL_BF16}[KV["kv_dtype"]]
    assert (a - b).abs().max().item() <= tol


@pytest.mark.parametrize("page_size", [16, 32, 5])
@pytest.mark.parametrize("chunk", [None, 1, 7, 16])
def test_chunked_prefill_equals_dense(hf_model: torch.nn.Module, page_size: int,
                                      chunk: int | None) -> None:
    runner = _runner(hf_model, page_size)
    tokens = random_tokens(37, seed=11)
    dense = _dense(runner, tokens)  # [37, V]
    seq = PagedSeq(runner, free_list(runner, seed=page_size))
    step = chunk or len(tokens)
    parts = [seq.run(tokens[i:i + step]) for i in range(0, len(tokens), step)]
    _close(torch.cat(parts), dense)


def test_mixed_batch_of_five_equals_each_alone(hf_model: torch.nn.Module) -> None:
    """Decodes, cached chunks and fresh prefills of different lengths in one forward."""
    runner = _runner(hf_model, 16)
    prompts = [random_tokens(n, seed=20 + n) for n in (1, 9, 17, 33, 50)]
    cached = [0, 8, 10, 32, 0]  # tokens already in the KV cache before the batched step
    free = free_list(runner, seed=3)
    seqs = [PagedSeq(runner, free) for _ in prompts]
    for seq, p, c in zip(seqs, prompts, cached, strict=True):
        if c:
            seq.run(p[:c])
    batch = [seq.step(p[c:]) for seq, p, c in zip(seqs, prompts, cached, strict=True)]
    batch[3].logit_indices = [0]  # a decode asks for its single row
    batch[2].logit_indices = [6, 0]  # arbitrary order is preserved
    out = runner.forward(batch)
    row = 0
    for seq_in, p, c in zip(batch, prompts, cached, strict=True):
        alone = make_runner(hf_model, page_size=16, kv_dtype=KV["kv_dtype"])
        solo = PagedSeq(alone, free_list(alone, seed=9))
        if c:
            solo.run(p[:c])
        want = solo.run(p[c:])[seq_in.logit_indices]
        n = len(seq_in.logit_indices)
        _close(out[row:row + n], want)
        _close(out[row:row + n], _dense(runner, p)[[c + j for j in seq_in.logit_indices]])
        row += n
    assert row == out.shape[0]


def test_batched_decode_equal_and_unequal_lengths(hf_model: torch.nn.Module) -> None:
    runner = _runner(hf_model, 16)
    free = free_list(runner, seed=4)
    for lengths in ((20, 20, 20), (3, 40, 17)):
        prompts = [random_tokens(n + 1, seed=n) for n in lengths]
        seqs = [PagedSeq(runner, free) for _ in prompts]
        for seq, p in zip(seqs, prompts, strict=True):
            seq.run(p[:-1])
        out = runner.forward([seq.step(p[-1:]) for seq, p in zip(seqs, prompts, strict=True)])
        for i, p in enumerate(prompts):
            _close(out[i:i + 1], _dense(runner, p)[-1:])


def test_custom_tree_mask(hf_model: torch.nn.Module) -> None:
    """Two branches after a shared prefix, written in one pass; branch b cannot see a."""
    runner = _runner(hf_model, 16)
    prefix, a, b = random_tokens(6, seed=1), random_tokens(3, seed=2), random_tokens(2, seed=3)
    seq = PagedSeq(runner, free_list(runner))
    seq.run(prefix)
    new = a + b
    mask = np.zeros((5, 11), dtype=np.bool_)
    mask[:, :6] = True
    for j in range(3):
        mask[j, 6:6 + j + 1] = True  # a_j sees a_0..a_j
    for j in range(2):
        mask[3 + j, 9:9 + j + 1] = True  # b_j sees b_0..b_j only
    positions = [6, 7, 8, 6, 7]  # both branches continue at position 6
    out = seq.run(new, positions=positions, mask=mask)
    full = np.zeros((11, 11), dtype=np.bool_)
    full[:6, :6] = causal_mask(6)
    full[6:] = mask
    dense = _dense(runner, prefix + new, list(range(6)) + positions, full)
    _close(out, dense[6:])
    # branch b equals a plain causal run of prefix + b
    _close(out[3:], _dense(runner, prefix + b)[6:])


def test_custom_mask_mixed_with_causal_sequences(hf_model: torch.nn.Module) -> None:
    runner = _runner(hf_model, 5)
    free = free_list(runner, seed=5)
    toks = random_tokens(8, seed=8)
    mask = np.ones((8, 8), dtype=np.bool_)  # bidirectional block
    s1, s2 = PagedSeq(runner, free), PagedSeq(runner, free)
    other = random_tokens(13, seed=9)
    out = runner.forward([s1.step(toks, mask=mask), s2.step(other)])
    _close(out[:8], _dense(runner, toks, mask=mask))
    _close(out[8:], _dense(runner, other))


def test_arbitrary_positions_chunked(hf_model: torch.nn.Module) -> None:
    runner = _runner(hf_model, 16)
    tokens = random_tokens(24, seed=12)
    positions = list(range(1000, 1012)) + [3] * 4 + list(range(50, 58))
    seq = PagedSeq(runner, free_list(runner))
    out = torch.cat([seq.run(tokens[:12], positions=positions[:12]),
                     seq.run(tokens[12:], positions=positions[12:])])
    _close(out, _dense(runner, tokens, positions))


def test_fork_shares_pages_and_decodes_like_parent(hf_model: torch.nn.Module) -> None:
    runner = _runner(hf_model, 16)
    free = free_list(runner, seed=6)
    parent = PagedSeq(runner, free)
    parent.run(random_tokens(32, seed=13))  # two full pages
    child = PagedSeq(runner, free, pages=list(parent.pages), num_cached=32)
    nxt = random_tokens(3, seed=14)
    got_child = child.run(nxt)
    got_parent = parent.run(nxt)
    assert child.pages[:2] == parent.pages[:2] and child.pages[2] != parent.pages[2]
    _close(got_child, got_parent)


def test_truncate_then_refeed_reproduces(hf_model: torch.nn.Module) -> None:
    runner = _runner(hf_model, 16)
    seq = PagedSeq(runner, free_list(runner))
    seq.run(random_tokens(20, seed=15))
    tail = random_tokens(6, seed=16)
    first = seq.run(tail)
    seq.num_cached -= 6  # truncate: the slots will be overwritten
    seq.run(random_tokens(6, seed=17))  # something else in between
    seq.num_cached -= 6
    _close(seq.run(tail), first)


def test_pages_outside_the_tables_are_untouched(hf_model: torch.nn.Module) -> None:
    runner = _runner(hf_model, 16)
    seq = PagedSeq(runner, free_list(runner))
    seq.run(random_tokens(40, seed=18))
    others = sorted(set(range(runner.num_pages)) - set(seq.pages))
    assert runner.pool_kv[others].abs().sum().item() == 0.0
    assert runner.pool_kv[seq.pages[:2]].abs().sum().item() > 0.0


@pytest.mark.parametrize("bad", ["short_table", "token", "mask_shape", "mask_row", "dup_slot",
                                 "page_id", "positions", "logit_index"])
def test_invalid_batch_raises_and_writes_nothing(hf_model: torch.nn.Module, bad: str) -> None:
    runner = _runner(hf_model, 16)
    ok = SeqInput([1, 2, 3], [0, 1, 2], [4], 0, [2], None)
    seq = SeqInput([5, 6], [0, 1], [7], 0, [1], None)
    if bad == "short_table":
        seq = SeqInput(list(range(20)), list(range(20)), [7], 0, [0], None)
    elif bad == "token":
        seq.tokens = [5, 10**6]
    elif bad == "mask_shape":
        seq.mask = np.ones((2, 3), dtype=np.bool_)
    elif bad == "mask_row":
        seq.mask = np.array([[True, False], [False, False]])
    elif bad == "dup_slot":
        seq.page_table = [4]
    elif bad == "page_id":
        seq.page_table = [runner.num_pages]
    elif bad == "positions":
        seq.positions = [0]
    elif bad == "logit_index":
        seq.logit_indices = [2]
    with pytest.raises(InvalidArgument):
        runner.forward([ok, seq])
    assert runner.pool_kv.abs().sum().item() == 0.0


def _record_groups(runner: ModelRunner) -> list:
    """Record the torch backend's per-forward groups (one list per forward)."""
    seen: list = []
    prepare = runner.backend.prepare

    def spy(meta, pool):  # noqa: ANN001
        prepare(meta, pool)
        seen.append(meta.backend_state)
    runner.backend.prepare = spy
    return seen


def test_cascade_for_forks_matches_dense_and_plain_decode(hf_model: torch.nn.Module,
                                                          no_fused_step: None) -> None:
    """Forks decoding together read their shared pages once (cascade attention); each still
    gets the dense reference's logits, with or without other sequences in the batch."""
    runner = _runner(hf_model, 16)
    free = free_list(runner, seed=8)
    prompt = random_tokens(37, seed=21)  # 2 full shared pages + a 5-token tail
    parent = PagedSeq(runner, free)
    parent.run(prompt[:32])
    forks = [PagedSeq(runner, free, pages=list(parent.pages), num_cached=32) for _ in range(3)]
    tails = [prompt[32:] + random_tokens(2, seed=30 + i) for i in range(3)]
    for fork, tail in zip(forks, tails, strict=True):
        fork.run(tail[:-1])
    other = PagedSeq(runner, free)
    other_prompt = random_tokens(9, seed=40)
    other.run(other_prompt[:-1])
    batch = [f.step(t[-1:]) for f, t in zip(forks, tails, strict=True)] + [other.step(other_prompt[-1:])]
    meta_groups = _record_groups(runner)
    out = runner.forward(batch)
    from runtime.model.attention.cascade import CascadeGroup
    assert any(isinstance(g, CascadeGroup) for g in meta_groups[0])
    for i, tail in enumerate(tails):
        _close(out[i:i + 1], _dense(runner, prompt[:32] + tail)[-1:])
    _close(out[3:4], _dense(runner, other_prompt)[-1:])


def test_consecutive_pages_are_read_in_place_with_the_same_results(hf_model: torch.nn.Module) -> None:
    """Pages with consecutive ids are attended through a strided view of the pool (no
    gather); prefill, decode and fork cascades give the dense reference's logits."""
    runner = _runner(hf_model, 16)
    free = list(range(runner.num_pages))[::-1]  # pop() hands out 0, 1, 2, ...: one run
    prompt = random_tokens(40, seed=50)
    seq = PagedSeq(runner, free)
    _close(seq.run(prompt[:33]), _dense(runner, prompt[:33]))
    for j in range(33, 40):
        _close(seq.run(prompt[j:j + 1]), _dense(runner, prompt[:j + 1])[-1:])
    assert seq.pages == [0, 1, 2]
    forks = [PagedSeq(runner, free, pages=list(seq.pages[:2]), num_cached=32) for _ in range(2)]
    tails = [random_tokens(3, seed=60 + i) for i in range(2)]
    for f, t in zip(forks, tails, strict=True):
        f.run(t[:-1])
    out = runner.forward([f.step(t[-1:]) for f, t in zip(forks, tails, strict=True)])
    for i, t in enumerate(tails):
        _close(out[i:i + 1], _dense(runner, prompt[:32] + t)[-1:])


@pytest.mark.usefixtures("sdpa_only")
def test_a_run_prefix_with_a_stray_tail_page_matches_dense(hf_model: torch.nn.Module) -> None:
    """The engine's usual page table: a long run of committed pages, then a tail page from
    elsewhere. The run is read in place, the tail gathered; logits equal the reference."""
    runner = _runner(hf_model, 16)
    free = list(range(runner.num_pages))[::-1]
    prompt = random_tokens(80, seed=70)
    seq = PagedSeq(runner, free)
    seq.run(prompt[:64])  # pages 0..3: one run of four full pages
    seq.pages.append(40)  # the tail page lives elsewhere
    _close(seq.run(prompt[64:79]), _dense(runner, prompt[:79])[64:])
    meta_groups = _record_groups(runner)
    _close(seq.run(prompt[79:80]), _dense(runner, prompt)[-1:])
    from runtime.model.attention.cascade import CascadeGroup
    assert isinstance(meta_groups[0][0], CascadeGroup) and meta_groups[0][0].shared_run == 0


def test_cascade_with_unequal_tails_matches_dense(hf_model: torch.nn.Module,
                                                  no_fused_step: None) -> None:
    runner = _runner(hf_model, 16)
    free = free_list(runner, seed=9)
    prompt = random_tokens(32, seed=80)
    parent = PagedSeq(runner, free)
    parent.run(prompt)
    tails = [random_tokens(k, seed=90 + k) for k in (2, 7, 19)]  # 19 spills into a 2nd page
    forks = [PagedSeq(runner, free, pages=list(parent.pages), num_cached=32) for _ in tails]
    for f, t in zip(forks, tails, strict=True):
        f.run(t[:-1])
    groups = _record_groups(runner)
    out = runner.forward([f.step(t[-1:]) for f, t in zip(forks, tails, strict=True)])
    from runtime.model.attention.cascade import CascadeGroup
    assert isinstance(groups[0][0], CascadeGroup) and groups[0][0].tail_bias is not None
    for i, t in enumerate(tails):
        _close(out[i:i + 1], _dense(runner, prompt + t)[-1:])


def test_attention_with_lse_fused_and_fallback_agree() -> None:
    from runtime.model.attention import cascade

    torch.manual_seed(0)
    q, k, v = torch.randn(3, 2, 5, 16), torch.randn(3, 2, 9, 16), torch.randn(3, 2, 9, 16)
    bias = torch.zeros(3, 1, 1, 9)
    bias[0, ..., 6:] = float("-inf")
    fused = cascade._attend_lse(q, k, v, 0.25, bias)
    scores = (q @ k.transpose(-1, -2)) * 0.25 + bias
    want_out = torch.softmax(scores, -1) @ v
    want_lse = torch.logsumexp(scores, -1)
    flash, cascade._FLASH_LSE = cascade._FLASH_LSE, None
    try:
        manual = cascade._attend_lse(q, k, v, 0.25, bias)
    finally:
        cascade._FLASH_LSE = flash
    for out, lse in (fused, manual):
        torch.testing.assert_close(out, want_out, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=1e-5)
