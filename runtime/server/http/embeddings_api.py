"""``POST /v1/embeddings``: OpenAI's embeddings endpoint, from the hidden states the engine
already returns (``Forward.hidden_states``, the final norm's output: the lm_head's input).

Owner: the HTTP app. Written against the public SDK only: each input is a fresh
``Context`` (on the adapter ``model`` names, if any) fed through explicit forward passes
of at most :data:`CHUNK` tokens that ask for the hidden state of every position; the sum
(or the last row) is kept, the context released. Inputs run concurrently, so the engine
batches them like any requests.

Pooling (docs/http.md, "Embeddings"): the **mean** of every token's final-norm hidden state,
then L2-normalized, unless the body's extension field ``"pooling": "last"`` asks for the
last token's. Mean is the default because the models served here are generative, not
trained as embedders: a causal LM's last state is shaped to predict the next token, so it
says more about what comes next than about the text; the mean covers every token and
does not swing on a trailing space or full stop. Normalized, so a dot product is the
cosine similarity (what OpenAI's embeddings promise too).

Body: ``{"input": str | [str] | [int] | [[int]], "model", "encoding_format": "float" |
"base64", "dimensions" (refused), "user" (ignored), "pooling": "mean" | "last"}``. Reply:
``{"object": "list", "data": [{"object": "embedding", "index", "embedding"}], "model",
"usage": {"prompt_tokens", "total_tokens"}}``; base64 is little-endian float32, as OpenAI.
Errors use OpenAI's body: 400 (a bad body, an empty input, an input over the context
length), 404 ``model_not_found``.
"""

from __future__ import annotations

import base64
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import numpy as np

from pie_ctx import Context, Runtime, gather
from pie_ctx.proto.errors import PieError
from runtime.server.http.conversation.errors import error_response

__all__ = ["EmbeddingRoutes", "CHUNK", "MAX_INPUTS"]

CHUNK = 256  # tokens per forward pass: bounds one reply's hidden states (CHUNK rows)
MAX_INPUTS = 2048  # inputs per request, as OpenAI's limit
_MAX_BODY = 8 << 20


class _Body(msgspec.Struct, forbid_unknown_fields=True):
    input: Any  # str | [str] | [int] | [[int]], checked in _token_lists
    model: str
    encoding_format: str = "float"
    dimensions: int | None = None
    user: str | None = None
    pooling: str = "mean"


