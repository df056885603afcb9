"""HF checkpoint folders: config, (sharded) safetensors, tokenizer files, dtype/device
arguments, and the error raised for each missing or corrupt file."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from loader_fixtures import hf_reference_weights, write_tiny_hf_folder

from pie_ctx.errors import InvalidArgument, ModelError
from runtime.model.loader import cache, load_model
from runtime.model.loader.default import DEFAULT_NAME


@pytest.fixture(autouse=True)
def _tmp_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PIE_CTX_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PIE_CTX_DEFAULT_WHEEL", str(tmp_path / "no-network.whl"))


@pytest.fixture
def hf() -> dict[str, np.ndarray]:
    return hf_reference_weights(seed=5, tied=False)


@pytest.mark.parametrize("shards", [1, 3])
def test_load_folder(tmp_path: Path, hf: dict[str, np.ndarray], shards: int) -> None:
    folder = write_tiny_hf_folder(tmp_path / "m", hf, shards=shards)
    loaded = load_model(folder, device="cpu")
    assert loaded.name == "m" and loaded.path == folder
    assert set(loaded.weights) == set(hf)
    for name, ref in hf.items():
        np.testing.assert_array_equal(loaded.weights[name].numpy(), ref)
    assert loaded.config.arch == "llama" and not loaded.config.tie_word_embeddings
    assert loaded.config_dict["num_hidden_layers"] == 2
    tok = loaded.tokenizer
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)
    assert tok.stop_token_ids == (2, 0)  # eos, then generation_config's extra eos id
    assert tok.decode(tok.encode_chat([{"role": "user", "content": "hello"}])) == \
        "<|im_start|>user\nhello<|im_end|>\n"


@pytest.mark.parametrize("dtype,expected", [("bf16", torch.bfloat16), (torch.float16, torch.float16),
                                            (None, torch.float32)])
def test_dtype_cast(tmp_path: Path, hf: dict[str, np.ndarray], dtype: object, expected: torch.dtype) -> None:
    folder = write_tiny_hf_folder(tmp_path / "m", hf)
    loaded = load_model(folder, dtype=dtype, device="cpu")  # type: ignore[arg-type]
    assert {t.dtype for t in loaded.weights.values()} == {expected}


def test_bad_dtype_and_device(tmp_path: Path, hf: dict[str, np.ndarray]) -> None:
    folder = write_tiny_hf_folder(tmp_path / "m", hf)
    with pytest.raises(InvalidArgument, match="dtype"):
        load_model(folder, dtype="int8")
    with pytest.raises(InvalidArgument, match="device"):
        load_model(folder, device="gpu-please")


@pytest.mark.parametrize("missing", ["config.json", "tokenizer.json", "model-00002-of-00003.safetensors"])
def test_missing_file_is_named(tmp_path: Path, hf: dict[str, np.ndarray], missing: str) -> None:
    folder = write_tiny_hf_folder(tmp_path / "m", hf, shards=3)
    (folder / missing).unlink()
    with pytest.raises(ModelError, match=missing.replace(".", r"\.")):
        load_model(folder)


def test_no_weights_at_all(tmp_path: Path, hf: dict[str, np.ndarray]) -> None:
    folder = write_tiny_hf_folder(tmp_path / "m", hf)
    (folder / "model.safetensors").unlink()
    with pytest.raises(ModelError, match="no \\*.safetensors"):
        load_model(folder)


@pytest.mark.parametrize("victim", ["model.safetensors", "config.json", "tokenizer.json"])
def test_corrupt_file_is_named(tmp_path: Path, hf: dict[str, np.ndarray], victim: str) -> None:
    folder = write_tiny_hf_folder(tmp_path / "m", hf)
    path = folder / victim
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(ModelError, match=rf"{victim.replace('.', '[.]')}.*corrupt"):
        load_model(folder)


def test_unknown_reference() -> None:
    with pytest.raises(ModelError, match="not found.*smollm2-135m"):
        load_model("no-such-model")


def _fake_cached_default(hf: dict[str, np.ndarray], tmp_path: Path) -> Path:
    final = cache.models_dir() / DEFAULT_NAME
    write_tiny_hf_folder(final, hf)
    cache.write_manifest(final, {"converter": 1})
    return final


def test_default_loads_from_cache_without_fetching(tmp_path: Path, hf: dict[str, np.ndarray]) -> None:
    final = _fake_cached_default(hf, tmp_path)
    loaded = load_model("smollm2-135m", progress=False)
    assert loaded.path == final and loaded.name == DEFAULT_NAME


def test_corrupt_cached_default_says_what_to_do(tmp_path: Path, hf: dict[str, np.ndarray]) -> None:
    final = _fake_cached_default(hf, tmp_path)
    st = final / "model.safetensors"
    st.write_bytes(st.read_bytes()[:100])
    with pytest.raises(ModelError, match=r"model\.safetensors.*pie-ctx models pull --force"):
        load_model(None, progress=False)
    st.unlink()
    with pytest.raises(ModelError, match=r"model\.safetensors is missing.*pull --force"):
        load_model("default", progress=False)


def test_missing_local_wheel_is_explained(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="PIE_CTX_DEFAULT_WHEEL"):
        load_model(None, progress=False)
    assert not (cache.models_dir() / DEFAULT_NAME).exists()


def test_chat_template_from_sidecar_jinja(tmp_path: Path, hf: dict[str, np.ndarray]) -> None:
    folder = write_tiny_hf_folder(tmp_path / "m", hf)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    (folder / "chat_template.jinja").write_text("{{ messages[0]['content'] | upper }}")
    tok = load_model(folder).tokenizer
    assert tok.render_chat([{"role": "user", "content": "hey"}]) == "HEY"
