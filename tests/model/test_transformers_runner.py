"""TransformersRunner on its own: ragged batches in one model call, the refusals it makes
before writing anything, and the batching check at load (docs/models.md)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pie_ctx.proto.errors import InvalidArgument, ModelError
from runtime.kv.pool import PagePool, PoolShape
from runtime.model.batch import SeqInput
from runtime.model.transformers_backend import TransformersRunner, load_transformers_model
from tests.model.transformers_fixtures import POSITIONS, make_model, write_folder

PAGE = 4


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory) -> tuple[torch.nn.Module, Path]:
    model = make_model("gemma2")
    return model, write_folder(model, tmp_path_factory.mktemp("gemma2") / "m")


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory) -> tuple[torch.nn.Module, Path]:
    model = make_model("gpt2")
    return model, write_folder(model, tmp_path_factory.mktemp("gpt2") / "m")


def _runner(folder: Path, num_pages: int = 32) -> TransformersRunner:
    m = load_transformers_model(str(folder), progress=False)
    pool = PagePool(PoolShape(num_pages, PAGE, m.num_layers, m.num_kv_heads, m.head_dim))
    return TransformersRunner(m, pool.kv, PAGE)


def _seq(tokens: list[int], first_page: int, num_cached: int = 0) -> SeqInput:
    kv = num_cached + len(tokens)
    pages = list(range(first_page, first_page + -(-kv // PAGE)))
    return SeqInput(tokens, list(range(num_cached, kv)), pages, num_cached,
                    list(range(len(tokens))))


def test_ragged_batch_is_one_model_call(gemma2) -> None:
    """Two contexts of different lengths (one past the sliding window, one not), prefill
    then decode, each in one call of the model; each row equals transformers alone."""
    model, folder = gemma2
    runner = _runner(folder)
    calls = []
    hook = runner.model.module.register_forward_hook(lambda *_: calls.append(1))
    a, b = list(range(30, 49)), list(range(60, 65))  # 19 and 5 tokens
    try:
        prefill = runner.forward([_seq(a, 0), _seq(b, 10)])
        decode = runner.forward([_seq([7], 0, len(a)), _seq([8], 10, len(b))])
    finally:
        hook.remove()
    assert len(calls) == 2
    with torch.no_grad():
        want_a = model(torch.tensor([a + [7]])).logits[0]
        want_b = model(torch.tensor([b + [8]])).logits[0]
    got_a = torch.cat([prefill[:19], decode[:1]])
    got_b = torch.cat([prefill[19:], decode[1:]])
    assert (got_a - want_a).abs().max() <= 1e-4
    assert (got_b - want_b).abs().max() <= 1e-4


def test_positions_outside_a_learned_table_are_refused_before_writing(gpt2) -> None:
    _, folder = gpt2
    runner = _runner(folder)
    assert runner.model.position_table == POSITIONS
    before = runner.pool_kv.clone()
    with pytest.raises(InvalidArgument, match="learned absolute positions 0..63; position 64"):
        runner.forward([SeqInput([5, 6], [63, 64], [0], 0, [1])])
    with pytest.raises(InvalidArgument, match="position -1"):
        runner.forward([SeqInput([5], [-1], [0], 0, [0])])
    assert torch.equal(runner.pool_kv, before)
    with pytest.raises(InvalidArgument, match="native backend only"):
        runner.load_adapter("a", str(folder))


def test_a_model_that_ignores_position_ids_is_refused_at_load(gpt2) -> None:
    """The load-time check: a context's logits may not depend on its batch neighbours."""
    _, folder = gpt2
    m = load_transformers_model(str(folder), progress=False)
    forward = m.module.forward

    def positions_from_layout(**kw):  # what a model deriving positions from arange does
        kw.pop("position_ids", None)
        return forward(**kw)

    m.module.forward = positions_from_layout
    pool = PagePool(PoolShape(8, PAGE, m.num_layers, m.num_kv_heads, m.head_dim))
    with pytest.raises(ModelError, match="change by .* when another context shares"):
        TransformersRunner(m, pool.kv, PAGE)


def test_a_pool_of_another_shape_is_refused(gemma2) -> None:
    _, folder = gemma2
    m = load_transformers_model(str(folder), progress=False)
    pool = PagePool(PoolShape(8, PAGE, m.num_layers, m.num_kv_heads + 1, m.head_dim))
    with pytest.raises(InvalidArgument, match="does not fit the model"):
        TransformersRunner(m, pool.kv, PAGE)


def test_int8_pages_stay_close_to_fp32(gemma2) -> None:
    """The int8 page format works under the transformers backend as under the native one."""
    model, folder = gemma2
    m = load_transformers_model(str(folder), progress=False)
    fp32 = TransformersRunner(m, PagePool(PoolShape(16, PAGE, m.num_layers, m.num_kv_heads,
                                          m.head_dim)).kv, PAGE)
    int8 = TransformersRunner(m, PagePool(PoolShape(16, PAGE, m.num_layers, m.num_kv_heads, m.head_dim,
                                          kv_dtype="int8")).kv, PAGE)
    tokens = list(range(30, 50))
    got, want = int8.forward([_seq(tokens, 0)]), fp32.forward([_seq(tokens, 0)])
    assert (got - want).abs().max() <= 0.05 * want.abs().max()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_precision_follows_transformers(gemma2, gpt2, dtype) -> None:
    """Half precision: the eager path (Gemma 2's soft-cap) matches transformers' eager
    attention exactly; the backend path (GPT-2) within half-precision rounding."""
    from transformers import AutoModelForCausalLM

    tokens = list(range(40, 60))
    for (_, folder), tol in ((gemma2, 0.0), (gpt2, 0.02)):
        m = load_transformers_model(str(folder), dtype=dtype, progress=False)
        runner = TransformersRunner(m, PagePool(PoolShape(16, PAGE, m.num_layers, m.num_kv_heads,
                                                m.head_dim, dtype=dtype)).kv, PAGE)
        got = runner.forward([_seq(tokens, 0)])
        oracle = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype,
                                                      attn_implementation="eager").eval()
        with torch.no_grad():
            want = oracle(torch.tensor([tokens])).logits[0].float()
        assert (got - want).abs().max() <= tol * want.abs().max()
