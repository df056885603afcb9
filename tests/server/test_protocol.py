"""The wire protocol: frames, handshake, every request type, bad input, cancellation."""

from __future__ import annotations

import anyio
import msgspec
import pytest

from pie_ctx.errors import ContextClosed, InvalidArgument, ProtocolError, SnapshotNotFound
from pie_ctx.proto import messages as P
from pie_ctx.proto import wire
from pie_ctx.proto.framing import FrameReader, FramingError, encode_frame
from pie_ctx.transport import LocalTransport
from runtime.server.testing import serve_in_background
from tests.server.helpers import HELLO, RawClient, collect, connect, fake_engine, wait_settled

# ------------------------------------------------------------------------------ framing


class _Chunks:
    """A receive stream that hands out the given byte chunks, then ends."""

    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = list(chunks)

    async def receive(self, max_bytes: int = 65536) -> bytes:
        if not self.chunks:
            raise anyio.EndOfStream
        return self.chunks.pop(0)


async def test_frames_survive_any_chunking():
    payloads = [b"a", b"bc" * 1000, b"\x00" * 70000]
    data = b"".join(encode_frame(p) for p in payloads)
    for step in (1, 3, 4, 5, 4096, len(data)):
        reader = FrameReader(_Chunks([data[i:i + step] for i in range(0, len(data), step)]))
        assert [await reader.receive() for _ in payloads] == payloads
        assert await reader.receive() is None


async def test_bad_frames_are_framing_errors():
    with pytest.raises(FramingError, match="exceeds the limit of 10"):
        await FrameReader(_Chunks([encode_frame(b"x" * 11)]), max_frame_bytes=10).receive()
    with pytest.raises(FramingError, match="empty frame"):
        await FrameReader(_Chunks([b"\x00\x00\x00\x00"])).receive()
    with pytest.raises(FramingError, match="middle of a frame"):
        await FrameReader(_Chunks([encode_frame(b"hello")[:-1]])).receive()
    with pytest.raises(FramingError):
        encode_frame(b"")

# ---------------------------------------------------------------------------- handshake


async def test_handshake_reports_engine_info_and_tokenizer():
    engine = fake_engine()
    async with serve_in_background(engine) as srv:
        async with connect(srv.address) as t:
            assert t.info == engine.info()
            assert t.namespace == "default"
            assert t.tokenizer.decode([0, 1, 2]) == "abc"
        async with connect(srv.address, namespace="team-a") as sub:
            assert sub.namespace == "default/team-a"


async def test_handshake_refusals():
    async with serve_in_background(fake_engine()) as srv:
        raw = await RawClient.open(srv.address)
        await raw.send(wire.Hello(protocol_version=99))
        reply = await raw.receive()
        assert reply.reply.kind == "ProtocolError" and "version 99" in reply.reply.message
        assert await raw.receive() is None  # closed
        raw = await RawClient.open(srv.address)
        await raw.call(1, P.GetInfo())  # no Hello first
        assert "expected Hello" in (await raw.receive()).reply.message
        with pytest.raises(ProtocolError, match="namespace"):
            async with connect(srv.address, namespace="../other"):
                pass
        srv.server.handshake_timeout = 0.2
        silent = await RawClient.open(srv.address)
        assert await silent.receive(timeout=3) is None  # dropped after the timeout
        async with connect(srv.address) as t:  # the server still serves others
            assert t.info == srv.server.engine.info()

# ------------------------------------------------------------------- every request type


