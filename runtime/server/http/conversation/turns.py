"""The conversation every chat-shaped API builds: turns, tools, and the context holding them.

Owner: the one mapping from a conversation (turns with their tool calls and results, the
tools offered) onto a ``Context``, which the chat completions (``openai``), the Messages
API (``anthropic``), the Responses API (``responses``) and vLLM's serving endpoints share:
each API turns its own request into :class:`Turn` values and SDK tools, and this module
builds the context. Written against the public SDK only (``pie_ctx``, ``pie_ctx.tools``):
it never imports the engine.

How a conversation is built (docs/http.md):

* the tools are declared at the start of the context: ``system(text, tools=...)`` when the
  first turn is a system turn, else ``declare_tools(tools)``;
* without tools, past calls and results are plain text (:func:`plain_history`): call markup
  in the prompt would be copied into answers where nothing reads it as a call;
* every turn goes through the SDK's chat fillers: ``system``, ``user``, ``assistant(text,
  tool_calls=...)`` (a past call, with the client's id, written as the model would have
  written it) and ``tool_result(id, text)``, then ``cue()``. The context then holds what
  ``apply_chat_template`` gives for the whole conversation.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pie_ctx import Context, Runtime
from pie_ctx.proto.errors import InvalidArgument
from pie_ctx.tools import Tool, ToolCall
from runtime.server.http.conversation.errors import ApiError

__all__ = ["Turn", "Rendering", "build_context", "fill_turns", "join_text", "make_tools",
           "parse_arguments", "plain_history"]

P = TypeVar("P")


@dataclass(slots=True)
class Turn:
    """One message of the request, checked: a role the SDK knows, its text, and for an
    assistant its tool calls (with the client's ids), for a tool result the call it
    answers."""

    index: int  # in the request's messages, for error messages
    role: str  # system | user | assistant | tool
    text: str
    calls: list[ToolCall] = field(default_factory=list)
    call_id: str = ""


def join_text(content: str | Iterable[P] | None, text_of: Callable[[P], str | None],
              refuse: Callable[[int, P], ApiError]) -> str:
    """A message's text: a string as it is, or its parts' texts joined (``text_of``: a
    part's text, None for a part that is not text, which ``refuse(j, part)`` refuses).

    Raises:
        ApiError: ``refuse``'s, for the first part that is not text.
    """
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        text = text_of(part)
        if text is None:
            raise refuse(j, part)
        texts.append(text)
    return "".join(texts)


def parse_arguments(args: str | dict[str, Any]) -> dict[str, Any] | None:
    """A call's arguments as sent (a JSON object, or its text; empty text is ``{}``), or
    None when they are not a JSON object."""
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            return None
    return args if isinstance(args, dict) else None


def make_tools(specs: Iterable[tuple[str, str | None, Any]]) -> list[Tool]:
    """SDK tools from ``(name, description, parameters)`` in a request's order: the one
    check every front door (chat, Responses, Messages) makes of its ``tools``.

    Raises:
        ApiError: a bad name or parameters (``tools[i]``), or two tools with one name.
    """
    tools = []
    for i, (name, description, parameters) in enumerate(specs):
        try:
            tools.append(Tool(name=name, description=description or "",
                              parameters=dict(parameters or {})))
        except InvalidArgument as err:
            raise ApiError(400, f"tools[{i}]: {err}", param="tools") from None
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise ApiError(400, f"two tools share a name: {names}", param="tools")
    return tools


@dataclass(frozen=True, slots=True)
class Rendering:
    """vLLM's template options (``chat_template_kwargs``, ``continue_final_message``,
    ``add_generation_prompt``): the conversation is rendered whole by the chat template
    with these variables, and appended as it is."""

    variables: dict[str, Any]
    generation_prompt: bool = True
    continue_final: bool = False


# ------------------------------------------------------------------------- building


async def build_context(rt: Runtime, turns: list[Turn], tools: list[Tool],
                        snapshot: str | None, adapter: str | None = None,
                        rendering: Rendering | None = None,
                        marks: dict[int, int] | None = None) -> Context:
    """A context holding the conversation, its assistant turn opened, on LoRA ``adapter``
    (None: the base model; a snapshot keeps the adapter it was saved under). With a
    ``rendering``, the template renders the whole conversation with its variables (and
    ``marks`` stays empty). ``marks``: see :func:`fill_turns`.

    Raises:
        ApiError: tool messages that answer no call, tools a snapshot cannot take.
        PieError: from the SDK (an unknown snapshot, a template that refuses a turn).
    """
    ctx = await Context.open(rt, snapshot) if snapshot else Context(rt, adapter=adapter)
    try:
        if rendering is not None:
            ctx.append(_rendered(rt, turns, rendering))
        else:
            fill_turns(ctx, turns, tools, marks)
    except BaseException:
        await ctx.release()
        raise
    return ctx


def fill_turns(ctx: Context, turns: list[Turn], tools: list[Tool],
               marks: dict[int, int] | None = None, *, cue: bool = True) -> None:
    """Fill ``turns`` into ``ctx`` (declaring ``tools`` first) and open the assistant turn
    (unless not ``cue``).
    Without tools (none given, none declared by a snapshot), past calls and their results
    are written as plain text (:func:`plain_history`): no call markup the model could copy
    into an answer that no parser would read.

    ``marks`` (when given) receives, for each turn's ``index``, the context's length in
    tokens once that index's last turn is in (the tools are declared with the first turn):
    where a cache breakpoint after that message falls.
    """
    if tools:
        rest = _declare(ctx, turns, tools)
        if marks is not None and len(rest) < len(turns):
            marks[turns[0].index] = _length(ctx)
    else:
        rest = turns if ctx.tools else plain_history(turns)
    for turn in rest:
        try:
            if turn.role == "tool":
                ctx.tool_result(turn.call_id, turn.text)
            elif turn.role == "assistant":
                ctx.assistant(turn.text, tool_calls=turn.calls)
            else:
                getattr(ctx, turn.role)(turn.text)
        except InvalidArgument as err:
            raise ApiError(400, f"messages[{turn.index}]: {err}", param="messages") from None
        if marks is not None:
            marks[turn.index] = _length(ctx)
    if cue:
        ctx.cue()


def _length(ctx: Context) -> int:
    return ctx.seq_len + len(ctx.pending_tokens)


def plain_history(turns: list[Turn]) -> list[Turn]:
    """``turns`` with their tool calls and results as plain text, for a request without
    tools: an assistant turn's calls become sentences after its text (``Called get_weather
    with {"city": "Paris"}.``), each run of tool results one user turn (``Result of
    get_weather: ...``). A conversation without calls comes back as it is.

    Raises:
        ApiError: a result whose id names no earlier call.
    """
    names: dict[str, str] = {}  # the calls made so far: id -> tool name
    out: list[Turn] = []
    results: Turn | None = None  # the user turn the current run of results goes into
    for turn in turns:
        if turn.role == "tool":
            if turn.call_id not in names:
                raise ApiError(400, f"messages[{turn.index}]: no tool call with id "
                                    f"{turn.call_id!r} awaits a result", param="messages")
            line = f"Result of {names[turn.call_id]}: {turn.text}"
            if results is None:
                results = Turn(turn.index, "user", line)
                out.append(results)
            else:
                results.text += "\n" + line
            continue
        results = None
        if turn.calls:
            names.update((c.id, c.name) for c in turn.calls)
            said = [turn.text] if turn.text else []
            said += [f"Called {c.name} with {json.dumps(c.arguments, ensure_ascii=False)}."
                     for c in turn.calls]
            turn = Turn(turn.index, "assistant", "\n".join(said))
        out.append(turn)
    return out


def _declare(ctx: Context, turns: list[Turn], tools: list[Tool]) -> list[Turn]:
    """Declare ``tools`` in the context; return the turns left to fill."""
    declared = ctx.tools  # a snapshot's conversation may have declared them already
    if declared:
        if [t.to_openai() for t in declared] != [t.to_openai() for t in tools]:
            raise ApiError(400, "the snapshot's conversation declared other tools: "
                                f"{', '.join(t.name for t in declared)}", param="tools")
        return turns
    try:
        if turns and turns[0].role == "system":
            ctx.system(turns[0].text, tools=tools)
            return turns[1:]
        ctx.declare_tools(tools)
    except InvalidArgument as err:
        raise ApiError(400, str(err), param="tools") from None
    return turns


def _rendered(rt: Runtime, turns: list[Turn], rendering: Rendering) -> str:
    """The conversation as the template renders it with ``rendering``'s variables; with
    ``continue_final``, cut right after the last message's text (as vLLM does)."""
    messages: list[dict[str, Any]] = []
    for t in turns:
        message: dict[str, Any] = {"role": t.role, "content": t.text}
        if t.calls:
            message["tool_calls"] = [{"id": c.id, "type": "function",
                                      "function": {"name": c.name, "arguments": c.arguments}}
                                     for c in t.calls]
        if t.role == "tool":
            message["tool_call_id"] = t.call_id
        messages.append(message)
    text = rt.tokenizer.render_chat(messages, add_generation_prompt=rendering.generation_prompt,
                                    **rendering.variables)
    if rendering.continue_final:
        last = turns[-1].text
        at = text.rfind(last) if last else -1
        if at < 0:
            raise ApiError(400, "continue_final_message: the template does not write the last "
                                "message's text as it is", param="continue_final_message")
        text = text[: at + len(last)]
    return text
