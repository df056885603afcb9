"""GGUF loading on tiny synthetic files: names, Q/K permutation, dequantization, config,
conversion cache (reuse, corruption, concurrent converters) and error messages."""

from __future__ import annotations

import multiprocessing as mp
import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from loader_fixtures import (
    HEAD_DIM,
    HEADS,
    KV_HEADS,
    QUANTIZED,
    gguf_name,
    hf_reference_weights,
    q8_roundtrip,
    write_tiny_gguf,
)

from pie_ctx.errors import ModelError
from runtime.model.loader import convert, list_cached_models, load_model
from runtime.model.loader.gguf_file import GGUFModel, hf_tensor_name, permute_qk, unpermute_qk


@pytest.fixture(autouse=True)
def _tmp_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PIE_CTX_CACHE", str(tmp_path / "cache"))


def _expected(hf: dict[str, np.ndarray], name: str) -> np.ndarray:
    return q8_roundtrip(hf[name]) if gguf_name(name).endswith(QUANTIZED) else hf[name]


def test_permute_matches_llama_cpp_row_order() -> None:
    # llama.cpp interleaves each head's rotary halves: GGUF row h*d+2i <- HF row h*d+i,
    # GGUF row h*d+2i+1 <- HF row h*d+d/2+i.
    d, n_head = 8, 3
    hf = np.arange(n_head * d, dtype=np.float32)[:, None] * np.ones((1, 5), np.float32)
    g = permute_qk(hf, n_head)
    for h in range(n_head):
        for i in range(d // 2):
            assert g[h * d + 2 * i, 0] == hf[h * d + i, 0]
            assert g[h * d + 2 * i + 1, 0] == hf[h * d + d // 2 + i, 0]
    np.testing.assert_array_equal(unpermute_qk(g, n_head), hf)


@pytest.mark.parametrize("n_head,rows", [(4, 64), (2, 32), (1, 16)])
def test_unpermute_inverts_permute(n_head: int, rows: int) -> None:
    w = np.random.default_rng(1).standard_normal((rows, 7)).astype(np.float32)
    np.testing.assert_array_equal(unpermute_qk(permute_qk(w, n_head), n_head), w)
    b = w[:, 0].copy()  # biases permute the same way
    np.testing.assert_array_equal(unpermute_qk(permute_qk(b, n_head), n_head), b)


def test_tensor_name_mapping() -> None:
    assert hf_tensor_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_tensor_name("blk.12.attn_q.bias") == "model.layers.12.self_attn.q_proj.bias"
    assert hf_tensor_name("blk.3.attn_k_norm.weight") == "model.layers.3.self_attn.k_norm.weight"
    assert hf_tensor_name("blk.0.ffn_down.weight") == "model.layers.0.mlp.down_proj.weight"
    assert hf_tensor_name("rope_freqs.weight") is None
    with pytest.raises(ModelError, match="blk.0.ffn_gate_exps.weight"):
        hf_tensor_name("blk.0.ffn_gate_exps.weight")


def test_gguf_tensors_equal_reference_after_unpermute(tmp_path: Path) -> None:
    hf = hf_reference_weights(seed=0, tied=True)
    model = GGUFModel(write_tiny_gguf(tmp_path / "tiny.gguf", hf))
    got = dict(model.iter_tensors())
    assert set(got) == set(hf)
    for name in hf:
        np.testing.assert_array_equal(got[name], _expected(hf, name), err_msg=name)
    # The quantized K really went through Q8_0 (not stored as f32 by accident).
    assert not np.array_equal(got["model.layers.0.self_attn.k_proj.weight"],
                              hf["model.layers.0.self_attn.k_proj.weight"])


def test_config_from_metadata(tmp_path: Path) -> None:
    hf = hf_reference_weights(tied=False)
    cfg = GGUFModel(write_tiny_gguf(tmp_path / "t.gguf", hf)).config
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"],
            cfg["num_key_value_heads"], cfg["head_dim"]) == (64, 2, HEADS, KV_HEADS, HEAD_DIM)
    assert cfg["vocab_size"] == hf["model.embed_tokens.weight"].shape[0]
    assert cfg["rope_theta"] == 50000.0 and cfg["max_position_embeddings"] == 256
    assert cfg["tie_word_embeddings"] is False and cfg["attention_bias"] is False
    assert cfg["rms_norm_eps"] == pytest.approx(1e-5)


def test_qwen2_is_not_permuted_and_has_bias(tmp_path: Path) -> None:
    hf = hf_reference_weights(seed=2, qkv_bias=True)
    model = GGUFModel(write_tiny_gguf(tmp_path / "q.gguf", hf, arch="qwen2"))
    assert model.config["architectures"] == ["Qwen2ForCausalLM"]
    assert model.config["attention_bias"] is True
    got = dict(model.iter_tensors())
    for name in ("model.layers.1.self_attn.q_proj.weight", "model.layers.1.self_attn.q_proj.bias"):
        np.testing.assert_array_equal(got[name], _expected(hf, name))


def test_load_model_from_gguf_converts_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hf = hf_reference_weights(seed=3)
    path = write_tiny_gguf(tmp_path / "tiny.gguf", hf)
    loaded = load_model(path, device="cpu", progress=False)
    assert loaded.name == "tiny" and loaded.config.tie_word_embeddings
    assert loaded.weights["model.norm.weight"].dtype == torch.float32
    np.testing.assert_array_equal(loaded.weights["model.layers.1.self_attn.q_proj.weight"].numpy(),
                                  hf["model.layers.1.self_attn.q_proj.weight"])
    assert loaded.tokenizer.encode("hello world") == [loaded.tokenizer.backend.token_to_id("hello"),
                                                      loaded.tokenizer.backend.token_to_id("Ġwo"),
                                                      *loaded.tokenizer.encode("rld")]
    assert [m.name for m in list_cached_models()] == [loaded.path.name]

    def no_convert(*args: object, **kwargs: object) -> None:
        raise AssertionError("second load must reuse the converted folder")

    monkeypatch.setattr(convert, "convert_gguf", no_convert)
    again = load_model(path, dtype="bf16", progress=False)
    assert again.path == loaded.path
    assert again.weights["model.norm.weight"].dtype == torch.bfloat16


def test_truncated_gguf_names_file(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "bad.gguf", hf_reference_weights())
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 3])
    with pytest.raises(ModelError, match=r"bad\.gguf.*(corrupt|truncated)"):
        load_model(path, progress=False)
    assert list_cached_models() == []  # nothing half-written was published


