"""``RawContext``: the public raw page handle of a context (``ctx.inner()``).

Owns nothing: every call goes to the runtime, in order with the context's other operations,
and the counters are the runtime's reply. Semantics (exact, SPEC section 3):

- ``reserve_working_pages(n)``: add ``n`` empty working pages; returns False (and changes
  nothing) when the pool cannot provide them right now.
- ``commit_working_pages(k)``: commit the first ``k`` working pages; each must be full.
- ``release_working_pages(n)``: give the last ``n`` working pages back to the pool (their
  tokens go with them).
- ``truncate_working_page_tokens(n)``: drop the last ``n`` tokens written in working pages
  (page count unchanged).

Every failing call raises a typed error and changes nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pie_ctx import protocol as P
from pie_ctx.counters import Counters

if TYPE_CHECKING:
    from pie_ctx.context import Context

__all__ = ["RawContext"]


class RawContext(Counters):
    """Raw page operations on one context (see the module docstring for exact semantics)."""

    def __init__(self, ctx: Context) -> None:
        self._ctx = ctx

    def _context_state(self) -> P.ContextState:
        return self._ctx._state

    async def _op(self, cls: type, **fields: int) -> P.StateReply:
        ctx = self._ctx

        async def body() -> P.StateReply:
            reply = await ctx._request(cls, fields)
            ctx._state = reply.state
            if cls is not P.ReservePages:
                ctx._chat.synced = False
            return reply

        return await ctx._chain.run(body)

    async def reserve_working_pages(self, n: int) -> bool:
        """Reserve ``n`` more working pages; False = not enough pages right now."""
        return (await self._op(P.ReservePages, num_pages=n)).ok

    async def commit_working_pages(self, k: int) -> None:
        """Commit the first ``k`` working pages (InvalidArgument if one is not full)."""
        await self._op(P.CommitPages, num_pages=k)

    async def release_working_pages(self, n: int) -> None:
        """Release the last ``n`` working pages and the tokens in them."""
        await self._op(P.ReleasePages, num_pages=n)

    async def truncate_working_page_tokens(self, n: int) -> None:
        """Drop the last ``n`` tokens in working pages (never reaches committed pages)."""
        await self._op(P.TruncateTokens, num_tokens=n)
