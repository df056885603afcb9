"""Bounded replies and fair shares of the page pool, over both transports."""

from __future__ import annotations

import anyio
import pytest

from pie_ctx import Context, Runtime, Sampler, gather
from pie_ctx.errors import InvalidArgument, OutOfPages
from runtime.server.testing import serve_in_background
from tests.sdk.harness import sdk_owners, tiny_engine

GREEDY = Sampler.greedy()


async def test_a_request_for_a_huge_reply_is_refused_up_front(tiny_folder, transport):
    async with sdk_owners(tiny_folder, transport, 1, max_reply_bytes=2**20) as ((rt,), engine):
        info = rt.info
        assert info.max_reply_bytes == 2**20 and info.max_mask_entries > 0
        ctx = Context(rt).append([1, 2, 3])
        rows = info.max_reply_bytes // (4 * info.vocab_size) + 1  # one row over the limit
        with pytest.raises(InvalidArgument, match="reply of about"):
            await ctx.forward().input([4]).logits([0] * rows).execute()
        out = await ctx.forward().input([4]).logits([0] * (rows // 2)).execute()
        assert len(out.logits) == rows // 2  # under the limit it is served
        assert ctx.seq_len == 4



async def test_attention_scores_count_in_the_reply_limit(tiny_folder, transport):
    """Scores are 4 bytes per KV entry per row: one row per layer (by_layer) and per query
    head (heads="all"); a pass or a generation that could exceed the limit is refused up
    front and changes nothing, while the same scores reduced to one row are served."""
    from pie_ctx.proto.messages import ScoresSpec
    async with sdk_owners(tiny_folder, transport, 1, max_reply_bytes=2**14) as ((rt,), engine):
        info = rt.info
        assert info.score_heads >= 1 and info.score_layers >= 1
        rows = info.score_layers * info.score_heads
        n = 2**14 // (4 * rows) + 1  # KV entries past which one all-rows spec is too big
        ctx = Context(rt).append([1 + i % 200 for i in range(n)])
        await ctx.flush()
        with pytest.raises(InvalidArgument, match="attention scores with fewer rows"):
            await ctx.forward().input([4]).attention_scores([0], heads="all",
                                                            by_layer=True).execute()
        assert ctx.seq_len == n
        out = await ctx.forward().input([4]).attention_scores([0]).execute()
        assert out.attention_scores[0].shape == (n + 1,)
        with pytest.raises(InvalidArgument, match="attention scores may come to"):
            await ctx.generate(GREEDY, max_tokens=2,
                               attention_scores=ScoresSpec(heads="all", by_layer=True)).text()
        assert (await ctx.refresh()).seq_len == n + 1

async def test_the_server_caps_replies_at_its_frame_limit(tiny_folder):
    """A server with small frames lowers the engine's reply limit before any client comes:
    a request for more is refused up front, changes nothing, and the connection lives."""
    async with tiny_engine(tiny_folder) as engine, \
            serve_in_background(engine, run_engine=False, max_frame_bytes=64 * 1024) as srv, \
            Runtime.connect(srv.address) as rt:
        assert rt.info.max_reply_bytes < 64 * 1024
        ctx = Context(rt).append([1, 2, 3])
        with pytest.raises(InvalidArgument, match="reply of about"):
            await ctx.forward().input([4]).logits([0] * 100).execute()  # ~106 KB of logits
        assert (await ctx.refresh()).seq_len == 0  # nothing was written
        assert ctx.pending_tokens == [1, 2, 3]
        assert (await ctx.forward().input([4]).logits([0]).execute()).logits


async def test_a_client_beyond_its_share_is_the_one_that_fails(tiny_folder, transport):
    async with sdk_owners(tiny_folder, transport, 2, num_pages=64, stall_timeout=0.5,
                          owner_share=0.5) as ((good, hostile), engine):
        share = good.info.max_pages_per_owner
        assert share == 32
        grabber = Context(hostile)
        raw = grabber.inner()
        with pytest.raises(OutOfPages, match="share"):
            await raw.reserve_working_pages(share + 1)
        assert await raw.reserve_working_pages(share - 1)  # up to its share: fine
        # The other client is unaffected: its generation runs to the end.
        text = await Context(good).user("hello").generate(GREEDY, max_tokens=40,
                                                           ignore_eos=True).text()
        assert text
        # The greedy client's own work fails, with a message about its own usage.
        hungry = Context(hostile).append(list(range(1, 30)))
        with anyio.fail_after(30), pytest.raises(OutOfPages) as info:
            await hungry.generate(GREEDY, max_tokens=40, ignore_eos=True).text()
        assert "your contexts hold" in str(info.value) and f"{share}-page share" in str(info.value)
        await raw.release_working_pages(share - 1)
        assert await hungry.generate(GREEDY, max_tokens=8, ignore_eos=True).text() is not None
        engine.store.check_invariants()


async def test_shares_hold_under_concurrent_load(tiny_folder, transport):
    """Two well-behaved clients and one that tries to take the pool: the well-behaved ones
    finish, with the same outputs as alone."""
    async with sdk_owners(tiny_folder, transport, 3, num_pages=96, stall_timeout=0.5,
                          owner_share=0.4) as ((a, b, hostile), engine):
        async def run(rt, prompt: str) -> list[int]:
            return await Context(rt).user(prompt).generate(GREEDY, max_tokens=30,
                                                           ignore_eos=True).tokens()

        alone = [await run(a, "one"), await run(b, "two")]

        async def hog() -> None:
            held = []
            for _ in range(20):
                ctx = Context(hostile)
                try:
                    await ctx.inner().reserve_working_pages(8)
                except OutOfPages:
                    break
                held.append(ctx)

        with anyio.fail_after(60):
            got = await gather(run(a, "one"), run(b, "two"), hog())
        assert got[:2] == alone
        engine.store.check_invariants()
