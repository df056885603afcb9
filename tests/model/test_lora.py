"""LoRA adapters in the model runner vs peft's PeftModel on HF transformers (the oracle)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lora_fixtures import ALL_TARGETS, edit_config, make_adapter
from tiny_models import PagedSeq, config_of, free_list, make_hf_model, make_runner, random_tokens

from pie_ctx.errors import InvalidArgument, ModelError
from runtime.kv.pool import PagePool, PoolShape
from runtime.model.runner import ModelRunner

TOL = 1e-4

pytest.importorskip("peft")


@pytest.fixture(autouse=True)
def eager_deltas(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests hold the eager deltas (fp32 adapter weights) to peft at ``TOL``; the
    fused decode step's bf16 deltas are held to these in tests/model/test_fused_step.py."""
    from runtime.model import fused_step

    monkeypatch.setattr(fused_step, "ENABLED", False)


@pytest.fixture(scope="module", params=["llama3", "qwen2", "qwen3"])
def hf_model(request: pytest.FixtureRequest) -> torch.nn.Module:
    return make_hf_model(request.param, seed=1)


def _oracle(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0]


def test_prompt_and_decode_match_peft(hf_model: torch.nn.Module, tmp_path: Path) -> None:
    oracle = make_adapter(hf_model, tmp_path / "a", rank=8, alpha=16, seed=2)
    runner = make_runner(hf_model)
    adapter = runner.load_adapter("a", str(tmp_path / "a"))
    assert adapter.rank == 8 and adapter.targets == ALL_TARGETS
    tokens = random_tokens(37, seed=3)
    seq = PagedSeq(runner, free_list(runner))
    step = seq.step(tokens[:30])
    step.adapter = adapter.key
    ours = runner.forward([step])
    seq.advance(30)
    for t in range(30, 37):  # decode one token at a time
        step = seq.step([tokens[t]])
        step.adapter = adapter.key
        ours = torch.cat([ours, runner.forward([step])])
        seq.advance(1)
    ref = _oracle(oracle, tokens)
    base = _oracle(hf_model, tokens)
    assert (ref - base).abs().max().item() > 0.1  # the adapter changes the logits
    assert (ours - ref).abs().max().item() <= TOL


def test_two_adapters_and_base_in_one_call(hf_model: torch.nn.Module, tmp_path: Path) -> None:
    oracles = [make_adapter(hf_model, tmp_path / "a", rank=4, alpha=8, seed=5),
               make_adapter(hf_model, tmp_path / "b", rank=16, alpha=16, seed=6,
                            targets=["q_proj", "v_proj", "down_proj"])]
    runner = make_runner(hf_model, num_pages=128)
    keys = [runner.load_adapter("a", str(tmp_path / "a")).key,
            runner.load_adapter("b", str(tmp_path / "b")).key]
    free = free_list(runner)
    prompts = [random_tokens(13 + i, seed=10 + i) for i in range(5)]
    # rows interleaved: a, base, b, a, b -- adapter a's rows are not contiguous
    which = [0, None, 1, 0, 1]
    seqs = [PagedSeq(runner, free) for _ in prompts]
    steps = []
    for seq, prompt, w in zip(seqs, prompts, which, strict=True):
        step = seq.step(prompt)
        step.adapter = 0 if w is None else keys[w]
        steps.append(step)
    out = runner.forward(steps)  # 75 rows: adapter by adapter
    start = 0
    for prompt, w in zip(prompts, which, strict=True):
        ref = _oracle(hf_model if w is None else oracles[w], prompt)
        got = out[start:start + len(prompt)]
        start += len(prompt)
        assert (got - ref).abs().max().item() <= TOL
    # one decode step of all five: few rows, so the adapters run side by side
    for seq, prompt in zip(seqs, prompts, strict=True):
        seq.advance(len(prompt))
    nxt = [7, 8, 9, 10, 11]
    steps = []
    for seq, t, w in zip(seqs, nxt, which, strict=True):
        step = seq.step([t])
        step.adapter = 0 if w is None else keys[w]
        steps.append(step)
    out = runner.forward(steps)
    assert len(runner._stacks) == 1
    for row, (prompt, t, w) in enumerate(zip(prompts, nxt, which, strict=True)):
        ref = _oracle(hf_model if w is None else oracles[w], prompt + [t])[-1]
        assert (out[row] - ref).abs().max().item() <= TOL


def test_bf16_and_int8_follow_the_oracle(tmp_path: Path) -> None:
    hf = make_hf_model("llama3", seed=1)
    oracle = make_adapter(hf, tmp_path / "a", rank=8, seed=2)
    tokens = random_tokens(24, seed=3)
    ref, base_ref = _oracle(oracle, tokens), _oracle(hf, tokens)
    cfg = config_of(hf)
    # bf16: within bf16 rounding of the fp32 oracle
    pool = PagePool(PoolShape(64, 16, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype=torch.bfloat16))
    runner = ModelRunner(cfg, hf.state_dict(), pool.kv, 16)
    key = runner.load_adapter("a", str(tmp_path / "a")).key
    step = PagedSeq(runner, free_list(runner)).step(tokens)
    step.adapter = key
    got = runner.forward([step])
    assert (got - ref).abs().max().item() <= 0.05 * ref.abs().max().item()
    # int8 weights: the adapter costs no more precision than int8 costs the base model
    pool = PagePool(PoolShape(64, 16, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim))
    runner = ModelRunner(cfg, hf.state_dict(), pool.kv, 16, weight_format="int8",
                         calibration=random_tokens(64, seed=9))
    key = runner.load_adapter("a", str(tmp_path / "a")).key
    base = runner.forward([PagedSeq(runner, free_list(runner)).step(tokens)])
    step = PagedSeq(runner, free_list(runner, seed=1)).step(tokens)
    step.adapter = key
    got = runner.forward([step])
    base_err = (base - base_ref).abs().max().item()
    assert (got - ref).abs().max().item() <= 2 * base_err + 1e-3


