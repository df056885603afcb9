"""KV compaction of a conversation's context: what ``POST /v1/responses/compact`` computes.

Owner: choosing which of a context's tokens stay (pie_ctx.policies) and compacting it
(``Context.compact``, docs/compaction.md), written against the public SDK only.

* ``snapkv`` (the default): the context's last ``window`` tokens vote. They are read once
  more by a probe forked from the context, whose attention scores over the context say
  what they attend to; the scores are smoothed (``pooled``) and the highest kept, with the
  window itself: ``budget`` tokens in all.
* ``streaming``: the first few tokens (attention sinks) and the most recent ones.

The kept tokens' K/V stay as they were computed, at their positions; nothing is recomputed
and the compacted context answers from ``budget`` tokens instead of all of them.
"""

from __future__ import annotations

from pie_ctx import Context
from pie_ctx.policies import heavy_hitters_keep, pooled, streaming_keep

__all__ = ["compact_context", "default_budget"]


def default_budget(seq_len: int, window: int) -> int:
    """Tokens kept when a request names no budget: a quarter of the context, and at least
    four windows."""
    return max(4 * window, seq_len // 4)


async def compact_context(ctx: Context, budget: int, window: int, policy: str) -> int:
    """Compact ``ctx`` (everything written first) to at most ``budget`` tokens by
    ``policy``. Returns the tokens it holds after."""
    await ctx.flush()
    n = ctx.seq_len
    if n <= budget:
        return n
    window = min(window, budget // 2)
    if policy == "streaming":
        keep = streaming_keep(n, budget)
    else:
        tail = (await ctx.tokens())[n - window:]
        probe = ctx.fork()
        try:
            out = await (probe.forward().input(tail)
                         .attention_scores(range(len(tail))).execute())
        finally:
            await probe.release()
        keep = heavy_hitters_keep(pooled(out.attention_scores[0][:n]), budget, window)
    await ctx.compact(keep)
    return ctx.seq_len
