"""The OpenAI-compatible API as an inferlet: ``/v1/models``, ``/v1/chat/completions``,
``/v1/completions``.

Owner: the HTTP app. This module is written against the public ``pie_ctx`` SDK only (it
never imports the engine): every request is an ordinary pie-ctx program. A chat request
builds a context from its messages with the chat fillers and flushes it once; ``n``
choices are forks of that one prefilled context (the engine decodes them in one batch
and reads their shared prompt once); each choice is a ``generate()`` whose deltas become
the response or its SSE chunks. Earlier turns of a conversation are not remembered here:
the engine's prefix reuse finds their pages again, and ``usage.prompt_tokens_details
.cached_tokens`` says how many prompt tokens it did not have to compute.

Extensions to OpenAI's bodies (docs/http.md): ``top_k``, ``min_p`` and ``snapshot`` (start
the conversation from a saved snapshot: ``Context.open``, then the messages).

Errors use OpenAI's body ``{"error": {"message", "type", "param", "code"}}``: 400 for a bad
request, 404 for an unknown model or snapshot, 413 for a body over ``MAX_BODY_BYTES``, 503
when the engine has no room, 500 otherwise. A malformed body is a 400, never a crash.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import anyio

from pie_ctx import Context, Runtime, gather
from pie_ctx.constrain import JsonSchema
from pie_ctx.proto.errors import (
    ContextTooLong,
    InvalidArgument,
    OutOfPages,
    PieError,
    SnapshotNotFound,
)
from pie_ctx.proto.messages import SamplerSpec

__all__ = ["ApiError", "Observer", "OpenAIService", "error_response"]

MAX_BODY_BYTES = 4 << 20
MAX_N = 16
MAX_STOP = 16
DEFAULT_MAX_TOKENS = 512
_FINISH = {"stop_token": "stop", "stop_string": "stop", "constraint": "stop", "length": "length"}


class Observer(Protocol):
    """Who hears about latencies and token counts (the app's metrics)."""

    def first_token(self, seconds: float) -> None:
        """Request arrival to its first generated token (once per request)."""

    def next_token(self, seconds: float) -> None:
        """Time between two tokens of one choice (once per token after a choice's first)."""

    def tokens(self, prompt: int, cached: int, completion: int) -> None:
        """A finished request's prompt, cached-prompt and completion token counts."""


class ApiError(Exception):
    """A request the API refuses, with OpenAI's error fields."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, type: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = (
            status, message, param, code, type)


def error_response(status: int, message: str, type: str, param: str | None = None,
                   code: str | None = None) -> Any:
    """OpenAI's error body with ``status``."""
    from starlette.responses import JSONResponse

    return JSONResponse({"error": {"message": message, "type": type, "param": param,
                                   "code": code}}, status_code=status)


def _as_api_error(err: BaseException) -> ApiError:
    """The API error an exception from the SDK (or anywhere) becomes."""
    if isinstance(err, ApiError):
        return err
    if isinstance(err, SnapshotNotFound):
        return ApiError(404, str(err), param="snapshot", code="snapshot_not_found")
    if isinstance(err, ContextTooLong):
        return ApiError(400, str(err), param="messages", code="context_length_exceeded")
    if isinstance(err, InvalidArgument):
        return ApiError(400, str(err))
    if isinstance(err, OutOfPages):
        return ApiError(503, f"the engine has no room for this request now: {err}",
                        code="engine_overloaded", type="server_error")
    if isinstance(err, PieError):
        return ApiError(500, f"{type(err).__name__}: {err}", type="server_error")
    return ApiError(500, f"internal error: {type(err).__name__}", type="server_error")


def _error_body(err: ApiError) -> dict[str, Any]:
    return {"error": {"message": err.message, "type": err.type, "param": err.param,
                      "code": err.code}}


# ---------------------------------------------------------------------------- parameters


def _field(body: dict[str, Any], name: str, kinds: type | tuple[type, ...], default: Any = None,
           *, low: float | None = None, high: float | None = None) -> Any:
    """``body[name]`` checked for type (bool is never a number) and range, or ``default``."""
    value = body.get(name)
    if value is None:
        return default
    numeric = kinds in (int, (int, float))
    if isinstance(value, bool) and kinds is not bool or not isinstance(value, kinds):
        want = {int: "an integer", (int, float): "a number", bool: "a boolean",
                str: "a string"}.get(kinds, "valid")  # type: ignore[call-overload]
        raise ApiError(400, f"'{name}' must be {want}, got {json.dumps(value)[:80]}", param=name)
    if numeric and (value != value or (low is not None and value < low)
                    or (high is not None and value > high)):
        raise ApiError(400, f"'{name}' must be in [{low}, {high}], got {value}", param=name)
    return value


def _text_content(content: Any, where: str) -> str:
    """A message's content: a string, or text parts (other part types are refused)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or \
                    not isinstance(part.get("text"), str):
                raise ApiError(400, f"{where}: only text content parts are supported",
                               param="messages")
            texts.append(part["text"])
        return "".join(texts)
    raise ApiError(400, f"{where}: 'content' must be a string or a list of text parts",
                   param="messages")


@dataclass(slots=True)
class _Decoding:
    """What every choice of one request generates with."""

    n: int
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int | None
    stop: list[str]
    logprobs: bool
    top_logprobs: int
    constrain: Any
    logit_bias: dict[int, float] | None

    def sampler(self, choice: int) -> SamplerSpec:
        if self.temperature == 0:
            return SamplerSpec()
        seed = None if self.seed is None else self.seed + choice
        return SamplerSpec(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                           min_p=self.min_p, seed=seed)


def _decoding(body: dict[str, Any], *, chat: bool) -> _Decoding:
    max_tokens = _field(body, "max_completion_tokens", int, None, low=1, high=1 << 20)
    if max_tokens is None:
        max_tokens = _field(body, "max_tokens", int, DEFAULT_MAX_TOKENS, low=1, high=1 << 20)
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    elif not (isinstance(stop, list) and len(stop) <= MAX_STOP
              and all(isinstance(s, str) and s for s in stop)):
        raise ApiError(400, f"'stop' must be a string or a list of at most {MAX_STOP} "
                            "non-empty strings", param="stop")
    if chat:
        logprobs = _field(body, "logprobs", bool, False)
        top = _field(body, "top_logprobs", int, 0, low=0, high=20)
        if top and not logprobs:
            raise ApiError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    else:
        top = _field(body, "logprobs", int, 0, low=0, high=5)
        logprobs = top is not None and "logprobs" in body and body["logprobs"] is not None
    for name in ("presence_penalty", "frequency_penalty"):
        if _field(body, name, (int, float), 0, low=-2, high=2):
            raise ApiError(400, f"'{name}' is not supported (only 0)", param=name)
    bias = body.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, dict) or len(bias) > 1024:
            raise ApiError(400, "'logit_bias' must map token ids to biases", param="logit_bias")
        try:
            bias = {int(k): float(v) for k, v in bias.items()
                    if not isinstance(v, bool) and -100 <= float(v) <= 100}
        except (TypeError, ValueError):
            raise ApiError(400, "'logit_bias' must map token ids (as strings) to numbers in "
                                "[-100, 100]", param="logit_bias") from None
    return _Decoding(
        n=_field(body, "n", int, 1, low=1, high=MAX_N), max_tokens=max_tokens,
        temperature=float(_field(body, "temperature", (int, float), 1.0, low=0, high=2)),
        top_p=float(_field(body, "top_p", (int, float), 1.0, low=0, high=1)) or 1.0,
        top_k=_field(body, "top_k", int, 0, low=0, high=1 << 20),
        min_p=float(_field(body, "min_p", (int, float), 0.0, low=0, high=1)),
        seed=_field(body, "seed", int, None, low=-(1 << 62), high=1 << 62),
        stop=stop, logprobs=bool(logprobs), top_logprobs=top or 0,
        constrain=_response_format(body.get("response_format")) if chat else None,
        logit_bias=bias or None)


def _response_format(fmt: Any) -> Any:
    """``response_format`` -> a ``pie_ctx.constrain`` constraint (or None for text)."""
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return JsonSchema({"type": "object"})
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise ApiError(400, "response_format json_schema needs 'json_schema': "
                                "{'schema': {...}}", param="response_format")
        try:
            return JsonSchema(schema)
        except InvalidArgument as err:
            raise ApiError(400, f"response_format: {err}", param="response_format") from None
    raise ApiError(400, "response_format 'type' must be 'text', 'json_object' or "
                        "'json_schema'", param="response_format")


# ------------------------------------------------------------------------------ choices


@dataclass(slots=True)
class _Choice:
    """One choice's output as it accumulates."""

    index: int
    text: list[str] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None


class _Request:
    """One API request's contexts: a prefilled base and its forks, released at the end."""

    def __init__(self, rt: Runtime, decoding: _Decoding, observer: Observer | None) -> None:
        self.rt, self.d, self.observer = rt, decoding, observer
        self.arrived = time.perf_counter()
        self.contexts: list[Context] = []
        self.prompt_tokens = self.cached_tokens = 0
        self._first_seen = False

    async def prefill(self, base: Context) -> list[Context]:
        """Flush the prompt once; return one context per choice (forks when n > 1)."""
        self.contexts.append(base)
        report = await base.flush()
        self.prompt_tokens = base.seq_len
        self.cached_tokens = max(0, base.seq_len - report.tokens_computed)
        if self.d.n == 1:
            return [base]
        forks = [base.fork() for _ in range(self.d.n)]
        self.contexts.extend(forks)
        return forks

    async def run(self, i: int, ctx: Context, on_delta: Callable[[_Choice, str, int], Any]
                  ) -> _Choice:
        """Generate choice ``i`` on ``ctx``; ``on_delta(choice, text, first_token_index)``
        hears each delta."""
        d, choice = self.d, _Choice(i)
        gen = ctx.generate(d.sampler(i), max_tokens=d.max_tokens, stop=d.stop or None,
                           constrain=d.constrain, logit_bias=d.logit_bias,
                           top_logprobs=d.top_logprobs, cue=False)
        last = None
        async for delta in gen:
            now = time.perf_counter()
            if self.observer is not None:
                if not self._first_seen:
                    self.observer.first_token(now - self.arrived)
                elif last is not None:
                    for _ in delta.tokens:
                        self.observer.next_token((now - last) / max(1, len(delta.tokens)))
            self._first_seen, last = True, now
            start = len(choice.tokens)
            choice.text.append(delta.text)
            choice.tokens.extend(delta.tokens)
            choice.logprobs.extend(delta.logprobs)
            choice.top.extend(delta.top_logprobs)
            await on_delta(choice, delta.text, start)
        choice.finish_reason = _FINISH.get(gen.finish_reason or "", "stop")
        return choice

    async def close(self, choices: list[_Choice]) -> None:
        """Release every context (even when cancelled) and report the token counts."""
        with anyio.CancelScope(shield=True):
            for ctx in reversed(self.contexts):
                try:
                    await ctx.release()
                except PieError:
                    pass
        if self.observer is not None and choices:
            self.observer.tokens(self.prompt_tokens, self.cached_tokens,
                                 sum(len(c.tokens) for c in choices))

    def usage(self, choices: list[_Choice]) -> dict[str, Any]:
        completion = sum(len(c.tokens) for c in choices)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.prompt_tokens + completion,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}


