"""Chat turns to tokens, one turn at a time, through the model's chat template.

Owns: a context's conversation as the template sees it. Chat templates render whole
conversations, so a new turn's tokens are the difference between the rendering with it and
the rendering without it. When the text already in the context is a prefix of the new
rendering (the usual case, including after generation) the difference is exact and the
context holds exactly what ``apply_chat_template`` would produce.
"""

from __future__ import annotations

import json
from typing import Any

from pie_ctx.proto.errors import InvalidArgument

__all__ = ["Conversation"]


class Conversation:
    """Messages so far and the template text their tokens correspond to."""

    __slots__ = ("messages", "text", "synced", "cued", "awaits_answer")

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self.text = ""  # template text whose tokens are in the context (KV + pending)
        self.synced = True  # False after truncation: `text` no longer matches the tokens
        self.cued = False  # a generation prompt was added and no answer recorded yet
        # The last thing filled was a system or user turn: the next turn is the assistant's,
        # so generate() cues it itself (raw tokens, a cue or an answer clear this).
        self.awaits_answer = False

    def copy(self) -> Conversation:
        other = Conversation()
        other.messages = [dict(m) for m in self.messages]
        other.text, other.synced, other.cued = self.text, self.synced, self.cued
        other.awaits_answer = self.awaits_answer
        return other

    def to_meta(self) -> str:
        """The conversation as JSON, stored with a snapshot so ``open`` can continue it."""
        return json.dumps({"messages": self.messages, "text": self.text,
                           "synced": self.synced, "cued": self.cued,
                           "awaits_answer": self.awaits_answer})

    @classmethod
    def from_meta(cls, meta: str) -> Conversation:
        conv = cls()
        if meta:
            data = json.loads(meta)
            conv.messages = list(data.get("messages", []))
            conv.text = str(data.get("text", ""))
            conv.synced = bool(data.get("synced", True))
            conv.cued = bool(data.get("cued", False))
            conv.awaits_answer = bool(data.get("awaits_answer", False))
        return conv

    def add(self, tokenizer: Any, role: str, content: str) -> list[int]:
        """Append a whole message and return its new tokens.

        Raises:
            InvalidArgument: the assistant turn is open (``cue()`` was called): only the
                answer (``assistant(text)`` or ``generate()``) may follow.
        """
        if self.cued:
            raise InvalidArgument(
                f"the assistant turn is open (cue): generate() or assistant(text) must come "
                f"before {role}()")
        tokens = self._render(tokenizer, self.messages + [{"role": role, "content": content}],
                              generation_prompt=False)
        self.awaits_answer = role in ("system", "user")
        return tokens

    def cue(self, tokenizer: Any) -> list[int]:
        """Open the assistant turn (the template's generation prompt); return its tokens.

        Idempotent: while the turn is open, nothing is added.
        """
        if self.cued:
            return []
        tokens = self._render(tokenizer, self.messages, generation_prompt=True)
        self.cued = True
        self.awaits_answer = False
        return tokens

    def note_raw(self) -> None:
        """Raw tokens were appended: the next turn is the caller's business, not a cue."""
        self.awaits_answer = False

    def _render(self, tokenizer: Any, messages: list[dict[str, Any]],
                generation_prompt: bool) -> list[int]:
        if getattr(tokenizer, "chat_template", None) is None and hasattr(tokenizer, "chat_template"):
            raise InvalidArgument("this model has no chat template; use append(tokens or text)")
        rendered = tokenizer.render_chat(messages, add_generation_prompt=generation_prompt)
        delta = self._delta(tokenizer, rendered)
        self.messages = messages
        self.text = rendered
        self.synced = True
        self.cued = generation_prompt
        return tokenizer.encode(delta) if delta else []

    def add_assistant(self, tokenizer: Any, content: str) -> list[int]:
        """Write the assistant turn yourself (after a cue, or as a whole turn)."""
        self.awaits_answer = False
        if self.cued:
            self.cued = False
            # The cue already rendered the turn's header: render the turn and diff.
            self.messages = self.messages + [{"role": "assistant", "content": content}]
            rendered = tokenizer.render_chat(self.messages, add_generation_prompt=False)
            delta = self._delta(tokenizer, rendered)
            self.text = rendered
            return tokenizer.encode(delta) if delta else []
        return self.add(tokenizer, "assistant", content)

    def record_generation(self, text_with_specials: str, answer: str) -> None:
        """Generated tokens went into the context: extend the text, remember the answer."""
        self.text += text_with_specials
        self.awaits_answer = False
        if self.cued:
            self.messages = self.messages + [{"role": "assistant", "content": answer}]
            self.cued = False

    def _delta(self, tokenizer: Any, rendered: str) -> str:
        if self.synced and rendered.startswith(self.text):
            return rendered[len(self.text):]
        # The context's text diverged (truncation, or a template that rewrites past turns):
        # take the difference against the template's own rendering of the past turns.
        previous = tokenizer.render_chat(self.messages, add_generation_prompt=self.cued) if self.messages else ""
        if rendered.startswith(previous):
            return rendered[len(previous):]
        raise InvalidArgument(
            "the chat template renders earlier turns differently once this turn is added; "
            "build the prompt with append() instead"
        )
