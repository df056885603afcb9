"""Cache holds HTTP clients ask for: Anthropic's ``cache_control`` breakpoints, OpenAI's
``prompt_cache_retention``, and the hold a turn that ends in tool calls takes while the
client runs them.

Owner: the server's table of the holds it took for HTTP requests (each one a
``Context.retain`` through the runtime the context is on, docs/pages.md "Holds"). A hold is named by the
caller's key scope and a digest of the tokens it covers, so a prefix asked for again
refreshes its hold (a new time to live, as a cache hit does on Anthropic's API) instead
of charging its pages twice. Each key may hold at most ``key_share`` of the engine's
budget of held pages (``rt.info.max_held_pages_per_owner``): one tenant cannot pin the
pool for the others. A hold that does not fit is not taken (logged): caching is a
promise about speed, never a reason to fail a request.
"""

from __future__ import annotations

import hashlib
import logging
import time
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pie_ctx import Context, Runtime
from pie_ctx.proto.errors import HoldLimit, HoldNotFound

__all__ = ["PromptHolds", "RETENTION_S", "TOOL_WAIT_S"]

log = logging.getLogger("pie_ctx.http")

# OpenAI's prompt_cache_retention: "in_memory" keeps a prefix 5 to 10 minutes after its
# last use, "24h" a day.
RETENTION_S = {"in_memory": 600.0, "24h": 86400.0}
TOOL_WAIT_S = 30.0  # a turn that ends in tool calls is held this long (serve --tool-hold)


@dataclass(slots=True)
class _Held:
    rt: Any  # the runtime that took it (only its owner may end it)
    hold: int  # the engine's hold id
    num_pages: int
    until: float  # on ``clock``


class PromptHolds:
    """The holds the HTTP APIs took (see the module docstring).

    Args:
        key_share: the share of the engine's budget of held pages per owner
            (``rt.info.max_held_pages_per_owner``) one key may use.
        clock: seconds, monotonic (tests pass their own).
    """

    def __init__(self, key_share: float = 0.5,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.key_share, self.clock = key_share, clock
        self._held: dict[tuple[str, str], _Held] = {}

    def pages_of(self, key: str) -> int:
        """Pages the live holds of ``key`` cover."""
        now = self.clock()
        return sum(h.num_pages for (k, _), h in self._held.items() if k == key and h.until > now)

    async def hold(self, rt: Runtime, ctx: Context, key: str, ttl: float, *,
                   num_tokens: int | None = None, prompt: Sequence[int] = (),
                   salt: str = "") -> int:
        """Hold the committed pages of ``ctx`` (on ``rt``)'s first ``num_tokens`` tokens
        (None: all of them) for ``ttl`` seconds for ``key``. ``prompt`` (the tokens those
        are) and ``salt`` (what else makes them distinct: the model, a snapshot) name the
        prefix: a hold of the same name replaces the earlier one. An empty ``prompt``
        names a hold of its own.

        Returns:
            The pages held (0: nothing was, because there is no whole page to hold, or the
            key's share or the engine's budget is spent).
        """
        now = self.clock()
        size = ctx.seq_len + len(ctx.pending_tokens) if num_tokens is None else num_tokens
        digest = salt + ":" + (hashlib.blake2b(array("q", prompt[:size]).tobytes(),
                                               digest_size=16).hexdigest()
                               if prompt else f"#{id(ctx)}:{now}")
        for name in [n for n, h in self._held.items() if h.until <= now]:
            del self._held[name]  # ended in the engine too (on its own clock)
        old = self._held.pop((key, digest), None)
        if old is not None:
            try:
                await old.rt.release_hold(old.hold)
            except HoldNotFound:
                pass
        budget = rt.info.max_held_pages_per_owner or 0
        page_size = rt.info.page_size
        wanted = size // page_size
        if wanted == 0:
            return 0
        if budget and self.pages_of(key) + wanted > budget * self.key_share:
            log.info("a cache hold of %d pages was not taken: key %s holds %d pages, its "
                     "share is %d", wanted, key, self.pages_of(key),
                     int(budget * self.key_share))
            return 0
        try:
            reply = await ctx.retain(ttl, num_tokens=num_tokens)
        except HoldLimit as err:
            log.info("a cache hold was not taken: %s", err)
            return 0
        self._held[(key, digest)] = _Held(rt, reply.hold, reply.num_pages, now + reply.ttl)
        return reply.num_pages
