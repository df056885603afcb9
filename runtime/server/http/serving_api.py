"""vLLM's serving endpoints beside the OpenAI API: ``/tokenize``, ``/detokenize``,
``/health`` and ``/version``.

Owner: these four routes. Written against the public SDK only, like the rest of the front
door: ``/tokenize`` with ``messages`` builds the conversation exactly as a chat request
does (``conversation.turns.build_context``, never flushed, so it computes nothing) and
returns the tokens the chat request would have prefilled. The request and response shapes are vLLM's
(docs/http.md, "vLLM's serving endpoints"); errors are OpenAI's error body.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

from pie_ctx import Runtime
from runtime.server.http.conversation.errors import ApiError, guard
from runtime.server.http.conversation.turns import build_context
from runtime.server.http.openai.chat import rendering_of, tools_of, turns_of
from runtime.server.http.openai.schema import Message, ToolSpec, decode_body

__all__ = ["ServingRoutes", "TokenizeRequest", "DetokenizeRequest"]

MAX_TOKENS_IN = 1 << 20


class TokenizeRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """vLLM's ``/tokenize`` body: ``prompt`` (a completion's) or ``messages`` (a chat's)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = None
    tools: list[ToolSpec] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool | None = None


class DetokenizeRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """vLLM's ``/detokenize`` body."""

    tokens: list[int]
    model: str | None = None


TOKENIZE_ACCEPTS = {
    "model": "a string (the served model's id), or null",
    "prompt": "a string (give prompt or messages)",
    "messages": "a non-empty list of chat messages, as /v1/chat/completions takes them",
    "tools": "a list of tools, as /v1/chat/completions takes them, or null",
    "add_special_tokens": "true or false (default: true for a prompt, false for messages)",
    "add_generation_prompt": "true or false, or null",
    "continue_final_message": "true or false, or null",
    "chat_template_kwargs": "an object of extra variables for the chat template, or null",
    "return_token_strs": "true or false, or null",
    "tokens": f"a list of token ids (integers), at most {MAX_TOKENS_IN}",
}


class ServingRoutes:
    """The four routes over one runtime (``get_runtime()`` is called per request)."""

    def __init__(self, get_runtime: Callable[[], Runtime], model_name: str,
                 check_model: Callable[[Any], Any]) -> None:
        from starlette.routing import Route

        self.get_runtime, self.model_name, self.check_model = (
            get_runtime, model_name, check_model)
        self.routes = [
            Route("/tokenize", guard(self.tokenize), methods=["POST"]),
            Route("/detokenize", guard(self.detokenize), methods=["POST"]),
            Route("/health", guard(self.health), methods=["GET"]),
            Route("/version", guard(self.version), methods=["GET"]),
        ]

    async def tokenize(self, request: Any) -> Any:
        from starlette.responses import JSONResponse

        req = await decode_body(request, TokenizeRequest, TOKENIZE_ACCEPTS)
        adapter = None if req.model is None else self.check_model(req.model)
        rt = self.get_runtime()
        if (req.prompt is None) == (req.messages is None):
            raise ApiError(400, "give exactly one of 'prompt' and 'messages'", param="prompt")
        if req.prompt is not None:
            special = req.add_special_tokens is not False
            tokens = list(rt.tokenizer.encode(req.prompt, add_special_tokens=special))
        else:
            if not req.messages:
                raise ApiError(400, "'messages' must not be empty", param="messages")
            if req.add_special_tokens:
                raise ApiError(400, "'add_special_tokens' is for a prompt: the chat template "
                                    "writes the specials of messages",
                               param="add_special_tokens")
            tools = tools_of(req)  # type: ignore[arg-type]
            rendering = rendering_of(req)  # type: ignore[arg-type]
            ctx = await build_context(rt, turns_of(req.messages), tools, None, adapter,
                                      rendering)
            try:
                tokens = list(ctx.pending_tokens)
            finally:
                await ctx.release()
        strs = [rt.tokenizer.decode([t]) for t in tokens] if req.return_token_strs else None
        return JSONResponse({"count": len(tokens), "max_model_len": rt.info.max_seq_len,
                             "tokens": tokens, "token_strs": strs})

    async def detokenize(self, request: Any) -> Any:
        from starlette.responses import JSONResponse

        req = await decode_body(request, DetokenizeRequest, TOKENIZE_ACCEPTS)
        if req.model is not None:
            self.check_model(req.model)
        rt = self.get_runtime()
        vocab = rt.info.vocab_size
        if len(req.tokens) > MAX_TOKENS_IN:
            raise ApiError(400, f"at most {MAX_TOKENS_IN} tokens", param="tokens")
        bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise ApiError(400, f"token id {bad} is out of range [0, {vocab})", param="tokens")
        return JSONResponse({"prompt": rt.tokenizer.decode(req.tokens)})

    async def health(self, request: Any) -> Any:
        from starlette.responses import Response

        self.get_runtime()  # no runtime (starting or stopping): the guard's 500/503
        return Response(status_code=200)

    async def version(self, request: Any) -> Any:
        from starlette.responses import JSONResponse

        from pie_ctx import __version__

        return JSONResponse({"version": __version__})
