"""The architectures people download as GGUF, each from a tiny random file written as
llama.cpp writes it (tests/model/gguf_arch_fixtures.py): which runner runs it by default,
its logits against transformers' forward on the file's weights, and the tool format its
own chat template selects (docs/models.md, "GGUF architectures")."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from pie_ctx import Context, Runtime, Sampler
from pie_ctx.proto.errors import ModelError
from pie_ctx.tools.formats import tool_format
from runtime.boot import choose_backend, default_weights
from runtime.kv.pool import PagePool, PoolShape
from runtime.model.batch import SeqInput
from runtime.model.config import ModelConfig
from runtime.model.loader import load_blocks, load_model
from runtime.model.runner import ModelRunner
from runtime.model.transformers_backend import TransformersRunner, load_transformers_model
from tests.model.gguf_arch_fixtures import (
    NATIVE_CASES,
    TRANSFORMERS_CASES,
    case,
    make_model,
    write_gguf,
)

PAGE = 8
TOOLS = {"qwen2.5": "hermes", "qwen3": "hermes"}  # every other template: generic
# transformers' own GGUF reader gets these files right, so it is checked too. The others it
# reads wrong or not at all: Llama 3's rope_freqs (ignored), Qwen3's head_dim (misread), a
# file whose name says Mistral (refused), Phi-3.5/4-mini's LongRoPE and partial rotary and
# Gemma 3's linear rope scaling (ignored; pie-ctx writes them back: gguf_transformers.py).
HF_READS = ("qwen2.5", "phi3", "gemma2", "gemma3")


def _write(name: str, folder: Path) -> tuple[torch.nn.Module, Path]:
    c = case(name)
    model = make_model(c)
    return model, write_gguf(c, model, folder / f"{name}.gguf")


def _tokens(n: int, vocab: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(1)).tolist()


def _paged(forward: object, tokens: list[int], split: int) -> torch.Tensor:
    """Logits of every token: a prefill of ``tokens[:split]``, then one token a step."""
    out = [forward([SeqInput(tokens[:split], list(range(split)), [0, 1, 2, 3], 0,
                             list(range(split)))])]  # type: ignore[operator]
    for i in range(split, len(tokens)):
        out.append(forward([SeqInput([tokens[i]], [i], [0, 1, 2, 3], i, [0])]))  # type: ignore[operator]
    return torch.cat(out)


@pytest.mark.parametrize("name", NATIVE_CASES)
def test_native_runner_matches_transformers(name: str, tmp_path: Path) -> None:
    """Llama 3.x, Qwen2.5, Qwen3, Mistral and Phi-3 GGUFs run on the native runner by
    default, their logits equal to transformers' on the file's weights."""
    model, path = _write(name, tmp_path)
    assert choose_backend("auto", str(path), progress=False) == "native"
    loaded = load_model(path, device="cpu", progress=False)
    cfg = loaded.config
    pool = PagePool(PoolShape(8, PAGE, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim))
    runner = ModelRunner(cfg, loaded.weights, pool.kv, PAGE)
    tokens = _tokens(24, cfg.vocab_size)
    got = _paged(runner.forward, tokens, 17)
    with torch.no_grad():
        want = model(torch.tensor([tokens])).logits[0]
    assert want.abs().max() > 1.0  # logits of a size where a slip shows
    assert (got - want).abs().max().item() <= 1e-4
    if name in HF_READS:  # transformers reading the same file agrees
        hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name,
                                                  dtype=torch.float32).eval()
        with torch.no_grad():
            assert (hf(torch.tensor([tokens])).logits[0] - got).abs().max().item() <= 1e-4


def test_llama3_rope_scaling_and_tying_come_from_the_file(tmp_path: Path) -> None:
    _, path = _write("llama3.2", tmp_path)
    cfg = load_model(path, device="cpu", progress=False).config
    assert cfg.tie_word_embeddings and cfg.rope_scaling == {
        "rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}
    _, path = _write("llama3.1", tmp_path)
    cfg = load_model(path, device="cpu", progress=False).config
    assert not cfg.tie_word_embeddings and cfg.rope_scaling["factor"] == 8.0


def test_qwen_bias_and_norms_are_read(tmp_path: Path) -> None:
    _, path = _write("qwen2.5", tmp_path)
    assert load_model(path, device="cpu", progress=False).config.attention_bias
    _, path = _write("qwen3", tmp_path)
    cfg = load_model(path, device="cpu", progress=False).config
    assert cfg.qk_norm and cfg.head_dim == 32 and cfg.hidden_size // cfg.num_heads == 16


@pytest.mark.parametrize("name", NATIVE_CASES + TRANSFORMERS_CASES)
def test_tool_format_and_chat_come_from_the_files_template(name: str, tmp_path: Path) -> None:
    _, path = _write(name, tmp_path)
    loaded = load_model(path, device="cpu", progress=False) if name in NATIVE_CASES else \
        load_transformers_model(str(path), progress=False)
    tok = loaded.tokenizer
    assert tool_format(tok).name == TOOLS.get(name, "generic")
    ids = tok.encode_chat([{"role": "user", "content": "hello"}], add_generation_prompt=True)
    text = tok.decode(ids, skip_special_tokens=False)
    assert "hello" in text
    control = {"llama3.2": "<|start_header_id|>", "llama3.1": "<|start_header_id|>",
               "qwen2.5": "<|im_start|>", "qwen3": "<|im_start|>", "mistral": "[INST]",
               "phi3": "<|user|>", "phi3-4k": "<|user|>", "phi3.5": "<|user|>",
               "phi4-mini": "<|user|>"}.get(
        name, "<start_of_turn>")
    assert control in text
    marker = tok.backend.token_to_id(control)
    assert marker is None or marker in ids  # a control token stays one token


@pytest.mark.parametrize("name", TRANSFORMERS_CASES)
def test_the_rest_runs_on_the_transformers_backend(name: str, tmp_path: Path) -> None:
    """Gemma 2/3 and Phi-3 with a sliding window, LongRoPE or partial rotary GGUFs: routed to the
    transformers backend (the file dequantized), paged logits equal to transformers' forward
    of the model the file holds (its rope settings included)."""
    model, path = _write(name, tmp_path)
    assert choose_backend("auto", str(path), progress=False) == "transformers"
    assert default_weights("transformers", str(path), "cpu", 1, progress=False) == "fp32"
    m = load_transformers_model(str(path), progress=False)
    pool = PagePool(PoolShape(8, PAGE, m.num_layers, m.num_kv_heads, m.head_dim))
    runner = TransformersRunner(m, pool.kv, PAGE)
    tokens = _tokens(20, m.vocab_size)
    got = _paged(runner.forward, tokens, 13)  # past the windows of 8
    with torch.no_grad():
        want = model(torch.tensor([tokens])).logits[0]
    assert (got - want).abs().max().item() <= 1e-4
    with pytest.raises(ModelError, match="native runner|unsupported"):
        load_model(path, device="cpu", progress=False)


def test_default_weights_read_blocks_only_where_pie_ctx_reads_the_file(tmp_path: Path) -> None:
    """weights='auto' is the file's blocks for a GGUF pie-ctx converted itself; a Phi-3 file
    (converted by transformers) runs its dequantized weights, and asking for its blocks
    says which flag works."""
    _, qwen = _write("qwen2.5", tmp_path)
    assert default_weights("native", str(qwen), "cpu", 1, progress=False) == "gguf"
    assert load_blocks(load_model(qwen, device="cpu", progress=False).path)
    _, phi = _write("phi3", tmp_path)
    assert default_weights("native", str(phi), "cpu", 1, progress=False) == "fp32"
    with pytest.raises(ModelError, match="--weights fp32 or int8"):
        load_blocks(load_model(phi, device="cpu", progress=False).path)


def test_native_config_takes_mistral_and_phi3_only_without_what_it_lacks() -> None:
    """Mistral and Phi-3 configs run native as Llamas; a sliding window shorter than the
    context or partial rotary sends them to the transformers backend (ModelError here,
    which boot's auto choice turns into that backend)."""
    base = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
            "num_hidden_layers": 2, "vocab_size": 300, "intermediate_size": 128,
            "max_position_embeddings": 4096}
    mistral = ModelConfig.from_hf_config(base | {"architectures": ["MistralForCausalLM"],
                                                  "sliding_window": None})
    assert mistral.arch == "llama" and not mistral.attention_bias
    phi = ModelConfig.from_hf_config(base | {"architectures": ["Phi3ForCausalLM"],
                                              "rope_parameters": {"rope_type": "default",
                                                                  "rope_theta": 10000.0,
                                                                  "partial_rotary_factor": 1.0}})
    assert phi.arch == "phi3" and phi.rope_scaling is None
    with pytest.raises(ModelError, match="sliding window of 4096"):
        ModelConfig.from_hf_config(base | {"architectures": ["MistralForCausalLM"],
                                           "sliding_window": 4096,
                                           "max_position_embeddings": 32768})
    with pytest.raises(ModelError, match="sliding window of 2047"):
        ModelConfig.from_hf_config(base | {"architectures": ["Phi3ForCausalLM"],
                                           "sliding_window": 2047})
    with pytest.raises(ModelError, match="partial rotary"):
        ModelConfig.from_hf_config(base | {"architectures": ["Phi3ForCausalLM"],
                                           "partial_rotary_factor": 0.75})


@pytest.mark.parametrize(("name", "backend", "weights"), [
    ("llama3.2", "native", "gguf"), ("qwen3", "native", "gguf"), ("mistral", "native", "gguf"),
    ("phi3", "native", "fp32"), ("gemma2", "transformers", "fp32"),
    ("phi4-mini", "transformers", "fp32")])
async def test_each_file_runs_with_default_options(name: str, backend: str, weights: str,
                                                   tmp_path: Path) -> None:
    """``run``'s defaults (``weights="auto"``, backend auto) on each file: the runner and
    weights chosen, a chat turn rendered by the file's template and generated from."""
    _, path = _write(name, tmp_path)
    async with Runtime.local(str(path), weights="auto", page_size=PAGE, num_pages=96) as rt:
        assert (rt.info.backend, rt.info.weights) == (backend, weights)
        ctx = Context(rt).user("hello").cue()
        tokens = await ctx.generate(Sampler.greedy(), max_tokens=6, ignore_eos=True).tokens()
        assert len(tokens) == 6 and all(0 <= t < len(case(name).vocab.tokens) for t in tokens)
