"""Tokenizer unit tests on a tiny byte-level BPE: GGUF tokenizer conversion (pre-tokenizer
regexes, control tokens, BOS), chat-template environment, stop tokens, streaming decode."""

from __future__ import annotations

import pytest
from loader_fixtures import CHAT_TEMPLATE, tiny_spec

from pie_ctx.errors import InvalidArgument, ModelError
from pie_ctx.proto.tokenizer import IncrementalDecoder, Tokenizer
from runtime.model.loader.gguf_tokenizer import build_gguf_tokenizer


def make_tokenizer(template: str | None = CHAT_TEMPLATE, pre: str = "smollm",
                   add_bos: bool = False) -> Tokenizer:
    return Tokenizer(build_gguf_tokenizer(tiny_spec(pre, add_bos)), chat_template=template,
                     bos_token="<|im_start|>", eos_token="<|im_end|>")


def pieces(tok: Tokenizer, text: str) -> list[str]:
    return [tok.backend.id_to_token(i) for i in tok.encode(text)]


def test_merges_and_control_tokens_keep_gguf_ids() -> None:
    tok = make_tokenizer()
    assert pieces(tok, "hello world") == ["hello", "Ġwo", "r", "l", "d"]
    assert tok.encode("<|im_start|>x<|im_end|>") == [1, tok.encode("x")[0], 2]
    assert tok.vocab_size == len(tiny_spec().tokens)


def test_round_trip_unicode() -> None:
    tok = make_tokenizer()
    for text in ["naïve café", "日本語 😀👍🏽", "  spaces\n\ttabs\r\n", "<|endoftext|>a", ""]:
        assert tok.decode(tok.encode(text)) == text


@pytest.mark.parametrize("pre,expected", [
    ("smollm", ["1", "2", "3", "4"]),   # llama.cpp smollm: every digit alone, before BPE
    ("gpt2", ["12", "3", "4"]),         # GPT-2 regex keeps the digit run; BPE merges "1 2"
    ("llama-bpe", ["12", "3", "4"]),    # Llama 3: runs of up to three digits ("123", "4")
    ("qwen2", ["1", "2", "3", "4"]),    # Qwen2: single digits
])
def test_pre_tokenizer_follows_gguf_pre_type(pre: str, expected: list[str]) -> None:
    assert pieces(make_tokenizer(pre=pre), "1234") == expected


def test_add_bos_post_processor() -> None:
    tok = make_tokenizer(add_bos=True)
    assert tok.encode("he", add_special_tokens=True) == [1, *tok.encode("he")]
    assert tok.encode("he") == tok.encode("he", add_special_tokens=False)


def test_render_chat_and_generation_prompt() -> None:
    tok = make_tokenizer()
    msgs = [{"role": "user", "content": "hi"}]
    assert tok.render_chat(msgs) == "<|im_start|>user\nhi<|im_end|>\n"
    assert tok.render_chat(msgs, add_generation_prompt=True).endswith("<|im_start|>assistant\n")
    assert tok.encode_chat(msgs) == tok.encode("<|im_start|>user\nhi<|im_end|>\n")


def test_template_environment_matches_hf() -> None:
    tpl = ("{% if messages|length > 1 %}{{ raise_exception('one message only') }}{% endif %}\n"
           "  {%- for m in messages %}\n    {{ m | tojson }}\n{% endfor %}"
           "{{ bos_token }}{{ strftime_now('%Y') | length }}")
    tok = make_tokenizer(template=tpl)
    # trim_blocks drops the newline after a block tag; lstrip_blocks its leading spaces.
    assert tok.render_chat([{"role": "user", "content": "<b>&"}]) == \
        '    {"role": "user", "content": "<b>&"}\n<|im_start|>4'
    with pytest.raises(InvalidArgument, match="one message only"):
        tok.render_chat([{"role": "user", "content": "a"}] * 2)


def test_sandbox_blocks_attribute_escape() -> None:
    tok = make_tokenizer(template="{{ messages.__class__.__mro__ }}")
    with pytest.raises(InvalidArgument):
        tok.render_chat([{"role": "user", "content": "x"}])


def test_no_template_and_bad_messages() -> None:
    with pytest.raises(ModelError, match="no chat template"):
        make_tokenizer(template=None).render_chat([{"role": "user", "content": "x"}])
    with pytest.raises(InvalidArgument, match="role"):
        make_tokenizer().render_chat([{"content": "x"}])
    with pytest.raises(ModelError, match="does not compile"):
        make_tokenizer(template="{% for %}")


def test_stop_tokens_and_special_ids() -> None:
    tok = make_tokenizer()
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)
    assert tok.stop_token_ids == (2, 0)  # eos <|im_end|>, then <|endoftext|> found in vocab
    assert tok.is_stop_token(0) and not tok.is_stop_token(5)
    with pytest.raises(ModelError, match="not in the tokenizer vocabulary"):
        Tokenizer(build_gguf_tokenizer(tiny_spec()), eos_token="<|eot_id|>")


def test_decode_validates_ids() -> None:
    tok = make_tokenizer()
    with pytest.raises(InvalidArgument, match="out of range"):
        tok.decode([tok.vocab_size])
    with pytest.raises(InvalidArgument, match="str"):
        tok.encode(b"bytes")  # type: ignore[arg-type]


@pytest.mark.parametrize("text", ["héllo wörld 😀👍🏽 日本語", "hello world", "Ā€𝄞\n😀"])
def test_incremental_decoder_never_splits_characters(text: str) -> None:
    tok = make_tokenizer()
    ids = tok.encode(text)
    dec = IncrementalDecoder(tok)
    deltas = [dec.feed([i]) for i in ids]
    deltas.append(dec.flush())
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)
    # The emoji is 4 byte tokens: the first three produce nothing.
    if "😀" in text:
        assert "" in deltas


def test_incremental_decoder_flush_reports_incomplete_tail() -> None:
    tok = make_tokenizer()
    ids = tok.encode("a😀")[:-1]  # cut the last byte of the emoji
    dec = tok.incremental_decoder()
    assert dec.feed(ids[:1]) == "a"
    assert dec.feed(ids[1:]) == ""  # held back: the character is incomplete
    assert dec.flush() == "\ufffd"
