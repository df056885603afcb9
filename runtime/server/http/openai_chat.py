"""A chat request's messages and tools onto a ``Context``, and tool calls back to OpenAI.

Owner: the mapping between OpenAI's conversation (messages, ``tools``, ``tool_choice``,
assistant ``tool_calls``, ``tool`` messages) and the SDK's. Written against the public SDK
only (``pie_ctx``, ``pie_ctx.tools``), like the rest of the front door: it never imports
the engine.

How a conversation is built (docs/http.md):

* the tools are declared at the start of the context: ``system(text, tools=...)`` when the
  first message is a system (or developer) message, else ``declare_tools(tools)``;
* every turn up to the first one that carries tool calls goes through the SDK's chat
  fillers (``user``, ``assistant``, ``system``), then ``cue()``;
* the SDK has no filler for a *past* assistant turn with tool calls (their ids are the
  client's), nor for a tool result that answers one. From the first such turn on, the
  remaining turns are rendered with the chat template exactly as the SDK renders a
  conversation (the same messages: each past call is the assistant message the SDK would
  have recorded had the model written it, each result the tool format's tool message) and
  the difference from the turns already filled is appended, with the generation prompt.
  The context then holds what ``apply_chat_template`` gives for the whole conversation.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pie_ctx import Context, Runtime
from pie_ctx.proto.errors import InvalidArgument, PieError
from pie_ctx.tools import Tool, ToolCall, tool_format
from runtime.server.http.openai_schema import (
    ApiError,
    AssistantMessage,
    ChatRequest,
    Content,
    DeveloperMessage,
    Message,
    SystemMessage,
    ToolMessage,
    UserMessage,
)

__all__ = ["Turn", "turns_of", "tools_of", "tool_choice_of", "build_context", "openai_call"]

_CHOICES = ("auto", "none", "required")


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


def _text(content: Content | None, where: str) -> str:
    """A message's content: a string, or text parts (other part types are refused)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for part in content:
        if part.type != "text" or part.text is None:
            raise ApiError(400, f"{where}: only text content parts are supported (got a "
                                f"{part.type!r} part)", param="messages")
        texts.append(part.text)
    return "".join(texts)


def _calls(m: AssistantMessage, where: str) -> list[ToolCall]:
    calls = []
    for j, c in enumerate(m.tool_calls or ()):
        args: Any = c.function.arguments
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                args = None
        if not isinstance(args, dict):
            raise ApiError(400, f"{where}.tool_calls[{j}].function.arguments must be a JSON "
                                f"object (as a string)", param="messages")
        calls.append(ToolCall(id=c.id, name=c.function.name, arguments=args))
    if len({c.id for c in calls}) != len(calls):
        raise ApiError(400, f"{where}: two tool calls share an id", param="messages")
    return calls


def turns_of(messages: Sequence[Message]) -> list[Turn]:
    """The request's messages as turns (``developer`` is a system turn).

    Raises:
        ApiError: a content part that is not text, or tool-call arguments that are not a
            JSON object.
    """
    turns = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if isinstance(m, SystemMessage | DeveloperMessage):
            turns.append(Turn(i, "system", _text(m.content, where)))
        elif isinstance(m, UserMessage):
            turns.append(Turn(i, "user", _text(m.content, where)))
        elif isinstance(m, AssistantMessage):
            turns.append(Turn(i, "assistant", _text(m.content, where), _calls(m, where)))
        elif isinstance(m, ToolMessage):
            turns.append(Turn(i, "tool", _text(m.content, where), call_id=m.tool_call_id))
        else:  # refused when the body was decoded
            raise RuntimeError(f"unexpected message type {type(m).__name__}")
    return turns


def tools_of(req: ChatRequest) -> list[Tool]:
    """The request's ``tools`` as SDK tools (an empty list: none).

    Raises:
        ApiError: a bad name or parameters, or two tools with one name.
    """
    tools = []
    for i, spec in enumerate(req.tools or ()):
        f = spec.function
        try:
            tools.append(Tool(name=f.name, description=f.description or "",
                              parameters=dict(f.parameters or {})))
        except InvalidArgument as err:
            raise ApiError(400, f"tools[{i}]: {err}", param="tools") from None
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise ApiError(400, f"two tools share a name: {names}", param="tools")
    return tools


def tool_choice_of(req: ChatRequest, tools: Sequence[Tool]) -> str | None:
    """``tool_choice`` as the SDK takes it: ``"auto"``, ``"none"``, ``"required"`` or a
    tool's name; None when not given.

    Raises:
        ApiError: a choice without tools, or a named tool that is not among them.
    """
    choice = req.tool_choice
    if choice is None:
        return None
    if not tools:
        raise ApiError(400, "'tool_choice' is only allowed when 'tools' are given",
                       param="tool_choice")
    if isinstance(choice, str):
        return choice
    name = choice.function.name
    if name not in {t.name for t in tools}:
        raise ApiError(400, f"tool_choice names {name!r}, which is not one of the tools",
                       param="tool_choice")
    return name