async def _script(t, cancel_gen: bool = False) -> list[object]:
    """Every request type; returns the replies (errors as (kind, message))."""
    out: list[object] = []

    async def req(r):
        try:
            rep = await t.request(r)
        except Exception as err:
            out.append((type(err).__name__, str(err)))
            return None
        if isinstance(rep, P.EngineStats):
            rep = msgspec.structs.replace(rep, model_seconds=0.0, scheduler_seconds=0.0)
        out.append(rep)
        return rep

    a = (await req(P.CreateContext())).ctx
    await req(P.Forward(ctx=a, tokens=list(range(1, 11)), reuse_prefix=True,
                        sample=[P.SampleSpec(index=9, sampler=P.SamplerSpec())],  # greedy: seeded forward sampling is not reproducible yet (engine)
                        logits=[0, 9], distributions=[P.DistributionSpec(index=9, top_k=5)],
                        logprobs=[P.LogprobSpec(index=4, token_ids=[1, 2])]))
    await req(P.GetState(ctx=a))
    b = (await req(P.ForkContext(ctx=a))).ctx
    await req(P.ReservePages(ctx=b, num_pages=2))
    await req(P.ReleasePages(ctx=b, num_pages=1))
    await req(P.TruncateTokens(ctx=b, num_tokens=1))
    await req(P.Compact(ctx=b, keep=[0, 2, 3, 5]))
    await req(P.Compact(ctx=b, keep=[3, 1]))  # unsorted: an error
    await req(P.CommitPages(ctx=b, num_pages=1))  # not full: an error
    await req(P.SaveSnapshot(ctx=a, name="s1"))
    await req(P.SaveSnapshot(ctx=a, name="s1"))  # exists
    await req(P.ListSnapshots())
    c = (await req(P.OpenSnapshot(name="s1"))).ctx
    d = (await req(P.TakeSnapshot(name="s1"))).ctx
    await req(P.DeleteSnapshot(name="s1"))  # gone
    out.append(await collect(await t.generate(P.Generate(ctx=c, tokens=[5, 6], max_tokens=12,
                                                         stop_token_ids=[]))))
    out.append(await collect(await t.generate(P.Generate(ctx=999, tokens=[1]))))
    await req(P.Tokenize(text="hello"))
    await req(P.GetInfo())
    for h in (a, b, c, d):
        await req(P.ReleaseContext(ctx=h))
    await req(P.GetState(ctx=a))
    await req(P.GetStats())
    return out


async def test_every_request_matches_in_process():
    local_engine = fake_engine()
    async with local_engine:
        local = LocalTransport(local_engine)
        expected = await _script(local)
        await local.aclose()
    engine = fake_engine()
    async with serve_in_background(engine) as srv:
        async with connect(srv.address) as t:
            got = await _script(t)
        await wait_settled(engine)
    assert got == expected
    assert any(isinstance(x, tuple) and x[0] == "SnapshotExists" for x in got)


async def test_cancel_leaves_context_unchanged():
    engine = fake_engine(num_pages=1024)
    async with serve_in_background(engine) as srv:
        async with connect(srv.address) as t:
            a = (await t.request(P.CreateContext())).ctx
            await t.request(P.Forward(ctx=a, tokens=[1, 2, 3]))
            before = (await t.request(P.GetState(ctx=a))).state
            stream = await t.generate(P.Generate(ctx=a, tokens=[4], max_tokens=3000,
                                                 stop_token_ids=[]))
            first = await stream.__anext__()
            assert isinstance(first, P.GenerateChunk)
            await stream.aclose()
            with anyio.fail_after(5):  # the context is usable again once the job is gone
                state = (await t.request(P.GetState(ctx=a))).state
                while state != before:
                    await anyio.sleep(0.01)
                    state = (await t.request(P.GetState(ctx=a))).state
            tokens, done = await collect(await t.generate(P.Generate(ctx=a, tokens=[4], max_tokens=4,
                                                                     stop_token_ids=[])))
            assert isinstance(done, P.GenerateDone) and len(tokens) == 4
        await wait_settled(engine)

# ---------------------------------------------------------------------------- bad input


