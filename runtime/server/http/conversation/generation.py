"""One request's generation from prefill to release, whatever API it came through.

Owner: a request's contexts and counts. An :class:`Exchange` prefills a context (one
``flush()``: the prompt tokens, and the cached ones the engine's prefix reuse did not have
to compute), forks it into choices, hears every delta (time to the first token, time
between tokens, completion tokens), and at the end releases every context it holds,
shielded from cancellation so that a client that goes away leaves no pages behind, then
reports the counts to the access log and the app's metrics (:class:`Observer`). The APIs
render the counts in their own ``usage`` shapes. Written against the public SDK only.
"""

from __future__ import annotations

import time
from typing import Protocol

import anyio

from pie_ctx import Context
from pie_ctx.proto.errors import PieError
from runtime.server.http.access_log import note_tokens

__all__ = ["Exchange", "Observer", "release"]


class Observer(Protocol):
    """Who hears about latencies and token counts (the app's metrics)."""

    def first_token(self, seconds: float) -> None:
        """Request arrival to its first generated token (once per request)."""

    def next_token(self, seconds: float) -> None:
        """Time between two tokens of one choice (once per token after a choice's first)."""

    def tokens(self, prompt: int, cached: int, completion: int) -> None:
        """A finished request's prompt, cached-prompt and completion token counts."""


async def release(ctx: Context) -> None:
    """Release ``ctx``, even when the caller is being cancelled (a failure to release one
    already gone is not the request's)."""
    with anyio.CancelScope(shield=True):
        try:
            await ctx.release()
        except PieError:
            pass


class Exchange:
    """One request's contexts (released together by :meth:`close`) and token counts.

    ``prompt_tokens`` and ``cached_tokens`` add up over every :meth:`prefill` (a response
    that calls server-side tools prefills once a round), ``completion_tokens`` over every
    delta :meth:`heard`.
    """

    def __init__(self, observer: Observer | None) -> None:
        self.observer = observer
        self.arrived = time.perf_counter()
        self.contexts: list[Context] = []
        self.prompt_tokens = self.cached_tokens = self.completion_tokens = 0
        self.first_token: float | None = None  # perf_counter of the first generated token

    def hold(self, ctx: Context) -> Context:
        """``ctx``, released by :meth:`close` (unless it was already held)."""
        if all(c is not ctx for c in self.contexts):
            self.contexts.append(ctx)
        return ctx

    async def prefill(self, ctx: Context, forks: int = 1) -> list[Context]:
        """Flush what ``ctx`` has pending; count its prompt. Returns ``forks`` contexts to
        generate on: ``ctx`` itself when one, else that many forks of it (the engine reads
        their shared prompt once)."""
        self.hold(ctx)
        report = await ctx.flush()
        self.prompt_tokens += ctx.seq_len
        self.cached_tokens += max(0, ctx.seq_len - report.tokens_computed)
        if forks == 1:
            return [ctx]
        return [self.hold(ctx.fork()) for _ in range(forks)]

    def heard(self, num_tokens: int, last: float | None = None) -> float:
        """Count a delta of ``num_tokens`` tokens; ``last``: when the same choice's
        previous delta came (None for its first). Returns now, the next call's ``last``."""
        now = time.perf_counter()
        self.completion_tokens += num_tokens
        if num_tokens and self.first_token is None:
            self.first_token = now
            if self.observer is not None:
                self.observer.first_token(now - self.arrived)
        elif num_tokens and last is not None and self.observer is not None:
            for _ in range(num_tokens):
                self.observer.next_token((now - last) / num_tokens)
        return now

    async def close(self, finished: bool) -> None:
        """Release every context held (shielded), then report the counts (to the metrics
        only when the request ``finished``)."""
        for ctx in reversed(self.contexts):
            await release(ctx)
        self.contexts.clear()
        note_tokens(self.prompt_tokens, self.completion_tokens)
        if self.observer is not None and finished:
            self.observer.tokens(self.prompt_tokens, self.cached_tokens,
                                 self.completion_tokens)
