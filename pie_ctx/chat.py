"""Chat turns to tokens, one turn at a time, through the model's chat template.

Owns: a context's conversation as the template sees it. Chat templates render whole
conversations, so a new turn's tokens are the difference between the rendering with it and
the rendering without it. When the text already in the context is a prefix of the new
rendering (the usual case, including after generation) the difference is exact and the
context holds exactly what ``apply_chat_template`` would produce.

Tools (``pie_ctx.tools``) are part of the conversation: declared once, at its start, they
are rendered with every turn (``tools=`` for a template that describes them, the system
turn's text otherwise; see ``pie_ctx.tools.formats``). The results of parallel calls are
one group of tool messages that many templates render as one turn: while a group's tokens
are still pending, adding a result renders the whole group again.
"""

from __future__ import annotations

import json
from typing import Any

from pie_ctx.proto.errors import InvalidArgument
from pie_ctx.tools.formats import Parsed, ToolFormat, format_named, tool_format
from pie_ctx.tools.tool import ToolCall

__all__ = ["Conversation"]


class Conversation:
    """Messages so far and the template text their tokens correspond to."""

    __slots__ = ("messages", "text", "synced", "cued", "awaits_answer", "tools", "format",
                 "calls", "group")

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self.text = ""  # template text whose tokens are in the context (KV + pending)
        self.synced = True  # False after truncation: `text` no longer matches the tokens
        self.cued = False  # a generation prompt was added and no answer recorded yet
        # The last thing filled was a system or user turn: the next turn is the assistant's,
        # so generate() cues it itself (raw tokens, a cue or an answer clear this).
        self.awaits_answer = False
        self.tools: list[dict[str, Any]] = []  # declared tools, OpenAI's shape
        self.format = ""  # the tool format's name, once tools are declared
        self.calls: dict[str, str] = {}  # call id -> tool name, for calls not yet answered
        # The trailing group of tool results: the text before it, and how many tokens it
        # added (all still pending while the group can be rendered again).
        self.group: tuple[str, int] | None = None

    def copy(self) -> Conversation:
        other = Conversation()
        other.messages = [dict(m) for m in self.messages]
        other.text, other.synced, other.cued = self.text, self.synced, self.cued
        other.awaits_answer = self.awaits_answer
        other.tools, other.format = list(self.tools), self.format
        other.calls, other.group = dict(self.calls), self.group
        return other

    def to_meta(self) -> str:
        """The conversation as JSON, stored with a snapshot so ``open`` can continue it."""
        return json.dumps({"messages": self.messages, "text": self.text,
                           "synced": self.synced, "cued": self.cued,
                           "awaits_answer": self.awaits_answer, "tools": self.tools,
                           "format": self.format, "calls": self.calls})

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
            conv.tools = list(data.get("tools", []))
            conv.format = str(data.get("format", ""))
            conv.calls = dict(data.get("calls", {}))
        return conv

    # ------------------------------------------------------------------------ tools

    def tool_format(self, tokenizer: Any) -> ToolFormat:
        """The tool format of this conversation (the template's, until declared)."""
        return format_named(self.format) if self.format else tool_format(tokenizer)

    def declare_tools(self, tokenizer: Any, tools: list[Any]) -> None:
        """Declare tools (``Tool`` objects) before the first turn is rendered.

        Raises:
            InvalidArgument: turns were already rendered (tools belong at the start).
        """
        if self.messages or self.text:
            raise InvalidArgument(
                "tools are declared at the start of a conversation: pass them to the first "
                "system() turn (or to generate() on a context with nothing in it yet)")
        self.format = tool_format(tokenizer).name
        self.tools = [t.to_openai() for t in tools]

    def add_tool_result(self, tokenizer: Any, call_id: str, content: str, pending: int
                        ) -> tuple[int, list[int]]:
        """Answer the call ``call_id``; return ``(n, tokens)``: drop the last ``n`` pending
        tokens (the group of results so far, rendered again), then add ``tokens``.
        ``pending`` is how many tokens are pending: a group already written to the KV
        cache cannot be rendered again, and the new result follows it as it is.

        Raises:
            InvalidArgument: no call with that id awaits a result, or the assistant turn
                is open.
        """
        if call_id not in self.calls:
            waiting = ", ".join(self.calls) or "none"
            raise InvalidArgument(f"no tool call with id {call_id!r} awaits a result "
                                  f"(waiting: {waiting})")
        if self.cued:
            raise InvalidArgument("the assistant turn is open (cue): generate() or "
                                  "assistant(text) must come before tool_result()")
        message = self.tool_format(tokenizer).tool_message(call_id, self.calls[call_id],
                                                           content)
        retract = 0
        saved = (self.text, self.synced, self.group)
        if self.group is not None and self.group[1] <= pending:  # render the group again
            self.text, retract = self.group
            self.synced = True
        before = self.text
        try:
            tokens = self._render(tokenizer, self.messages + [message], generation_prompt=False)
        except BaseException:
            self.text, self.synced, self.group = saved
            raise
        del self.calls[call_id]
        self.group = (before, len(tokens))
        self.awaits_answer = True
        return retract, tokens

    def record_tool_generation(self, text_with_specials: str, message: dict[str, Any],
                               call_names: dict[str, str]) -> None:
        """A generation with tools went into the context (see ``record_generation``)."""
        self.text += text_with_specials
        self.awaits_answer = False
        self.group = None
        self.messages = self.messages + [message]
        self.cued = False
        if call_names:  # the calls of the latest assistant turn await their results
            self.calls = dict(call_names)

    def add(self, tokenizer: Any, role: str, content: str) -> list[int]:
        """Append a whole message and return its new tokens.

        Raises:
            InvalidArgument: the assistant turn is open (``cue()`` was called): only the
                answer (``assistant(text)`` or ``generate()``) may follow.
        """
        return self.add_message(tokenizer, {"role": role, "content": content})

    def add_message(self, tokenizer: Any, message: dict[str, Any]) -> list[int]:
        """``add`` for a message with more keys than a role and a content (tool calls)."""
        role = message["role"]
        if self.cued:
            raise InvalidArgument(
                f"the assistant turn is open (cue): generate() or assistant(text) must come "
                f"before {role}()")
        tokens = self._render(tokenizer, self.messages + [message], generation_prompt=False)
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
        rendered = self._render_text(tokenizer, messages, generation_prompt)
        delta = self._delta(tokenizer, rendered)
        self.group = None
        self.messages = messages
        self.text = rendered
        self.synced = True
        self.cued = generation_prompt
        return tokenizer.encode(delta) if delta else []

    def add_assistant(self, tokenizer: Any, content: str,
                      calls: list[ToolCall] | None = None) -> list[int]:
        """Write the assistant turn yourself (after a cue, or as a whole turn), with the
        tool calls it made, if any (they then await their results)."""
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            fmt = self.tool_format(tokenizer)
            message = fmt.assistant_message(fmt.model_text(content, calls),
                                            Parsed(content, list(calls)))
        if self.cued:
            # The cue already rendered the turn's header: render the turn and diff.
            messages = self.messages + [message]
            rendered = self._render_text(tokenizer, messages, False)
            delta = self._delta(tokenizer, rendered)
            self.messages, self.text, self.cued, self.group = messages, rendered, False, None
            tokens = tokenizer.encode(delta) if delta else []
        else:
            tokens = self.add_message(tokenizer, message)
        self.awaits_answer = False
        if calls:
            self.calls = {c.id: c.name for c in calls}
        return tokens

    def record_generation(self, text_with_specials: str, answer: str,
                          tokenizer: Any = None) -> None:
        """Generated tokens went into the context: extend the text, remember the answer
        (``answer``: the generated text without special tokens, a matched stop string
        included, as the context holds it).

        After a cue the answer is a new assistant message. Without one, a generation right
        after an answer whose turn has not ended (it stopped on ``max_tokens``) continues
        that answer: the message grows, so the next turn still renders the turn's end
        (``tokenizer`` renders the template to tell).
        """
        self.text += text_with_specials
        self.awaits_answer = False
        self.group = None
        if self.cued:
            self.messages = self.messages + [{"role": "assistant", "content": answer}]
            self.cued = False
        elif tokenizer is not None:
            self._continue_answer(tokenizer, answer)

    def _continue_answer(self, tokenizer: Any, answer: str) -> None:
        last = self.messages[-1] if self.messages else None
        if (not self.synced or last is None or last.get("role") != "assistant"
                or not isinstance(last.get("content"), str) or last.get("tool_calls")):
            return
        messages = self.messages[:-1] + [{**last, "content": last["content"] + answer}]
        # Only when the context's text is still inside that turn (its end not written).
        if self._render_text(tokenizer, messages, False).startswith(self.text):
            self.messages = messages

    def _render_text(self, tokenizer: Any, messages: list[dict[str, Any]],
                     generation_prompt: bool) -> str:
        variables = self.tool_format(tokenizer).template_vars(self.tools) if self.tools else {}
        return tokenizer.render_chat(messages, add_generation_prompt=generation_prompt,
                                     **variables)

    def _delta(self, tokenizer: Any, rendered: str) -> str:
        if self.synced and rendered.startswith(self.text):
            return rendered[len(self.text):]
        # The context's text diverged (truncation, or a template that rewrites past turns):
        # take the difference against the template's own rendering of the past turns.
        previous = self._render_text(tokenizer, self.messages, self.cued) if self.messages else ""
        if rendered.startswith(previous):
            return rendered[len(previous):]
        raise InvalidArgument(
            "the chat template renders earlier turns differently once this turn is added; "
            "build the prompt with append() instead"
        )
