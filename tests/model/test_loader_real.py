"""The real default model (SmolLM2-135M-Instruct GGUF) against transformers' own GGUF loading:
weights (dequantization + Q/K un-permutation), tokenizer and chat-template prompt parity.

Marked ``real_model``: the first run fetches (~93 MB) and converts the model into the user
cache; later runs reuse it. transformers is the oracle here and is imported only in tests.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from runtime.model.loader import LoadedModel, default_gguf_path, load_model

pytestmark = pytest.mark.real_model

PARITY_TEXTS = [
    "Hello, world!",
    "  leading spaces,   runs of   spaces\n\n\ttabs\r\nand CRLF  \n",
    "Numbers: 12345, 3.14159, 1e-9, 0x1F, 2024-11-21, 1,000,000",
    "naïve café — «quotes» ‘single’ 日本語のテキスト 한국어 العربية Ελληνικά",
    "emoji 😀👍🏽 👨‍👩‍👧 🤖",
    "def f(x: int) -> int:\n    return x ** 2  # square\n\nprint(f(3))\n",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "I'm sure you're right; they'll say DON'T and won't.",
    "<reponame>pie-ctx<filename>runtime/model.py<|endoftext|>",
    "",
    " ",
    "ĠĊ literal byte-symbols",
    "{\"json\": [1, 2, {\"k\": null}], 'py': None}",
]
CHATS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."},
     {"role": "user", "content": "List 3 primes."},
     {"role": "assistant", "content": "2, 3, 5."},
     {"role": "user", "content": "Now 3 more, with émojis 😀?"}],
]


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return load_model(None, device="cpu", dtype=torch.float32, progress=False)


@pytest.fixture(scope="module")
def hf_tokenizer(loaded: LoadedModel) -> Any:
    transformers = pytest.importorskip("transformers")
    path = default_gguf_path()
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def test_default_model_config(loaded: LoadedModel) -> None:
    cfg = loaded.config
    assert loaded.name == "smollm2-135m-instruct"
    assert (cfg.arch, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == \
        ("llama", 30, 576, 9, 3)
    assert cfg.vocab_size == loaded.tokenizer.vocab_size == 49152
    assert cfg.tie_word_embeddings and "lm_head.weight" not in loaded.weights
    tok = loaded.tokenizer
    assert tok.eos_token_id == 2 and tok.bos_token_id == 1  # <|im_end|>, <|im_start|>
    assert set(tok.stop_token_ids) == {0, 2}


def test_tokenizer_parity_with_transformers(loaded: LoadedModel, hf_tokenizer: Any) -> None:
    tok = loaded.tokenizer
    for text in PARITY_TEXTS:
        ours = tok.encode(text)
        assert ours == hf_tokenizer.encode(text, add_special_tokens=False), text
        assert tok.decode(ours) == text
    # Non-ASCII numerals: we follow llama.cpp's "smollm" rule (every \p{N} alone), as the
    # original SmolLM2 tokenizer does (Digits(individual_digits=True)); transformers' GGUF
    # converter applies only the GPT-2 regex here, so the two differ on such text.
    arabic = tok.encode("٣٤٥")
    assert len(arabic) == 6 and tok.decode(arabic) == "٣٤٥"  # 3 digits x 2 byte tokens


def test_chat_prompt_parity_with_transformers(loaded: LoadedModel, hf_tokenizer: Any) -> None:
    tok = loaded.tokenizer
    for messages in CHATS:
        for gen in (False, True):
            text = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
            assert tok.render_chat(messages, add_generation_prompt=gen) == text
            ids = hf_tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=gen)
            ids = ids["input_ids"] if not isinstance(ids, list) else ids
            assert tok.encode_chat(messages, add_generation_prompt=gen) == list(ids)


def test_incremental_decode_of_real_text(loaded: LoadedModel) -> None:
    tok = loaded.tokenizer
    text = "Streaming: naïve 😀 日本語 done."
    dec = tok.incremental_decoder()
    out = "".join(dec.feed([i]) for i in tok.encode(text)) + dec.flush()
    assert out == text


def test_weights_equal_transformers_gguf_dequantization(loaded: LoadedModel) -> None:
    transformers = pytest.importorskip("transformers")
    path = default_gguf_path()
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32)
    theirs = hf.state_dict()
    assert set(loaded.weights) <= set(theirs)
    assert set(theirs) - set(loaded.weights) <= {"lm_head.weight"}  # tied to the embedding
    worst = 0.0
    for name, ours in loaded.weights.items():
        assert ours.shape == theirs[name].shape, name
        worst = max(worst, (ours - theirs[name].float()).abs().max().item())
    print(f"max abs weight diff vs transformers GGUF dequantization: {worst:.3g}")
    assert worst <= 1e-6
