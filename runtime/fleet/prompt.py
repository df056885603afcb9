"""The tokens a chat or completion request will prefill, computed at the fleet's front.

Owns: the model's tokenizer in the ingress, and nothing else. Prefix routing compares a
prompt's full pages with the pages replicas hold (``runtime.fleet.prefix``), so it needs
the tokens the engine will write: the same chat template, turn by turn, as the SDK's
fillers tokenize them (``pie_ctx.chat.Conversation``: ``system``/``user``/``assistant``
then the cue), and ``encode`` for a completion's text. Requests it cannot render the same
way (tools, images, a template's variables) get None: they are routed without a prefix.
"""

from __future__ import annotations

import logging
from typing import Any

from pie_ctx.chat import Conversation

__all__ = ["PromptTokens"]

log = logging.getLogger("pie_ctx.fleet")

_ROLES = ("system", "user", "assistant")


class PromptTokens:
    """Prompt tokens for prefix routing (see the module docstring)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    @classmethod
    def load(cls, model: str | None) -> PromptTokens | None:
        """The model's tokenizer (None, logged, when it cannot be loaded here)."""
        from runtime.model.loader import resolve_model
        from runtime.model.loader.hf import load_tokenizer, read_config

        try:
            _, folder = resolve_model(model, progress=False)
            return cls(load_tokenizer(folder, read_config(folder)))
        except Exception as e:  # the engines load the model; routing only loses prefixes
            log.warning("prefix routing is off: the tokenizer did not load (%s)", e)
            return None

    def of(self, path: str, body: dict[str, Any]) -> list[int] | None:
        """The prompt tokens of a ``/v1/chat/completions`` or ``/v1/completions`` body."""
        try:
            if path == "/v1/completions":
                prompt = body.get("prompt")
                if isinstance(prompt, str):
                    return list(self.tokenizer.encode(prompt))
                if isinstance(prompt, list) and all(type(t) is int for t in prompt):
                    return prompt
                return None
            if path == "/v1/chat/completions" and not body.get("tools"):
                return self._chat(body.get("messages"))
        except Exception:  # a body the engine will refuse, or one rendered otherwise
            return None
        return None

    def _chat(self, messages: Any) -> list[int] | None:
        if not isinstance(messages, list) or not messages:
            return None
        conv, tokens = Conversation(), []
        for m in messages:
            if not isinstance(m, dict) or m.get("role") not in _ROLES or \
                    not isinstance(m.get("content"), str):
                return None
            if m["role"] == "assistant":
                tokens += conv.add_assistant(self.tokenizer, m["content"])
            else:
                tokens += conv.add(self.tokenizer, m["role"], m["content"])
        return tokens + conv.cue(self.tokenizer)