def test_unknown_adapter_key_is_refused(tmp_path: Path) -> None:
    runner = make_runner(make_hf_model("llama3", seed=1))
    step = PagedSeq(runner, free_list(runner)).step([1, 2, 3])
    step.adapter = 1234
    with pytest.raises(InvalidArgument, match="not loaded"):
        runner.forward([step])


def test_same_weights_same_key_other_weights_other_key(tmp_path: Path) -> None:
    hf = make_hf_model("llama3", seed=1)
    make_adapter(hf, tmp_path / "a", seed=2)
    make_adapter(hf, tmp_path / "b", seed=3)
    runner = make_runner(hf)
    a = runner.load_adapter("a", str(tmp_path / "a"))
    a2 = runner.load_adapter("a2", str(tmp_path / "a"))
    b = runner.load_adapter("b", str(tmp_path / "b"))
    assert a.key == a2.key != b.key and 0 not in (a.key, b.key)
    with pytest.raises(InvalidArgument, match="already loaded"):
        runner.load_adapter("a", str(tmp_path / "b"))
    runner.unload_adapter("a")
    assert runner.has_adapter_key(a.key)  # a2 still uses the weights
    runner.unload_adapter("a2")
    assert not runner.has_adapter_key(a.key)


# ------------------------------------------------------------------------ refusals


@pytest.fixture(scope="module")
def tiny_llama() -> torch.nn.Module:
    return make_hf_model("llama3", seed=1)


def _refused(hf: torch.nn.Module, folder: Path, match: str) -> None:
    runner = make_runner(hf)
    with pytest.raises(ModelError, match=match):
        runner.load_adapter("x", str(folder), model_name="tiny-llama")
    assert runner.adapters == {}


def test_refuses_missing_folder_and_files(tiny_llama: torch.nn.Module, tmp_path: Path) -> None:
    _refused(tiny_llama, tmp_path / "nope", "does not exist")
    (tmp_path / "empty").mkdir()
    _refused(tiny_llama, tmp_path / "empty", "adapter_config.json is missing")
    make_adapter(tiny_llama, tmp_path / "a")
    (tmp_path / "a" / "adapter_model.safetensors").unlink()
    _refused(tiny_llama, tmp_path / "a", "adapter_model.safetensors is missing")
    make_adapter(tiny_llama, tmp_path / "b")
    (tmp_path / "b" / "adapter_model.safetensors").write_bytes(b"garbage")
    _refused(tiny_llama, tmp_path / "b", "could not be read")


def test_refuses_dora_bias_embedding_and_more(tiny_llama: torch.nn.Module,
                                              tmp_path: Path) -> None:
    make_adapter(tiny_llama, tmp_path / "dora", use_dora=True)
    _refused(tiny_llama, tmp_path / "dora", "DoRA")
    make_adapter(tiny_llama, tmp_path / "bias", bias="lora_only")
    _refused(tiny_llama, tmp_path / "bias", "biases")
    make_adapter(tiny_llama, tmp_path / "emb", targets=["q_proj", "embed_tokens"])
    _refused(tiny_llama, tmp_path / "emb", "embedding LoRA")
    make_adapter(tiny_llama, tmp_path / "save", modules_to_save=["lm_head"])
    _refused(tiny_llama, tmp_path / "save", "modules_to_save")
    make_adapter(tiny_llama, tmp_path / "ok")
    edit_config(tmp_path / "ok", use_dora=False)  # still fine
    make_runner(tiny_llama).load_adapter("ok", str(tmp_path / "ok"))
    edit_config(tmp_path / "ok", peft_type="IA3")
    _refused(tiny_llama, tmp_path / "ok", "only LoRA")


def test_refuses_another_base_model(tiny_llama: torch.nn.Module, tmp_path: Path) -> None:
    other = make_hf_model("qwen3", seed=1)  # other head_dim: other q/k/v shapes
    make_adapter(other, tmp_path / "other")
    edit_config(tmp_path / "other", base_model_name_or_path="")
    _refused(tiny_llama, tmp_path / "other", "another base model")
    make_adapter(tiny_llama, tmp_path / "named")
    edit_config(tmp_path / "named", base_model_name_or_path="Qwen/Qwen3-0.6B")
    _refused(tiny_llama, tmp_path / "named", "trained on 'Qwen/Qwen3-0.6B'")
    edit_config(tmp_path / "named", base_model_name_or_path="/models/Tiny-Llama/")
    make_runner(tiny_llama).load_adapter("x", str(tmp_path / "named"), model_name="tiny-llama")
