"""``Turns``: what a context's conversation adds to its pending tokens.

Owns: the chat-template side of a ``Context`` (system, user, assistant and tool turns, the
generation cue, raw tokens, declared tools) and what a generation offers the model of those
tools. It computes nothing and sends nothing: every method tokenizes into the context's
pending tokens (``ContextCore.pending``) and updates its conversation (``ContextCore.chat``),
which the next operation writes. ``Context`` inherits it (docs/api.md lists them there).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Self

from pie_ctx.proto import checks
from pie_ctx.proto.errors import InvalidArgument
from pie_ctx.tools.formats import ToolOffer, check_choice
from pie_ctx.tools.tool import Tool, ToolCall, result_text

if TYPE_CHECKING:
    from pie_ctx.core import ContextCore

__all__ = ["Turns"]


class Turns:
    """The conversation fillers of ``Context`` (over its ``_core``)."""

    __slots__ = ()
    _core: ContextCore

    def system(self, text: str, *, tools: Sequence[Tool] | None = None) -> Self:
        """Add a system turn (tokenized through the chat template into pending tokens).

        Args:
            text: the system prompt.
            tools: declare the tools the model may call (``pie_ctx.tools.Tool``), once, in
                the first turn: the template describes them (or, for a template without a
                tool format, this turn's text does; docs/agents.md). ``generate()`` then
                offers them.

        Raises:
            InvalidArgument: tools declared after the first turn, or not ``Tool`` values.
        """
        if tools is None:
            return self._fill("system", text)
        core = self._core
        core.check_open()
        text = checks.text(text, "system()")
        chat = core.chat.copy()
        tools = _tool_list(tools)
        chat.declare_tools(core.rt.tokenizer, tools)
        fmt = chat.tool_format(core.rt.tokenizer)
        core.pending.extend(chat.add(core.rt.tokenizer, "system", fmt.system_text(text, tools)))
        core.chat = chat
        return self

    def declare_tools(self, tools: Sequence[Tool]) -> Self:
        """Declare the tools the model may call, without a system prompt of your own (the
        template's default one stays). Only before the first turn; ``system(text,
        tools=...)`` does the same with a system prompt.

        Raises:
            InvalidArgument: turns were already added, or not ``Tool`` values.
        """
        core = self._core
        core.check_open()
        chat = core.chat.copy()
        tools = _tool_list(tools)
        chat.declare_tools(core.rt.tokenizer, tools)
        fmt = chat.tool_format(core.rt.tokenizer)
        text = fmt.system_text("", tools)
        if text:  # a format whose tools live in the system turn's text
            core.pending.extend(chat.add(core.rt.tokenizer, "system", text))
        core.chat = chat
        return self

    def tool_result(self, call_id: str, content: Any) -> Self:
        """Answer a tool call with its result, as the template's tool turn.

        After the results of every call, ``generate()`` continues the assistant's answer
        (only the new tokens are computed). Results of parallel calls may come in any
        order; add them all before the next ``generate()``.

        Args:
            call_id: ``ToolCall.id`` of the call this answers.
            content: the result: a str, or anything JSON can hold (written as JSON).

        Raises:
            InvalidArgument: no call with that id awaits a result.
        """
        core = self._core
        core.check_open()
        text = checks.text(result_text(content), "tool_result()")
        chat = core.chat.copy()
        drop, tokens = chat.add_tool_result(core.rt.tokenizer, call_id, text,
                                            len(core.pending))
        if drop:
            del core.pending[len(core.pending) - drop:]
        core.pending.extend(tokens)
        core.chat = chat
        return self

    @property
    def tools(self) -> list[Tool]:
        """The tools declared in this conversation (without their functions)."""
        self._core.check_open()
        return [Tool.from_openai(t) for t in self._core.chat.tools]

    def user(self, text: str) -> Self:
        """Add a user turn."""
        return self._fill("user", text)

    def assistant(self, text: str, *, tool_calls: Sequence[ToolCall] | None = None
                  ) -> Self:
        """Add an assistant turn (or complete the one a ``cue()`` opened).

        Args:
            text: what the assistant said.
            tool_calls: the calls it made (a conversation replayed from elsewhere, say):
                written in the model's tool format, as if the model had made them; each
                then awaits ``tool_result(call.id, ...)``.

        Raises:
            InvalidArgument: not ``ToolCall`` values, or two calls with one id.
        """
        core = self._core
        core.check_open()
        text = checks.text(text, "assistant()")
        calls = list(tool_calls or ())
        if not all(isinstance(c, ToolCall) for c in calls) or \
                len({c.id for c in calls}) != len(calls):
            raise InvalidArgument("tool_calls= takes ToolCall values with distinct ids")
        chat = core.chat.copy()
        core.pending.extend(chat.add_assistant(core.rt.tokenizer, text, calls))
        core.chat = chat
        return self

    def cue(self) -> Self:
        """Open the assistant turn: add the template's generation prompt (e.g.
        ``<|im_start|>assistant\\n``). A no-op while the turn is already open."""
        core = self._core
        core.check_open()
        core.pending.extend(core.chat.cue(core.rt.tokenizer))
        return self

    def append(self, tokens: Sequence[int] | str) -> Self:
        """Add raw token ids, or raw text tokenized without any template."""
        core = self._core
        core.check_open()
        if isinstance(tokens, str):
            ids = list(core.rt.tokenizer.encode(checks.text(tokens, "append()")))
        else:
            ids = checks.token_ids(tokens, core.rt.info.vocab_size, "append")
        core.pending.extend(ids)
        core.chat.note_raw()
        return self

    def _fill(self, role: str, text: str) -> Self:
        core = self._core
        core.check_open()
        text = checks.text(text, f"{role}()")
        core.pending.extend(core.chat.add(core.rt.tokenizer, role, text))
        return self

    def _tool_offer(self, tools: Sequence[Tool] | None, choice: str | None,
                    parallel: bool, answer: dict[str, Any] | None = None
                    ) -> ToolOffer | None:
        """What a generation offers the model: the tools, the choice, the constraint."""
        core = self._core
        declared = {t["function"]["name"]: t for t in core.chat.tools}
        if tools is None and choice is None and not declared:
            return None
        if not declared:
            raise InvalidArgument("declare the tools first, in the prompt the model reads: "
                                  "system(text, tools=[...]) or declare_tools([...])")
        if tools is None:
            offered = [Tool.from_openai(t) for t in declared.values()]
        else:
            offered = _tool_list(tools)
            for t in offered:
                if declared.get(t.name) != t.to_openai():
                    raise InvalidArgument(
                        f"tool {t.name!r} was not declared in this conversation (or was "
                        f"declared with another description or schema); declared: "
                        f"{', '.join(declared)}")
        fmt = core.chat.tool_format(core.rt.tokenizer)
        choice = check_choice("auto" if choice is None else choice, offered)
        return ToolOffer(fmt, offered, choice,
                         fmt.constraint(offered, choice, parallel, answer))


def _tool_list(tools: Any) -> list[Tool]:
    """``tools=`` checked: a non-empty list of ``Tool`` values with distinct names."""
    if isinstance(tools, Tool) or not isinstance(tools, Sequence) or not tools or \
            not all(isinstance(t, Tool) for t in tools):
        raise InvalidArgument("tools= takes a non-empty list of pie_ctx.tools.Tool "
                              "(Tool.from_function(fn), Tool(name, description, parameters))")
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise InvalidArgument(f"two tools share a name: {names}")
    return list(tools)