def openai_call(call: ToolCall, index: int | None = None) -> dict[str, Any]:
    """OpenAI's ``tool_calls`` entry; with ``index``, as a streamed delta carries it."""
    entry = call.to_openai()
    return entry if index is None else {"index": index, **entry}


# ------------------------------------------------------------------------- building


async def build_context(rt: Runtime, turns: list[Turn], tools: list[Tool],
                        snapshot: str | None) -> Context:
    """A context holding the conversation, its assistant turn opened.

    Raises:
        ApiError: tool messages that answer no call, tools a snapshot cannot take.
        PieError: from the SDK (an unknown snapshot, a template that refuses a turn).
    """
    ctx = await Context.open(rt, snapshot) if snapshot else Context(rt)
    try:
        _fill(ctx, rt, turns, tools, from_snapshot=snapshot is not None)
    except BaseException:
        # Releasing a context whose creation is still in flight raises ContextClosed
        # although it is released (the SDK releases it twice); nothing else can fail here.
        with contextlib.suppress(PieError):
            await ctx.release()
        raise
    return ctx


def _fill(ctx: Context, rt: Runtime, turns: list[Turn], tools: list[Tool], *,
          from_snapshot: bool) -> None:
    fmt = tool_format(rt.tokenizer)
    split = next((i for i, t in enumerate(turns) if t.calls or t.role == "tool"), len(turns))
    if from_snapshot and split < len(turns):
        raise ApiError(400, "tool calls and tool messages cannot follow a snapshot (its "
                            "earlier turns are not in the request)", param="messages")
    template: list[dict[str, Any]] = []  # the conversation as the SDK renders it
    rest = turns
    if tools:
        rest = _declare(ctx, fmt, turns, tools, template)
    waiting: dict[str, str] = {}  # call id -> tool name, for calls not answered yet
    head = len(template)  # messages filled through the SDK
    for turn in rest:
        message = _message(fmt, turn, waiting)
        if turn.index < split:
            getattr(ctx, turn.role)(turn.text)
            head += 1
        template.append(message)
    if split == len(turns):
        ctx.cue()
        return
    variables = fmt.template_vars([t.to_openai() for t in tools]) if tools else {}
    try:
        done = rt.tokenizer.render_chat(template[:head], False, **variables) if head else ""
        whole = rt.tokenizer.render_chat(template, True, **variables)
    except InvalidArgument as err:
        raise ApiError(400, str(err), param="messages") from None
    if not whole.startswith(done):
        raise ApiError(400, "the chat template renders the earlier turns differently once "
                            "the tool calls are added", param="messages")
    ctx.append(whole[len(done):])


def _declare(ctx: Context, fmt: Any, turns: list[Turn], tools: list[Tool],
             template: list[dict[str, Any]]) -> list[Turn]:
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
            template.append({"role": "system",
                             "content": fmt.system_text(turns[0].text, tools)})
            return turns[1:]
        ctx.declare_tools(tools)
    except InvalidArgument as err:
        raise ApiError(400, str(err), param="tools") from None
    text = fmt.system_text("", tools)
    if text:  # a format whose tools live in the system turn's text
        template.append({"role": "system", "content": text})
    return turns


def _message(fmt: Any, turn: Turn, waiting: dict[str, str]) -> dict[str, Any]:
    """The template message of ``turn``, as the SDK records it."""
    where = f"messages[{turn.index}]"
    if turn.role == "tool":
        name = waiting.pop(turn.call_id, None)
        if name is None:
            raise ApiError(400, f"{where}: tool_call_id {turn.call_id!r} answers no tool call "
                                f"of an earlier assistant message (waiting: "
                                f"{', '.join(waiting) or 'none'})", param="messages")
        return fmt.tool_message(turn.call_id, name, turn.text)
    if turn.role != "assistant" or not turn.calls:
        return {"role": turn.role, "content": turn.text}
    waiting.clear()
    waiting.update({c.id: c.name for c in turn.calls})
    raw = _model_text(fmt.name, turn.text, turn.calls)
    parsed = fmt.parse(raw)
    if [(c.name, c.arguments) for c in parsed.calls] != \
            [(c.name, c.arguments) for c in turn.calls]:
        raise ApiError(400, f"{where}: these tool calls cannot be written in the model's "
                            f"tool format", param="messages")
    parsed.calls = list(turn.calls)  # the client's ids
    return fmt.assistant_message(raw, parsed)


def _model_text(format_name: str, content: str, calls: list[ToolCall]) -> str:
    """What the model writes for ``content`` and ``calls`` in a tool format (the inverse
    of the format's ``parse``; the SDK does not expose one)."""
    bodies = [{"name": c.name, "arguments": c.arguments} for c in calls]
    if format_name == "hermes":
        blocks = "\n".join(f"<tool_call>\n{json.dumps(b, ensure_ascii=False)}\n</tool_call>"
                           for b in bodies)
        return f"{content}\n{blocks}" if content else blocks
    if format_name == "generic":  # one JSON object; it has no room for content
        body = {"tool_call": bodies[0]} if len(bodies) == 1 else {"tool_calls": bodies}
        return json.dumps(body, ensure_ascii=False)
    raise RuntimeError(f"no way to write calls in the tool format {format_name!r}")
