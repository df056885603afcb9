"""Build a ``tokenizers.Tokenizer`` from the tokenizer a GGUF file describes.

Owner: the GGUF loader. Pure function of the GGUF metadata (``tokenizer.ggml.*``); the
result is written once as ``tokenizer.json`` into the converted cache folder.

Supported: ``tokenizer.ggml.model == "gpt2"`` (byte-level BPE, the tokenizer of SmolLM2,
Llama 3 and Qwen2/3). The pre-tokenizer (how text is split before BPE) follows
``tokenizer.ggml.pre`` the way llama.cpp does: each pre type names the split regex its
vocabulary was trained with. Control tokens (token type 3) and user-defined tokens (type 4)
become added tokens matched whole in the text, with their original ids.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import cache
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from pie_ctx.proto.errors import ModelError

__all__ = ["GGUFTokenizerSpec", "build_gguf_tokenizer", "byte_to_unicode", "PRE_TOKENIZER_SPLITS"]

_log = logging.getLogger(__name__)

_TOKEN_NORMAL, _TOKEN_CONTROL, _TOKEN_USER_DEFINED = 1, 3, 4

# Split regexes by ``tokenizer.ggml.pre`` (as in llama.cpp's vocabulary loader). None means
# "the GPT-2 regex built into the ByteLevel pre-tokenizer".
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZER_SPLITS: dict[str, str | None] = {
    "default": None,
    "gpt2": None,
    "gpt-2": None,
    "llama-bpe": _LLAMA3,
    "llama3": _LLAMA3,
    "llama-v3": _LLAMA3,
    "smaug-bpe": _LLAMA3,
    "dbrx": _LLAMA3,
    "qwen2": _QWEN2,
    "deepseek-r1-qwen": _QWEN2,
}
# Pre types that split every digit on its own before the GPT-2 regex (llama.cpp's
# "\p{N}" rule for these vocabularies; HF's SmolLM2 tokenizer uses Digits(individual)).
_INDIVIDUAL_DIGITS = frozenset({"smollm", "starcoder", "refact", "codeshell"})
# Llama 3 style vocabularies look a whole pre-token up before applying merges.
_IGNORE_MERGES = frozenset({"llama-bpe", "llama3", "llama-v3", "smaug-bpe", "dbrx"})


@cache
def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table used by byte-level BPE."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


@dataclass(slots=True)
class GGUFTokenizerSpec:
    """The ``tokenizer.*`` metadata of a GGUF file, as plain values."""

    model: str
    pre: str | None
    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    bos_token_id: int | None
    eos_token_id: int | None
    unk_token_id: int | None
    pad_token_id: int | None
    extra_stop_ids: list[int]
    add_bos_token: bool
    add_eos_token: bool
    chat_template: str | None

    @classmethod
    def from_metadata(cls, meta: dict[str, Any]) -> GGUFTokenizerSpec:
        """Collect the tokenizer fields from a GGUF metadata dict.

        Raises:
            ModelError: the file has no tokenizer.
        """
        tokens = meta.get("tokenizer.ggml.tokens")
        if not tokens:
            raise ModelError("the GGUF file has no tokenizer (tokenizer.ggml.tokens is missing); "
                             "use a GGUF exported with its vocabulary, or an HF folder")

        def opt_id(key: str) -> int | None:
            v = meta.get(f"tokenizer.ggml.{key}")
            return int(v) if v is not None and 0 <= int(v) < len(tokens) else None

        stops = [i for i in (opt_id("eot_token_id"), opt_id("eom_token_id")) if i is not None]
        return cls(
            model=str(meta.get("tokenizer.ggml.model", "")),
            pre=meta.get("tokenizer.ggml.pre"),
            tokens=list(tokens),
            token_types=list(meta.get("tokenizer.ggml.token_type") or [_TOKEN_NORMAL] * len(tokens)),
            merges=list(meta.get("tokenizer.ggml.merges") or []),
            bos_token_id=opt_id("bos_token_id"),
            eos_token_id=opt_id("eos_token_id"),
            unk_token_id=opt_id("unknown_token_id"),
            pad_token_id=opt_id("padding_token_id"),
            extra_stop_ids=stops,
            add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
            add_eos_token=bool(meta.get("tokenizer.ggml.add_eos_token", False)),
            chat_template=meta.get("tokenizer.chat_template"),
        )

    def token(self, token_id: int | None) -> str | None:
        """The text of ``token_id`` (None passes through)."""
        return None if token_id is None else self.tokens[token_id]


def _pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    byte_level_regex = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _INDIVIDUAL_DIGITS:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        byte_level_regex])
    if pre not in PRE_TOKENIZER_SPLITS:
        _log.warning("GGUF pre-tokenizer %r is unknown; splitting text with the GPT-2 regex", pre)
    split = PRE_TOKENIZER_SPLITS.get(pre or "default")
    if split is None:
        return byte_level_regex
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


def _post_processor(spec: GGUFTokenizerSpec) -> processors.PostProcessor | None:
    pieces: list[tuple[str, int]] = []
    single, pair = "$A:0", "$A:0 $B:1"
    if spec.add_bos_token and spec.bos_token_id is not None:
        bos = spec.tokens[spec.bos_token_id]
        pieces.append((bos, spec.bos_token_id))
        single, pair = f"{bos}:0 {single}", f"{bos}:0 $A:0 {bos}:1 $B:1"
    if spec.add_eos_token and spec.eos_token_id is not None:
        eos = spec.tokens[spec.eos_token_id]
        pieces.append((eos, spec.eos_token_id))
        single, pair = f"{single} {eos}:0", f"{pair} {eos}:1"
    if not pieces:
        return None
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=list(dict(pieces).items()))


def build_gguf_tokenizer(spec: GGUFTokenizerSpec) -> Tokenizer:
    """A fast tokenizer equivalent to the one the GGUF metadata describes.

    Args:
        spec: the tokenizer metadata of the file.

    Returns:
        A ``tokenizers.Tokenizer`` whose ids equal the GGUF token ids.

    Raises:
        ModelError: the tokenizer type is not byte-level BPE, or merges are missing.
    """
    if spec.model != "gpt2":
        raise ModelError(
            f"GGUF tokenizer type {spec.model!r} is unsupported (only byte-level BPE, 'gpt2', "
            "as used by SmolLM2, Llama 3 and Qwen); load the model from its HF folder instead"
        )
    if not spec.merges:
        raise ModelError("the GGUF byte-level BPE tokenizer has no tokenizer.ggml.merges")
    alphabet = set(byte_to_unicode().values())
    spelling = byte_to_unicode()
    vocab: dict[str, int] = {}
    added: list[AddedToken] = []
    for idx, (text, kind) in enumerate(zip(spec.tokens, spec.token_types, strict=False)):
        if kind in (_TOKEN_CONTROL, _TOKEN_USER_DEFINED):
            added.append(AddedToken(text, special=kind == _TOKEN_CONTROL, normalized=False))
        elif not set(text) <= alphabet:
            # A normal token written in plain UTF-8: respell it in the byte alphabet.
            text = "".join(spelling[b] for b in text.encode("utf-8"))
        vocab.setdefault(text, idx)
    merges = [_split_merge(m) for m in spec.merges]
    bpe = models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False,
                     ignore_merges=spec.pre in _IGNORE_MERGES)
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = _pre_tokenizer(spec.pre)
    tok.decoder = decoders.ByteLevel()
    post = _post_processor(spec)
    if post is not None:
        tok.post_processor = post
    # Added tokens keep their vocabulary ids because their text is already in `vocab`.
    tok.add_special_tokens([t for t in added if t.special])
    tok.add_tokens([t for t in added if not t.special])
    if tok.get_vocab_size(with_added_tokens=True) != len(vocab):
        raise ModelError("the GGUF vocabulary has duplicate or clashing tokens; "
                         "it cannot be converted without changing token ids")
    return tok


def _split_merge(merge: str) -> tuple[str, str]:
    left, sep, right = merge.partition(" ")
    if not sep or not left or not right:
        raise ModelError(f"malformed GGUF merge {merge!r} (expected 'left right')")
    return left, right

