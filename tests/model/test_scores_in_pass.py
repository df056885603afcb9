"""Attention scores taken inside the paged kernel's pass (``runtime.model.scores``'
ScoreCapture) against the second softmax pass, which stays the oracle: decodes, drafts, a
prefill chunk of many rows (the kernel's row-tile path), contexts over one 256-key split,
forks sharing splits, int8 and bf16 pages, every reduction."""

from __future__ import annotations

import pytest
import torch
from tiny_models import PagedSeq, free_list, make_hf_model, make_runner, random_tokens

from runtime.model import kernels
from runtime.model.batch import ScoreQuery
from runtime.model.scores import ScoreCapture

pytestmark = pytest.mark.skipif(kernels.ops() is None, reason="pie-ctx's CPU kernels")


def _queries(rows: list[int], layers: list[int]) -> list[ScoreQuery]:
    return [ScoreQuery(rows=rows, layers=layers),
            ScoreQuery(rows=rows[:1], layers=layers, reduce="max", heads="all"),
            ScoreQuery(rows=rows, layers=layers, by_layer=True)]


def _run(kv: str, in_pass: bool, monkeypatch: pytest.MonkeyPatch) -> list[list[torch.Tensor]]:
    """The same steps on a fresh deterministic runner; each step's answers."""
    calls = []
    if in_pass:
        ops = kernels.ops()
        real = ops.paged_attention_scored

        def spy(*args):
            calls.append(1)
            return real(*args)

        monkeypatch.setattr(ops, "paged_attention_scored", spy, raising=False)
    else:  # nothing taken: every sequence through the second pass
        monkeypatch.setattr(ScoreCapture, "take", lambda self, seqs: None)
    hf = make_hf_model("llama3", seed=11, num_layers=3)
    runner = make_runner(hf, num_pages=96, kv_dtype=kv, deterministic=True)
    free = free_list(runner)
    a, b = PagedSeq(runner, free), PagedSeq(runner, free)
    answers = []

    def step(*feeds: tuple[PagedSeq, list[int], list[ScoreQuery] | None]) -> None:
        batch = []
        for seq, tokens, queries in feeds:
            s = seq.step(tokens)
            s.scores = queries or []
            batch.append(s)
        runner.forward(batch)
        for seq, tokens, _ in feeds:
            seq.advance(len(tokens))
        answers.append([q.out.clone() for _, _, qs in feeds for q in (qs or [])])

    prompt = random_tokens(300, seed=5)  # two splits of keys
    step((a, prompt, _queries([0, 7, 150, 299], [0, 2])), (b, random_tokens(40, seed=6), None))
    fork = PagedSeq(runner, free, pages=list(a.pages[:16]), num_cached=256)
    step((fork, prompt[256:300], _queries([43], [1])), (b, [3], _queries([0], [0, 1, 2])))
    step((a, [9], _queries([0], [0, 1, 2])), (fork, [4], _queries([0], [2])),
         (b, [5, 6, 7], _queries([0, 2], [1])))  # decodes beside a 3-token draft
    if in_pass:
        assert calls, "the kernel scored nothing"
    return answers


@pytest.mark.parametrize("kv", ["fp32", "int8", "bf16"])
def test_scores_in_the_pass_equal_the_second_pass(kv, monkeypatch):
    with monkeypatch.context() as m:
        got = _run(kv, True, m)
    with monkeypatch.context() as m:
        want = _run(kv, False, m)
    for g_step, w_step in zip(got, want, strict=True):
        for g, w in zip(g_step, w_step, strict=True):
            assert g.shape == w.shape
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_a_too_short_score_buffer_is_refused():
    ops = kernels.ops()
    q = torch.randn(2, 4, 16)
    pool = torch.randn(2, 16, 1, 2, 2, 16)
    tables = torch.tensor([[0, 1]], dtype=torch.int32)
    starts = torch.tensor([0, 2], dtype=torch.int32)
    cached = torch.tensor([20], dtype=torch.int32)  # 22 keys
    with pytest.raises(RuntimeError, match="keys past its length"):
        ops.paged_attention_scored(q, pool, 0, tables, starts, cached, 0.25,
                                   torch.tensor([0, -1]), torch.empty(1, 4, 21))