# ----------------------------------------------------------------------------- service


class OpenAIService:
    """The API's routes over one runtime (``get_runtime()`` is called per request)."""

    def __init__(self, get_runtime: Callable[[], Runtime], model_name: str,
                 observer: Observer | None = None) -> None:
        from starlette.routing import Route

        self.get_runtime, self.model_name, self.observer = get_runtime, model_name, observer
        self.created = int(time.time())
        self.routes = [
            Route("/v1/models", self._guard(self.models), methods=["GET"]),
            Route("/v1/models/{model:path}", self._guard(self.model), methods=["GET"]),
            Route("/v1/chat/completions", self._guard(self.chat), methods=["POST"]),
            Route("/v1/completions", self._guard(self.completions), methods=["POST"]),
        ]

    def _guard(self, handler: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """Any failure before the response starts becomes OpenAI's error body."""

        async def guarded(request: Any) -> Any:
            try:
                return await handler(request)
            except Exception as err:  # noqa: BLE001 - every error gets a body, none a crash
                e = _as_api_error(err)
                return error_response(e.status, e.message, e.type, e.param, e.code)

        return guarded

    # ------------------------------------------------------------------------ models

    def _model_card(self) -> dict[str, Any]:
        return {"id": self.model_name, "object": "model", "created": self.created,
                "owned_by": "pie-ctx"}

    async def models(self, request: Any) -> Any:
        from starlette.responses import JSONResponse

        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, request: Any) -> Any:
        from starlette.responses import JSONResponse

        self._check_model(request.path_params["model"])
        return JSONResponse(self._model_card())

    def _check_model(self, model: Any) -> None:
        if not isinstance(model, str):
            raise ApiError(400, "'model' must be a string", param="model")
        if model != self.model_name:
            raise ApiError(404, f"The model '{model}' does not exist; this server serves "
                                f"'{self.model_name}'", param="model", code="model_not_found")

    @staticmethod
    async def _body(request: Any) -> dict[str, Any]:
        raw = b""
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > MAX_BODY_BYTES:
                raise ApiError(413, f"the request body is over {MAX_BODY_BYTES} bytes")
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError):
            raise ApiError(400, "the request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        return body

    # ------------------------------------------------------------------ completions

    async def chat(self, request: Any) -> Any:
        body = await self._body(request)
        self._check_model(body.get("model"))
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ApiError(400, "'messages' must be a non-empty list", param="messages")
        turns = []
        for i, m in enumerate(messages):
            role = m.get("role") if isinstance(m, dict) else None
            if role not in ("system", "developer", "user", "assistant"):
                raise ApiError(400, f"messages[{i}]: role must be system, developer, user or "
                                    f"assistant (tool messages are not supported by this "
                                    f"server)", param="messages")
            turns.append(("system" if role == "developer" else role,
                          _text_content(m.get("content"), f"messages[{i}]")))
        snapshot = _field(body, "snapshot", str, None)
        decoding = _decoding(body, chat=True)

        async def build(rt: Runtime) -> Context:
            ctx = await Context.open(rt, snapshot) if snapshot else Context(rt)
            for role, text in turns:
                getattr(ctx, role)(text)
            return ctx.cue()

        return await self._respond(body, decoding, build, chat=True)

    async def completions(self, request: Any) -> Any:
        body = await self._body(request)
        self._check_model(body.get("model"))
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        ok = isinstance(prompt, str) and prompt or (
            isinstance(prompt, list) and prompt
            and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt))
        if not ok:
            raise ApiError(400, "'prompt' must be a non-empty string or list of token ids "
                                "(one prompt per request)", param="prompt")
        if body.get("echo"):
            raise ApiError(400, "'echo' is not supported", param="echo")
        if body.get("suffix"):
            raise ApiError(400, "'suffix' is not supported", param="suffix")
        decoding = _decoding(body, chat=False)

        async def build(rt: Runtime) -> Context:
            return Context(rt).append(prompt)

        return await self._respond(body, decoding, build, chat=False)

    async def _respond(self, body: dict[str, Any], d: _Decoding,
                       build: Callable[[Runtime], Any], *, chat: bool) -> Any:
        stream = _field(body, "stream", bool, False)
        options = body.get("stream_options")
        include_usage = isinstance(options, dict) and options.get("include_usage") is True
        rt = self.get_runtime()
        req = _Request(rt, d, self.observer)
        ident = ("chatcmpl-" if chat else "cmpl-") + _new_id()
        head = {"id": ident, "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()), "model": self.model_name}
        if not stream:
            choices: list[_Choice] = []
            try:
                contexts = await req.prefill(await build(rt))

                async def quiet(choice: _Choice, text: str, start: int) -> None:
                    return None

                choices = await gather(*(req.run(i, c, quiet) for i, c in enumerate(contexts)))
            finally:
                await req.close(choices)
            from starlette.responses import JSONResponse

            out = [self._choice_body(rt, c, chat, d.logprobs) for c in choices]
            return JSONResponse({**head, "choices": out, "usage": req.usage(choices)})
        # Streaming: prefill first, so a refused prompt is still a plain error response.
        try:
            contexts = await req.prefill(await build(rt))
        except BaseException:
            await req.close([])
            raise
        from sse_starlette.sse import EventSourceResponse

        chunk_object = "chat.completion.chunk" if chat else "text_completion"
        events = self._stream(rt, req, contexts, {**head, "object": chunk_object}, chat,
                              include_usage)
        return EventSourceResponse(events, ping=15)

    async def _stream(self, rt: Runtime, req: _Request, contexts: list[Context],
                      head: dict[str, Any], chat: bool, include_usage: bool
                      ) -> AsyncIterator[dict[str, str]]:
        """SSE events: a role chunk per choice (chat), content chunks, finish chunks, the
        usage chunk if asked, ``[DONE]``. Leaving early (the client went away) cancels the
        generations and releases the contexts."""
        send, receive = anyio.create_memory_object_stream[dict[str, Any]](256)
        choices: list[_Choice] = []

        def chunk(index: int, delta: dict[str, Any], finish: str | None,
                  logprobs: Any = None) -> dict[str, Any]:
            if chat:
                c = {"index": index, "delta": delta, "logprobs": logprobs,
                     "finish_reason": finish}
            else:
                c = {"index": index, "text": delta.get("content", ""), "logprobs": logprobs,
                     "finish_reason": finish}
            return {**head, "choices": [c]}

        async def on_delta(choice: _Choice, text: str, start: int) -> None:
            lp = self._logprobs(rt, choice, start, chat) if req.d.logprobs else None
            await send.send(chunk(choice.index, {"content": text}, None, lp))

        scope = anyio.CancelScope()

        async def produce() -> None:
            # In the runtime's task group, not in this generator: a task group must not
            # stay open across a generator's yields.
            with scope:
                async with send:
                    try:
                        if chat:
                            for i in range(len(contexts)):
                                await send.send(chunk(i, {"role": "assistant", "content": ""},
                                                      None))
                        done = await gather(*(req.run(i, c, on_delta)
                                              for i, c in enumerate(contexts)))
                        choices.extend(done)
                        for c in done:
                            await send.send(chunk(c.index, {}, c.finish_reason))
                        if include_usage:
                            await send.send({**head, "choices": [], "usage": req.usage(done)})
                    except Exception as err:  # noqa: BLE001 - after the headers: an error event
                        await send.send(_error_body(_as_api_error(err)))

        rt.spawn(produce)
        try:
            async with receive:
                async for message in receive:
                    yield {"data": json.dumps(message)}
            yield {"data": "[DONE]"}
        finally:  # done, or the client went away: stop generating, release the contexts
            scope.cancel()
            await req.close(choices)

    # --------------------------------------------------------------------- bodies

    def _choice_body(self, rt: Runtime, c: _Choice, chat: bool, logprobs: bool
                     ) -> dict[str, Any]:
        lp = self._logprobs(rt, c, 0, chat) if logprobs else None
        text = "".join(c.text)
        if chat:
            return {"index": c.index, "message": {"role": "assistant", "content": text},
                    "logprobs": lp, "finish_reason": c.finish_reason}
        return {"index": c.index, "text": text, "logprobs": lp,
                "finish_reason": c.finish_reason}

    def _logprobs(self, rt: Runtime, c: _Choice, start: int, chat: bool) -> Any:
        """OpenAI's logprobs of choice ``c``'s tokens from ``start`` on."""
        tok = rt.tokenizer

        def piece(token_id: int) -> str:
            return tok.decode([token_id])

        ids, lps = c.tokens[start:], c.logprobs[start:]
        tops = c.top[start:] if c.top else [[] for _ in ids]
        if chat:
            content = []
            for t, lp, top in zip(ids, lps, tops, strict=False):
                text = piece(t)
                content.append({"token": text, "logprob": lp, "bytes": list(text.encode()),
                                "top_logprobs": [{"token": piece(a), "logprob": b,
                                                  "bytes": list(piece(a).encode())}
                                                 for a, b in top]})
            return {"content": content}
        texts = [piece(t) for t in ids]
        offsets, pos = [], sum(len(piece(t)) for t in c.tokens[:start])
        for text in texts:
            offsets.append(pos)
            pos += len(text)
        return {"tokens": texts, "token_logprobs": lps,
                "top_logprobs": [{piece(a): b for a, b in top} for top in tops] if c.top
                else None, "text_offset": offsets}


def _new_id() -> str:
    import secrets

    return secrets.token_hex(12)
