"""A chat request's messages, tools and template options as the shared conversation, and
tool calls back in OpenAI's shape.

Owner: the mapping between OpenAI's conversation (messages, ``tools``, ``tool_choice``,
assistant ``tool_calls``, ``tool`` messages, vLLM's template options) and the shared
conversation's turns and SDK tools (``conversation.turns``, which builds the context).
Written against the public SDK only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pie_ctx.tools import Tool, ToolCall
from runtime.server.http.conversation.decoding import tool_choice_of as checked_choice
from runtime.server.http.conversation.errors import ApiError
from runtime.server.http.conversation.turns import (
    Rendering,
    Turn,
    join_text,
    make_tools,
    parse_arguments,
)
from runtime.server.http.openai.schema import (
    AssistantMessage,
    ChatRequest,
    Content,
    ContentPart,
    DeveloperMessage,
    Message,
    SystemMessage,
    ToolMessage,
    UserMessage,
)

__all__ = ["turns_of", "tools_of", "tool_choice_of", "rendering_of", "openai_call"]


def _text(content: Content | None, where: str) -> str:
    """A message's content: a string, or text parts (other part types are refused)."""

    def text_of(part: ContentPart) -> str | None:
        return part.text if part.type == "text" else None

    def refuse(j: int, part: ContentPart) -> ApiError:
        return ApiError(400, f"{where}: only text content parts are supported (got a "
                             f"{part.type!r} part)", param="messages")

    return join_text(content, text_of, refuse)


def _calls(m: AssistantMessage, where: str) -> list[ToolCall]:
    calls = []
    for j, c in enumerate(m.tool_calls or ()):
        args = parse_arguments(c.function.arguments)
        if args is None:
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
    return make_tools((s.function.name, s.function.description, s.function.parameters)
                      for s in req.tools or ())


def tool_choice_of(req: ChatRequest, tools: Sequence[Tool]) -> str | None:
    """``tool_choice`` as the SDK takes it: ``"auto"``, ``"none"``, ``"required"`` or a
    tool's name; None when not given.

    Raises:
        ApiError: a choice without tools, or a named tool that is not among them.
    """
    choice = req.tool_choice
    if isinstance(choice, str) or choice is None:
        return checked_choice(choice, tools, without_tools="'tool_choice' is only allowed "
                                                          "when 'tools' are given")
    return checked_choice("named", tools, name=choice.function.name,
                          without_tools="'tool_choice' is only allowed when 'tools' are "
                                        "given")


_RESERVED = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token",
                       "documents", "continue_final_message"})


def rendering_of(req: ChatRequest) -> Rendering | None:
    """The request's template options; None when it gives none (the SDK's chat fillers
    then build the conversation turn by turn).

    Raises:
        ApiError: options that contradict each other or the tools.
    """
    variables = req.chat_template_kwargs or {}
    cont = bool(req.continue_final_message)
    prompt = req.add_generation_prompt
    if not variables and not cont and prompt is None:
        return None
    if cont and prompt:
        raise ApiError(400, "'continue_final_message' continues the last (assistant) "
                            "message: it cannot be combined with 'add_generation_prompt': "
                            "true", param="continue_final_message")
    if req.tools:
        name = ("chat_template_kwargs" if variables else "continue_final_message" if cont
                else "add_generation_prompt")
        raise ApiError(400, f"'{name}' cannot be combined with 'tools' here: tools are "
                            f"declared through the SDK's conversation", param=name)
    reserved = sorted(_RESERVED & set(variables))
    if reserved:
        raise ApiError(400, f"chat_template_kwargs may not set {reserved}: the request's own "
                            f"fields say them", param="chat_template_kwargs")
    if cont and not isinstance(req.messages[-1], AssistantMessage):
        raise ApiError(400, "'continue_final_message' needs the last message to be the "
                            "assistant's", param="continue_final_message")
    return Rendering(dict(variables), (True if prompt is None else prompt) and not cont, cont)


def openai_call(call: ToolCall, index: int | None = None) -> dict[str, Any]:
    """OpenAI's ``tool_calls`` entry; with ``index``, as a streamed delta carries it."""
    entry = call.to_openai()
    return entry if index is None else {"index": index, **entry}