def test_unsupported_architecture(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "phi.gguf", hf_reference_weights(), arch="phi2")
    with pytest.raises(ModelError, match="phi2.*unsupported"):
        GGUFModel(path)


def test_missing_file_and_non_gguf(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="not found"):
        load_model(tmp_path / "nope.gguf", progress=False)
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ModelError, match="not a .gguf"):
        load_model(tmp_path / "weights.bin", progress=False)


def _convert_in_child(path: str, cache_dir: str) -> str:
    os.environ["PIE_CTX_CACHE"] = cache_dir
    folder = convert.ensure_converted(Path(path), "race", progress=False)
    return str(folder)


def test_concurrent_conversions_publish_one_complete_folder(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "tiny.gguf", hf_reference_weights())
    cache_dir = str(tmp_path / "cache")
    ctx = mp.get_context("spawn")
    with ctx.Pool(2) as pool:
        folders = pool.starmap(_convert_in_child, [(str(path), cache_dir)] * 2)
    assert folders[0] == folders[1]
    entries = sorted(p.name for p in (tmp_path / "cache" / "models").iterdir())
    assert entries == ["race"]  # no staging leftovers
    loaded = load_model(folders[0], progress=False)
    assert loaded.config.num_layers == 2


def test_gguf_writer_quantized_tensor_is_q8(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "t.gguf", hf_reference_weights())
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(path).tensors}
    assert types["blk.0.attn_k.weight"] == gguf.GGMLQuantizationType.Q8_0
    assert types["blk.0.attn_q.weight"] == gguf.GGMLQuantizationType.F32


def _llama3_freq_factors(factor: float) -> np.ndarray:
    """llama.cpp's rope_freqs for our tiny config, derived from transformers' llama3 rope."""
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = transformers.LlamaConfig(
        hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS, rope_theta=50000.0,
        max_position_embeddings=16384,
        rope_scaling={"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    plain = 1.0 / 50000.0 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM)
    return (plain / inv_freq.double()).numpy().astype(np.float32)


def test_llama3_rope_scaling_recovered_from_rope_freqs(tmp_path: Path) -> None:
    freqs = _llama3_freq_factors(32.0)
    # All three regimes occur: unscaled (1), smoothed (between), fully scaled (factor).
    assert freqs.min() < 1.001 and ((freqs > 1.01) & (freqs < 31.9)).any() and freqs.max() > 31.9
    path = write_tiny_gguf(tmp_path / "l3.gguf", hf_reference_weights(),
                           extra_tensors={"rope_freqs.weight": freqs})
    model = GGUFModel(path)
    assert model.config["rope_scaling"] == {
        "rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}
    assert "rope_freqs" not in " ".join(name for name, _ in model.iter_tensors())


def test_unexplained_rope_freqs_is_refused(tmp_path: Path) -> None:
    freqs = _llama3_freq_factors(8.0)
    freqs[1] *= 1.5
    path = write_tiny_gguf(tmp_path / "odd.gguf", hf_reference_weights(),
                           extra_tensors={"rope_freqs.weight": freqs})
    with pytest.raises(ModelError, match="rope_freqs"):
        GGUFModel(path)
