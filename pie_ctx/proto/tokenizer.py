"""The model's tokenizer: text <-> token ids, chat templates, stop tokens, streaming decode.

Owner: the loader builds one :class:`Tokenizer` per loaded model; it is immutable after
construction and safe to share between contexts. It lives in the SDK package (and imports
no torch) because fillers tokenize synchronously on the client side; a socket client
rebuilds it from the server's handshake (:meth:`Tokenizer.to_wire` / :meth:`from_wire`). It wraps a ``tokenizers.Tokenizer`` (the
fast Rust tokenizer of ``tokenizer.json``) and renders chat templates with a sandboxed
jinja2 environment that behaves like Hugging Face's ``apply_chat_template`` (same
``trim_blocks``/``lstrip_blocks``, ``raise_exception``, ``strftime_now`` and a ``tojson``
filter that does not escape HTML), so a prompt renders to the same text, and tokenizes
to the same ids, as in transformers.

Invariants: ``stop_token_ids`` always contains ``eos_token_id`` when the model has one;
:class:`IncrementalDecoder` never emits half of a multi-byte UTF-8 character.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
import tokenizers

from pie_ctx.proto import checks
from pie_ctx.proto.errors import InvalidArgument, ModelError

__all__ = ["Tokenizer", "IncrementalDecoder", "END_OF_TURN_TOKENS"]

# Tokens that end an assistant turn in common chat formats (ChatML, Llama 3, GPT-2 style).
END_OF_TURN_TOKENS: tuple[str, ...] = ("<|im_end|>", "<|eot_id|>", "<|endoftext|>", "<|eom_id|>")

_REPLACEMENT = "\ufffd"


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # jinja2's own tojson escapes <, >, & for HTML; chat templates want plain JSON.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent,
                      separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _compile_template(source: str) -> jinja2.Template:
    """Compile a chat template the way transformers does (sandboxed, trimmed blocks)."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ModelError(f"the model's chat template does not compile: {e}") from None


