"""``RawContext``: the public raw page handle of a context (``ctx.inner()``).

Owns nothing: every call goes to the runtime, in order with the context's other operations,
and the counters are the runtime's reply. Semantics (exact; see docs/sdk.md):

- ``reserve_working_pages(n)``: add ``n`` empty working pages; returns False (and changes
  nothing) when the pool cannot provide them right now.
- ``commit_working_pages(k)``: commit the first ``k`` working pages; each must be full.
- ``release_working_pages(n)``: give the last ``n`` working pages back to the pool (their
  tokens go with them).
- ``truncate_working_page_tokens(n)``: drop the last ``n`` tokens written in working pages
  (page count unchanged).
- ``compact(keep)``: keep only the KV tokens at ``keep`` (sorted indices or ranges), at
  their positions; pending tokens are neither written nor dropped (docs/compaction.md).

Every failing call raises a typed error and changes nothing.
"""

from __future__ import annotations

from typing import Any

from pie_ctx.core import ContextCore
from pie_ctx.counters import Counters
from pie_ctx.proto import checks
from pie_ctx.proto import messages as P

__all__ = ["RawContext"]


class RawContext(Counters):
    """Raw page operations on one context (see the module docstring for exact semantics)."""

    def __init__(self, core: ContextCore) -> None:
        self._core = core

    def _context_state(self) -> P.ContextState:
        self._core.check_open()
        return self._core.state

    async def _op(self, cls: type, what: str, n: int) -> P.StateReply:
        core = self._core
        n = checks.count(n, what)
        field = "num_tokens" if cls is P.TruncateTokens else "num_pages"

        async def body() -> P.StateReply:
            reply = await core.request(cls, **{field: n})
            core.set_state(reply.state)
            if cls is not P.ReservePages:
                core.chat.synced = False
            return reply

        return await core.run(body)

    async def reserve_working_pages(self, n: int) -> bool:
        """Reserve ``n`` more working pages; False = not enough pages right now."""
        return (await self._op(P.ReservePages, "reserve_working_pages(n)", n)).ok

    async def commit_working_pages(self, k: int) -> None:
        """Commit the first ``k`` working pages (InvalidArgument if one is not full)."""
        await self._op(P.CommitPages, "commit_working_pages(k)", k)

    async def release_working_pages(self, n: int) -> None:
        """Release the last ``n`` working pages and the tokens in them."""
        await self._op(P.ReleasePages, "release_working_pages(n)", n)

    async def truncate_working_page_tokens(self, n: int) -> None:
        """Drop the last ``n`` tokens in working pages (never reaches committed pages)."""
        await self._op(P.TruncateTokens, "truncate_working_page_tokens(n)", n)

    async def compact(self, keep: Any) -> P.ContextState:
        """Keep only the KV cache's tokens at ``keep`` (sorted indices, ``range``s or
        ``(start, stop)`` pairs); see ``Context.compact``. Pending tokens stay pending."""
        core = self._core
        indices = checks.keep_ranges(keep)

        async def body() -> P.ContextState:
            checks.keep(indices, core.state.seq_len)
            core.set_state((await core.request(P.Compact, keep=indices)).state)
            core.chat.synced = False
            return core.state

        return await core.run(body)