async def test_bad_messages_get_named_errors_and_connection_survives():
    engine = fake_engine()
    async with serve_in_background(engine) as srv:
        raw = await RawClient.open(srv.address, HELLO)
        await raw.writer.send(b"\xc1garbage")  # not MessagePack
        r = await raw.receive()
        assert r.id == 0 and r.reply.kind == "ProtocolError"
        await raw.writer.send(msgspec.msgpack.encode({"type": "Nope", "id": 7}))
        r = await raw.receive()
        assert r.id == 7 and "Nope" in r.reply.message
        await raw.send(wire.Call(id=8, request=msgspec.Raw(msgspec.msgpack.encode(
            {"type": "Launch"}))))
        r = await raw.receive()
        assert r.id == 8 and "Launch" in r.reply.message
        await raw.send(wire.Call(id=9, request=msgspec.Raw(msgspec.msgpack.encode(
            {"type": "GetState", "ctx": "x"}))))
        r = await raw.receive()
        assert r.id == 9 and r.reply.kind == "ProtocolError" and "$.ctx" in r.reply.message
        await raw.call(-1, P.GetInfo())
        assert "positive" in (await raw.receive()).reply.message
        await raw.send(HELLO)
        assert "handshake" in (await raw.receive()).reply.message
        await raw.call(10, P.GetState(ctx=12345))
        r = await raw.receive()
        assert r.id == 10 and r.reply.kind == "ContextClosed"
        await raw.call(11, P.GetInfo())
        assert isinstance((await raw.receive()).reply, P.EngineInfo)
        await raw.aclose()


async def test_oversize_frame_closes_only_that_connection():
    engine = fake_engine()
    async with serve_in_background(engine, max_frame_bytes=1024) as srv:
        async with connect(srv.address) as other:
            ctx = (await other.request(P.CreateContext())).ctx
            raw = await RawClient.open(srv.address, HELLO)
            await raw.call(1, P.Tokenize(text="a" * 2000))
            r = await raw.receive()
            assert r.id == 0 and "exceeds the limit of 1024" in r.reply.message
            assert await raw.receive() is None
            assert (await other.request(P.GetState(ctx=ctx))).state.seq_len == 0
            with pytest.raises(InvalidArgument, match="frame limit of 1024"):  # refused client-side
                await other.request(P.Tokenize(text="a" * 2000))
            assert (await other.request(P.GetState(ctx=ctx))).state.seq_len == 0
        await wait_settled(engine)


async def test_errors_raise_typed_exceptions_over_the_socket():
    async with serve_in_background(fake_engine()) as srv:
        async with connect(srv.address) as t:
            with pytest.raises(ContextClosed):
                await t.request(P.ForkContext(ctx=42))
            with pytest.raises(SnapshotNotFound):
                await t.request(P.OpenSnapshot(name="nope"))
        with pytest.raises(ProtocolError, match="closed"):
            await t.request(P.GetInfo())

# ------------------------------------------------------------------ multiplexing, trio


async def _many_on_one_connection(address: str) -> tuple[list[list[int]], list[list[int]]]:
    async with connect(address) as t:
        base = (await t.request(P.CreateContext())).ctx
        await t.request(P.Forward(ctx=base, tokens=list(range(1, 9))))

        async def one(i: int) -> list[int]:
            fork = (await t.request(P.ForkContext(ctx=base))).ctx
            sampler = P.SamplerSpec(temperature=0.9, seed=i)
            tokens, done = await collect(await t.generate(P.Generate(
                ctx=fork, tokens=[i % 60], sampler=sampler, max_tokens=10, stop_token_ids=[])))
            assert isinstance(done, P.GenerateDone)
            await t.request(P.ReleaseContext(ctx=fork))
            return tokens

        sequential = [await one(i) for i in range(20)]
        concurrent: list[list[int]] = [[] for _ in range(20)]

        async def store(i: int) -> None:
            concurrent[i] = await one(i)

        async with anyio.create_task_group() as tg:
            for i in range(20):
                tg.start_soon(store, i)
                tg.start_soon(t.request, P.GetStats())  # unrelated replies interleave
    return sequential, concurrent


async def test_concurrent_requests_on_one_connection_match_sequential():
    engine = fake_engine(num_pages=512)
    async with serve_in_background(engine) as srv:
        sequential, concurrent = await _many_on_one_connection(srv.address)
        await wait_settled(engine)
    assert concurrent == sequential


def test_server_and_client_run_under_trio():
    async def main() -> None:
        engine = fake_engine(num_pages=512)
        async with serve_in_background(engine) as srv:
            sequential, concurrent = await _many_on_one_connection(srv.address)
            assert concurrent == sequential
            await wait_settled(engine)

    anyio.run(main, backend="trio")
