"""Ownership: a connection owns its contexts; leaving (any way) releases them and only them."""

from __future__ import annotations

import anyio
import pytest

from pie_ctx.errors import ContextClosed
from pie_ctx.proto import messages as P
from runtime.server.testing import serve_in_background
from tests.server.helpers import HELLO, RawClient, collect, connect, fake_engine, wait_settled


async def test_one_connection_cannot_touch_anothers_contexts():
    engine = fake_engine()
    async with serve_in_background(engine) as srv:
        async with connect(srv.address) as alice:
            async with connect(srv.address) as mallory:
                a = (await alice.request(P.CreateContext())).ctx
                await alice.request(P.Forward(ctx=a, tokens=[1, 2, 3, 4, 5]))
                before = (await alice.request(P.GetState(ctx=a))).state
                for req in (P.GetState(ctx=a), P.ForkContext(ctx=a), P.ReleaseContext(ctx=a),
                            P.Forward(ctx=a, tokens=[1]), P.TruncateTokens(ctx=a, num_tokens=1),
                            P.ReservePages(ctx=a, num_pages=1), P.SaveSnapshot(ctx=a, name="x")):
                    with pytest.raises(ContextClosed):
                        await mallory.request(req)
                _, final = await collect(await mallory.generate(P.Generate(ctx=a, tokens=[1])))
                assert isinstance(final, P.ErrorReply) and final.kind == "ContextClosed"
                assert (await alice.request(P.GetState(ctx=a))).state == before
            # mallory left: that releases nothing of alice's
            assert (await alice.request(P.GetState(ctx=a))).state == before
        await wait_settled(engine)


async def test_snapshots_outlive_their_connection():
    engine = fake_engine()
    async with serve_in_background(engine) as srv:
        async with connect(srv.address) as t:
            a = (await t.request(P.CreateContext())).ctx
            await t.request(P.Forward(ctx=a, tokens=list(range(1, 10))))
            await t.request(P.SaveSnapshot(ctx=a, name="keep"))
        with anyio.fail_after(5):
            while engine.stats().num_contexts:
                await anyio.sleep(0.01)
        async with connect(srv.address) as t2:
            b = await t2.request(P.OpenSnapshot(name="keep"))
            assert b.state.seq_len == 9
            await t2.request(P.DeleteSnapshot(name="keep"))
        await wait_settled(engine)


@pytest.mark.parametrize("how", ["bye", "close", "abort_mid_generation", "framing_error"])
async def test_leaving_releases_everything_owned(how: str):
    engine = fake_engine(num_pages=1024)
    async with serve_in_background(engine) as srv:
        async with connect(srv.address) as bystander:
            keep = (await bystander.request(P.CreateContext())).ctx
            await bystander.request(P.Forward(ctx=keep, tokens=[9, 8, 7, 6, 5]))
            if how == "bye":
                async with connect(srv.address) as t:
                    for _ in range(3):
                        c = (await t.request(P.CreateContext())).ctx
                        await t.request(P.Forward(ctx=c, tokens=list(range(1, 20))))
                # leaving sent Bye: released before the Ok came back
                assert engine.stats().num_contexts == 1
            else:
                raw = await RawClient.open(srv.address, HELLO)
                await raw.call(1, P.CreateContext())
                ctx = (await raw.receive()).reply.ctx
                await raw.call(2, P.Forward(ctx=ctx, tokens=list(range(1, 30))))
                await raw.receive()
                await raw.call(3, P.ForkContext(ctx=ctx))
                fork = (await raw.receive()).reply.ctx
                if how != "close":
                    await raw.call(4, P.Generate(ctx=fork, tokens=[3], max_tokens=2000,
                                                 stop_token_ids=[]))
                    assert isinstance((await raw.receive()).reply, P.GenerateChunk)
                if how == "framing_error":
                    await raw.send_bytes(b"\xff\xff\xff\xff")  # a 4 GiB frame: refused, closed
                    msg = await raw.receive()
                    for _ in range(5000):  # generation chunks may come first
                        if msg.id == 0:
                            break
                        msg = await raw.receive()
                    assert msg.reply.kind == "ProtocolError" and "exceeds" in msg.reply.message
                await raw.aclose()  # abrupt: no Bye, generation still running
            with anyio.fail_after(10):
                while engine.stats().num_contexts != 1:
                    await anyio.sleep(0.01)
            assert (await bystander.request(P.GetState(ctx=keep))).state.seq_len == 5
        await wait_settled(engine)
        assert engine.stats().num_pages_used == 0