class _Refused(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


class EmbeddingRoutes:
    """The route over one runtime (``get_runtime()`` is called per request).

    Args:
        get_runtime: the app's runtime.
        model_name: the base model's name (``model`` may name it).
        adapters: the engine's LoRA adapters now (``model`` may name one).
    """

    def __init__(self, get_runtime: Callable[[], Runtime], model_name: str,
                 adapters: Callable[[], Sequence[Any]]) -> None:
        from starlette.routing import Route

        self.get_runtime, self.model_name, self.adapters = get_runtime, model_name, adapters
        self.routes = [Route("/v1/embeddings", self.embeddings, methods=["POST"])]

    async def embeddings(self, request: Any) -> Any:
        from starlette.responses import JSONResponse

        try:
            body = await self._body(request)
            adapter = self._adapter(body.model)
            rt = self.get_runtime()
            inputs = self._token_lists(rt, body.input)
            rows = await gather(*(self._embed(rt, tokens, adapter, body.pooling)
                                  for tokens in inputs))
        except _Refused as e:
            return error_response(e.status, e.message, "invalid_request_error", e.param, e.code)
        except PieError as err:
            return error_response(400, str(err), "invalid_request_error")
        data = [{"object": "embedding", "index": i, "embedding": self._encoded(row, body)}
                for i, row in enumerate(rows)]
        used = sum(len(tokens) for tokens in inputs)
        return JSONResponse({"object": "list", "data": data, "model": body.model,
                             "usage": {"prompt_tokens": used, "total_tokens": used}})

    @staticmethod
    async def _body(request: Any) -> _Body:
        raw = bytearray()
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > _MAX_BODY:
                raise _Refused(413, f"the request body is over {_MAX_BODY} bytes")
        try:
            body = msgspec.json.decode(bytes(raw), type=_Body)
        except msgspec.ValidationError as err:
            raise _Refused(400, f"invalid body: {err}") from None
        except msgspec.DecodeError:
            raise _Refused(400, "the body must be JSON: {\"input\": ..., \"model\": ...}") \
                from None
        if body.encoding_format not in ("float", "base64"):
            raise _Refused(400, "'encoding_format' must be 'float' or 'base64'",
                           "encoding_format")
        if body.pooling not in ("mean", "last"):
            raise _Refused(400, "'pooling' must be 'mean' (the default) or 'last'", "pooling")
        if body.dimensions is not None:
            raise _Refused(400, "'dimensions' is not supported: the embedding is the model's "
                                "hidden size; leave it out", "dimensions")
        return body

    def _adapter(self, model: str) -> str | None:
        if model == self.model_name:
            return None
        names = [a.name for a in self.adapters()]
        if model in names:
            return model
        raise _Refused(404, f"The model '{model}' does not exist; this server serves "
                            f"'{self.model_name}'" + (f" and the adapters {names}" if names
                                                      else ""), "model", "model_not_found")

    @staticmethod
    def _token_lists(rt: Runtime, given: Any) -> list[list[int]]:
        """One token list per input (OpenAI's four shapes of ``input``)."""
        def ids(item: Any) -> bool:
            return isinstance(item, list) and all(
                isinstance(t, int) and not isinstance(t, bool) for t in item)

        if isinstance(given, str) or (ids(given) and given):
            given = [given]
        if not isinstance(given, list) or not all(isinstance(i, str) or ids(i) for i in given):
            raise _Refused(400, "'input' must be a string, a list of strings, a list of token "
                                "ids, or a list of such lists", "input")
        if not given:
            raise _Refused(400, "'input' must not be empty", "input")
        if len(given) > MAX_INPUTS:
            raise _Refused(400, f"'input' holds at most {MAX_INPUTS} items", "input")
        out = []
        for item in given:
            tokens = rt.tokenizer.encode(item) if isinstance(item, str) else item
            if any(not 0 <= t < rt.info.vocab_size for t in tokens):
                raise _Refused(400, f"token ids must be in [0, {rt.info.vocab_size})", "input")
            if not tokens:
                raise _Refused(400, "every input must hold at least one token", "input")
            if len(tokens) > rt.info.max_seq_len:
                raise _Refused(400, f"an input of {len(tokens)} tokens is over the model's "
                                    f"context length of {rt.info.max_seq_len}", "input")
            out.append(tokens)
        return out

    @staticmethod
    async def _embed(rt: Runtime, tokens: list[int], adapter: str | None,
                     pooling: str) -> np.ndarray:
        """The pooled, L2-normalized final-norm hidden state of ``tokens``."""
        async with Context(rt, adapter=adapter) as ctx:
            total = np.zeros(rt.info.hidden_size, dtype=np.float64)
            for start in range(0, len(tokens), CHUNK):
                chunk = tokens[start:start + CHUNK]
                wanted = range(len(chunk)) if pooling == "mean" else [len(chunk) - 1]
                out = await ctx.forward().input(chunk).hidden_states(wanted).execute()
                rows = np.stack(out.hidden_states).astype(np.float64)
                total = total + rows.sum(axis=0) if pooling == "mean" else rows[-1]
        vec = total / len(tokens) if pooling == "mean" else total
        norm = np.linalg.norm(vec)
        return (vec / norm if norm > 0 else vec).astype(np.float32)

    @staticmethod
    def _encoded(row: np.ndarray, body: _Body) -> Any:
        if body.encoding_format == "base64":
            return base64.b64encode(row.astype("<f4").tobytes()).decode()
        return row.tolist()