class Tokenizer:
    """Encode, decode and chat-format text for one model.

    Usage::

        tok = loaded.tokenizer
        ids = tok.encode_chat([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
        dec = tok.incremental_decoder()
        for t in generated: print(dec.feed([t]), end="")
    """

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        *,
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
        extra_stop_token_ids: Iterable[int] = (),
        extra_template_vars: dict[str, Any] | None = None,
    ) -> None:
        """Wrap a fast tokenizer.

        Args:
            tokenizer: the ``tokenizers.Tokenizer`` (its post-processor decides whether
                ``encode(..., add_special_tokens=True)`` prepends BOS).
            chat_template: jinja2 source of the chat template, or None if the model has none.
            bos_token: the BOS token text (must be in the vocabulary), or None.
            eos_token: the EOS token text (must be in the vocabulary), or None.
            extra_stop_token_ids: more ids that end generation (e.g. generation_config eos ids).
            extra_template_vars: more variables passed to the chat template (e.g. pad_token).

        Raises:
            ModelError: a named special token is not in the vocabulary, or the template
                does not compile.
        """
        self._tok = tokenizer
        self.chat_template = chat_template
        self._template = _compile_template(chat_template) if chat_template else None
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.bos_token_id = self._special_id(bos_token, "bos_token")
        self.eos_token_id = self._special_id(eos_token, "eos_token")
        self.vocab_size: int = tokenizer.get_vocab_size(with_added_tokens=True)
        self._template_vars = dict(extra_template_vars or {})
        stops: list[int] = [] if self.eos_token_id is None else [self.eos_token_id]
        for i in extra_stop_token_ids:
            if 0 <= int(i) < self.vocab_size and int(i) not in stops:
                stops.append(int(i))
        for text in END_OF_TURN_TOKENS:
            i = tokenizer.token_to_id(text)
            if i is not None and i not in stops:
                stops.append(i)
        self.stop_token_ids: tuple[int, ...] = tuple(stops)

    def _special_id(self, token: str | None, what: str) -> int | None:
        if token is None:
            return None
        i = self._tok.token_to_id(token)
        if i is None:
            raise ModelError(f"{what} {token!r} is not in the tokenizer vocabulary; "
                             "the tokenizer files are inconsistent, re-download the model")
        return i

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The wrapped ``tokenizers.Tokenizer`` (read-only use)."""
        return self._tok

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``.

        Args:
            text: the text; special-token strings in it (e.g. ``<|im_start|>``) map to
                their single ids.
            add_special_tokens: apply the tokenizer's post-processor (e.g. prepend BOS for
                Llama 3). Off by default: chat templates already write their specials.

        Returns:
            The token ids.

        Raises:
            InvalidArgument: ``text`` is not a string, or not valid Unicode.
        """
        checks.text(text, "encode()")
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of ``ids``.

        Args:
            ids: token ids, each in ``[0, vocab_size)``.
            skip_special_tokens: drop special tokens (BOS, ``<|im_end|>``...) from the text.

        Returns:
            The decoded text (an incomplete UTF-8 sequence at the end shows as U+FFFD).

        Raises:
            InvalidArgument: an id is out of range.
        """
        ids = [int(i) for i in ids]
        for i in ids:
            if not 0 <= i < self.vocab_size:
                raise InvalidArgument(f"token id {i} is out of range [0, {self.vocab_size})")
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = False,
                    **template_vars: Any) -> str:
        """Render chat messages to prompt text with the model's chat template.

        Args:
            messages: ``[{"role": "system"|"user"|"assistant", "content": str}, ...]``.
            add_generation_prompt: append the cue that starts an assistant turn.
            **template_vars: extra variables for the template (e.g. ``tools``).

        Returns:
            The rendered prompt text.

        Raises:
            ModelError: the model has no chat template.
            InvalidArgument: a message is malformed, or the template rejects the messages.
        """
        if self._template is None:
            raise ModelError("this model has no chat template; build prompts with encode() "
                             "or load a model whose tokenizer_config.json has chat_template")
        for m in messages:
            if not isinstance(m, dict) or "role" not in m:
                raise InvalidArgument(f"each chat message must be a dict with a 'role', got {m!r}")
        variables = {
            "bos_token": self.bos_token or "",
            "eos_token": self.eos_token or "",
            **self._template_vars,
            **template_vars,
        }
        try:
            return self._template.render(messages=messages,
                                         add_generation_prompt=add_generation_prompt,
                                         **variables)
        except jinja2.TemplateError as e:
            raise InvalidArgument(f"the chat template rejected these messages: {e}") from None

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = False,
                    **template_vars: Any) -> list[int]:
        """Token ids of :meth:`render_chat` (no extra specials: the template writes them).

        Args:
            messages: as for :meth:`render_chat`.
            add_generation_prompt: as for :meth:`render_chat`.
            **template_vars: as for :meth:`render_chat`.

        Returns:
            The token ids, identical to transformers' ``apply_chat_template(tokenize=True)``.

        Raises:
            ModelError, InvalidArgument: as for :meth:`render_chat`.
        """
        text = self.render_chat(messages, add_generation_prompt, **template_vars)
        return self._tok.encode(text, add_special_tokens=False).ids

    def to_wire(self) -> dict[str, Any]:
        """Everything needed to rebuild this tokenizer elsewhere, as plain data."""
        return {
            "tokenizer_json": self._tok.to_str(),
            "chat_template": self.chat_template,
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "stop_token_ids": list(self.stop_token_ids),
            "template_vars": {k: v for k, v in self._template_vars.items()
                              if isinstance(v, str | int | float | bool | None)},
        }

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> Tokenizer:
        """Rebuild a tokenizer from :meth:`to_wire`'s output.

        Raises:
            ModelError: the data is not a tokenizer description.
        """
        try:
            backend = tokenizers.Tokenizer.from_str(data["tokenizer_json"])
            return cls(backend, chat_template=data.get("chat_template"),
                       bos_token=data.get("bos_token"), eos_token=data.get("eos_token"),
                       extra_stop_token_ids=data.get("stop_token_ids", ()),
                       extra_template_vars=data.get("template_vars") or {})
        except (KeyError, TypeError, ValueError, Exception) as e:
            if isinstance(e, ModelError):
                raise
            raise ModelError(f"the server sent an unusable tokenizer description: {e}") from None

    def is_stop_token(self, token_id: int) -> bool:
        """True if ``token_id`` ends generation by default (EOS or an end-of-turn token)."""
        return token_id in self.stop_token_ids

    def incremental_decoder(self, skip_special_tokens: bool = False) -> IncrementalDecoder:
        """A fresh streaming detokenizer over this tokenizer."""
        return IncrementalDecoder(self, skip_special_tokens=skip_special_tokens)


class IncrementalDecoder:
    """Turns a stream of token ids into text deltas.

    Keeps two offsets into the ids seen so far: text up to ``read_offset`` has been
    returned, and the few tokens from ``prefix_offset`` give the decoder context (byte-level
    and sentencepiece decoders both depend on the neighbouring token). New text is held back
    while it ends in U+FFFD, i.e. while a multi-byte character is still incomplete, so a
    delta never splits a character. The concatenated deltas plus :meth:`flush` equal
    ``decode(all_ids)``.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False) -> None:
        """Args:
            tokenizer: the model's :class:`Tokenizer`.
            skip_special_tokens: leave special tokens out of the text.
        """
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0

    def _decode(self, start: int, stop: int | None = None) -> str:
        return self._tok.decode(self._ids[start:stop], skip_special_tokens=self._skip)

    def feed(self, ids: Iterable[int]) -> str:
        """Add token ids and return the new complete text (may be empty).

        Raises:
            InvalidArgument: an id is out of range (nothing is added then).
        """
        new = [int(i) for i in ids]
        for i in new:
            if not 0 <= i < self._tok.vocab_size:
                raise InvalidArgument(f"token id {i} is out of range [0, {self._tok.vocab_size})")
        self._ids.extend(new)
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        text = self._decode(self._prefix_offset)
        if len(text) <= len(prefix_text) or text.endswith(_REPLACEMENT):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return text[len(prefix_text):]

    def flush(self) -> str:
        """Return whatever is held back (an incomplete character decodes as U+FFFD)."""
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        text = self._decode(self._prefix_offset)
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return text[len(prefix_text):]
