"""Oracle tests: our paged forward vs HF transformers on random tiny models (fp32)."""

from __future__ import annotations

import pytest
import torch
from tiny_models import (
    ARCHS,
    PagedSeq,
    config_of,
    free_list,
    make_hf_model,
    make_runner,
    random_tokens,
)

from pie_ctx.errors import ModelError
from runtime.model.config import ModelConfig

TOL = 1e-4


@pytest.fixture(scope="module", params=ARCHS)
def hf_model(request: pytest.FixtureRequest) -> torch.nn.Module:
    return make_hf_model(request.param, seed=1)


def test_config_fields(hf_model: torch.nn.Module) -> None:
    cfg = config_of(hf_model)
    arch = type(hf_model).__name__
    assert cfg.num_layers == hf_model.config.num_hidden_layers
    assert cfg.qk_norm == (arch == "Qwen3ForCausalLM")
    assert cfg.attention_bias == (arch == "Qwen2ForCausalLM")
    if arch == "Qwen3ForCausalLM":
        assert cfg.head_dim == 32


def test_prompt_logits_match_hf(hf_model: torch.nn.Module) -> None:
    runner = make_runner(hf_model, page_size=16)
    tokens = random_tokens(45, seed=2)
    ours = PagedSeq(runner, free_list(runner)).run(tokens)  # [45, V]
    with torch.no_grad():
        ref = hf_model(torch.tensor([tokens])).logits[0]
    assert ref.std() > 0.5  # weights scaled so logits are O(1)
    assert (ours - ref).abs().max().item() <= TOL


def test_arbitrary_positions_match_hf(hf_model: torch.nn.Module) -> None:
    runner = make_runner(hf_model, page_size=16)
    tokens = random_tokens(20, seed=3)
    positions = [5, 6, 7, 40, 41, 41, 3, 100, 101, 102] + list(range(200, 210))
    ours = PagedSeq(runner, free_list(runner)).run(tokens, positions=positions)
    with torch.no_grad():
        ref = hf_model(torch.tensor([tokens]), position_ids=torch.tensor([positions])).logits[0]
    assert (ours - ref).abs().max().item() <= TOL


def test_greedy_32_tokens_identical(hf_model: torch.nn.Module) -> None:
    runner = make_runner(hf_model, page_size=16)
    prompt = random_tokens(11, seed=4)
    seq = PagedSeq(runner, free_list(runner))
    logits = seq.run(prompt, logits=[len(prompt) - 1])  # [1, V]
    ours: list[int] = []
    for _ in range(32):
        tok = int(logits[-1].argmax())
        ours.append(tok)
        logits = seq.run([tok])
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=32,
                                min_new_tokens=32)
    assert ours == out[0, len(prompt):].tolist()


def test_prefill_returns_only_requested_rows(hf_model: torch.nn.Module) -> None:
    runner = make_runner(hf_model, page_size=16)
    tokens = random_tokens(30, seed=5)
    rows = PagedSeq(runner, free_list(runner)).run(tokens, logits=[29, 3])
    with torch.no_grad():
        ref = hf_model(torch.tensor([tokens])).logits[0]
    assert rows.shape == (2, config_of(hf_model).vocab_size)
    assert (rows - ref[[29, 3]]).abs().max().item() <= TOL


def test_unsupported_architecture_raises() -> None:
    with pytest.raises(ModelError, match="LlamaForCausalLM"):
        ModelConfig.from_hf_config({"architectures": ["GPT2LMHeadModel"], "hidden_size": 8})
    with pytest.raises(ModelError, match="rope scaling"):
        ModelConfig.from_hf_config({
            "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
            "num_hidden_layers": 1, "vocab_size": 10, "intermediate_size": 8,
            "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})


def test_transformers4_layout_config() -> None:
    cfg = ModelConfig.from_hf_config({
        "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": 1, "num_hidden_layers": 2, "vocab_size": 10,
        "intermediate_size": 8, "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        "tie_word_embeddings": True})
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling is not None
    assert cfg.rope_scaling["rope_type"] == "llama3" and cfg.num_queries_per_kv == 4
    assert cfg.tie_word_embeddings


def test_a_decodes_rotary_lookup_is_the_tables_rows() -> None:
    """A few positions (a decode step's) are looked up without tensor ops: the same bits as
    the general lookup, for one position, a run, scattered positions and a block edge."""
    from runtime.model.rope import RotaryEmbedding

    rot = RotaryEmbedding(config_of(make_hf_model("llama3")), torch.device("cpu"))
    many = torch.arange(0, 300, dtype=torch.int64)
    cos_all, sin_all = rot.cos_sin(many, torch.float32)  # 300 positions: the general path
    for ps in ([5], [200, 201, 202], [70, 3, 70, 100], [63, 64], [299]):
        cos, sin = rot.cos_sin(torch.tensor(ps), torch.float32)
        assert torch.equal(cos, cos_all[ps]) and torch.equal(sin, sin_all[ps])
        assert cos.is_contiguous() and cos.shape == (len(ps), 1, cos_all.shape[-1])
