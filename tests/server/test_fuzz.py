"""Protocol fuzzing: random, mutated and adversarial frames against a live server.

The server runs in a background thread (an anyio blocking portal) so hypothesis can drive
plain blocking sockets. Every example: handshake, create two contexts, send the fuzz
messages, then a marker request that must still be answered (unless the example broke the
framing, which closes the connection). No reply may be an internal server error, and when
everyone has left, no page is used and the page store's invariants hold.
"""

from __future__ import annotations

import collections
import socket

import anyio.from_thread
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pie_ctx.proto import messages as P
from pie_ctx.proto import wire
from pie_ctx.proto.address import parse_address
from runtime.server.testing import serve_in_background
from tests.server.helpers import SyncRawClient, fake_engine, sync_frame, wait_settled

MARKER = 10**9
SEEN: collections.Counter[str] = collections.Counter()  # reply kinds, to show coverage
ERRORS: collections.Counter[str] = collections.Counter()  # error replies, for diagnosis

def _unchecked_sampler(**fields: object) -> P.SamplerSpec:
    """A SamplerSpec with any field values: what a client that skips construction checks
    could put on the wire (the server must refuse it, not break)."""
    spec = P.SamplerSpec()
    for name, value in fields.items():
        msgspec.structs.force_setattr(spec, name, value)
    return spec


ints = st.one_of(st.integers(-3, 70), st.sampled_from([2**31, 2**63 - 1, -(2**63)]))
small_lists = st.one_of(st.lists(st.integers(0, 62), max_size=8), st.lists(ints, max_size=8))
ctx_slot = st.integers(0, 3)  # 0/1: a context this connection owns; 2/3: bogus handles
names = st.text(max_size=4)
floats = st.floats(allow_nan=True, allow_infinity=True, width=32)
samplers = st.one_of(
    st.builds(P.SamplerSpec),
    st.builds(P.SamplerSpec, temperature=st.floats(0.1, 2.0), top_k=st.integers(0, 10),
              seed=st.one_of(st.none(), st.integers(0, 2**40))),
    st.builds(_unchecked_sampler, temperature=st.one_of(st.just(0.0), floats), top_k=ints,
              top_p=floats, min_p=floats, seed=st.one_of(st.none(), ints)),
)
masks = st.one_of(st.none(), st.none(), st.lists(st.lists(st.booleans(), max_size=6), max_size=4))

valid_tokens = st.lists(st.integers(0, 62), min_size=1, max_size=8)
good_work = st.one_of(  # well-formed work on owned contexts, so the engine really runs
    st.builds(P.Forward, ctx=st.integers(0, 1), tokens=valid_tokens, commit=st.booleans(),
              reuse_prefix=st.booleans()),
    st.builds(P.Generate, ctx=st.integers(0, 1), tokens=valid_tokens, sampler=samplers,
              max_tokens=st.integers(1, 12), stop_token_ids=st.just([])),
)

requests = st.one_of(
    good_work, good_work, good_work, good_work,
    st.builds(P.CreateContext), st.builds(P.ListSnapshots), st.builds(P.GetInfo),
    st.builds(P.GetStats), st.builds(P.Tokenize, text=st.text(max_size=6)),
    st.builds(P.ForkContext, ctx=ctx_slot), st.builds(P.ReleaseContext, ctx=ctx_slot),
    st.builds(P.GetState, ctx=ctx_slot),
    st.builds(P.ReservePages, ctx=ctx_slot, num_pages=ints),
    st.builds(P.CommitPages, ctx=ctx_slot, num_pages=ints),
    st.builds(P.ReleasePages, ctx=ctx_slot, num_pages=ints),
    st.builds(P.TruncateTokens, ctx=ctx_slot, num_tokens=ints),
    st.builds(P.SaveSnapshot, ctx=ctx_slot, name=names),
    st.builds(P.OpenSnapshot, name=names), st.builds(P.TakeSnapshot, name=names),
    st.builds(P.DeleteSnapshot, name=names),
    st.builds(P.Forward, ctx=ctx_slot, tokens=small_lists,
              positions=st.one_of(st.none(), st.none(), small_lists), mask=masks, commit=st.booleans(),
              reuse_prefix=st.booleans(),
              sample=st.lists(st.builds(P.SampleSpec, index=ints, sampler=samplers), max_size=2),
              logits=st.lists(ints, max_size=2),
              distributions=st.lists(st.builds(P.DistributionSpec, index=ints, top_k=ints),
                                     max_size=2),
              logprobs=st.lists(st.builds(P.LogprobSpec, index=ints, token_ids=small_lists),
                                max_size=2)),
    st.builds(P.Generate, ctx=ctx_slot, tokens=small_lists, sampler=samplers,
              max_tokens=st.integers(-2, 12), stop_token_ids=st.one_of(st.none(), small_lists),
              stop_strings=st.lists(st.text(max_size=3), max_size=2)),
)


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    """A valid Call frame payload with a few bytes flipped, inserted, deleted or cut."""
    req = draw(requests)
    data = bytearray(wire.encode(wire.Call(id=draw(st.integers(1, 50)),
                                           request=msgspec.Raw(wire.encode(req)))))
    for _ in range(draw(st.integers(1, 4))):
        i = draw(st.integers(0, len(data) - 1))
        op = draw(st.sampled_from(["flip", "insert", "delete", "cut"]))
        if op == "flip":
            data[i] = draw(st.integers(0, 255))
        elif op == "insert":
            data[i:i] = draw(st.binary(min_size=1, max_size=4))
        elif op == "delete" and len(data) > 1:
            del data[i]
        elif op == "cut" and i > 0:
            del data[i:]
    return bytes(data)


# ("req", request) | ("payload", bytes in a valid frame) | ("stream", raw bytes, unframed)
_req_item = st.tuples(st.just("req"), requests)
items = st.one_of(
    _req_item, _req_item, _req_item,
    st.tuples(st.just("payload"), st.one_of(st.binary(min_size=1, max_size=64), mutated())),
)
scripts = st.tuples(st.lists(items, min_size=1, max_size=6),
                    st.one_of(st.none(), st.binary(min_size=1, max_size=12)),
                    st.booleans())  # drain: wait for every reply (else leave mid-work)


@pytest.fixture(scope="module")
def live_server():
    engine = fake_engine(num_pages=512)
    with anyio.from_thread.start_blocking_portal() as portal:
        with portal.wrap_async_context_manager(serve_in_background(engine)) as srv:
            yield engine, portal, parse_address(srv.address).path
            # Snapshots outlive their connections by design: delete the fuzzed ones first.
            portal.call(_delete_snapshots, engine)
            portal.call(wait_settled, engine)
            assert portal.call(engine.stats).num_pages_used == 0
    # The fuzzing reached the engine's real work, not only the decoders.
    assert SEEN["ForwardReply"] and SEEN["ErrorReply"], (SEEN, ERRORS.most_common(12))


async def _delete_snapshots(engine) -> None:
    for (namespace, name), _ in list(engine.store.snapshots):
        reply = await engine.handle(P.DeleteSnapshot(name=name), namespace=namespace)
        assert isinstance(reply, P.Ok), reply


def _check_reply(payload: bytes) -> wire.Response:
    msg = wire.decode_server(payload)  # the server only ever sends well-formed messages
    assert isinstance(msg, wire.Response)
    SEEN[type(msg.reply).__name__ if msg.id != 0 else "connection-error"] += 1
    if isinstance(msg.reply, P.ErrorReply):
        assert "internal server error" not in msg.reply.message, msg.reply.message
        ERRORS[f"{msg.reply.kind}: {msg.reply.message[:70]}"] += 1
    return msg


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(script=scripts)
def test_fuzzed_frames_never_break_the_server(live_server, script):
    engine, portal, path = live_server
    body, tail, drain = script
    outstanding: set[int] = set()
    client = SyncRawClient(path)
    try:
        client.send(sync_frame(wire.encode(wire.Hello(protocol_version=wire.PROTOCOL_VERSION))))
        assert isinstance(wire.decode_server(client.receive()), wire.Welcome)
        handles = []
        for rid in (1, 2):
            client.send(sync_frame(wire.encode(wire.Call(
                id=rid, request=msgspec.Raw(wire.encode(P.CreateContext()))))))
            handles.append(_check_reply(client.receive()).reply.ctx)
        slots = [*handles, 0, 987654321]
        for rid, (kind, value) in enumerate(body, start=100):
            if kind == "req":
                outstanding.add(rid)
                if hasattr(value, "ctx"):
                    value = msgspec.structs.replace(value, ctx=slots[value.ctx])
                payload = wire.encode(wire.Call(id=rid, request=msgspec.Raw(wire.encode(value))))
            else:
                payload = value
            client.send(sync_frame(payload))
        if tail is not None:
            client.send(tail)  # unframed bytes: may announce a bad or unfinished frame
        client.send(sync_frame(wire.encode(wire.Call(
            id=MARKER, request=msgspec.Raw(wire.encode(P.GetInfo()))))))
        if tail is not None:
            client.sock.shutdown(socket.SHUT_WR)  # an unfinished frame now ends at EOF
        for _ in range(10_000):
            payload = client.receive(deadline_s=10)
            if payload is None:
                assert tail is not None, "the server closed a connection with valid framing"
                break
            msg = _check_reply(payload)
            if not isinstance(msg.reply, P.GenerateChunk):
                outstanding.discard(msg.id)
            if msg.id == MARKER and isinstance(msg.reply, P.EngineInfo):
                outstanding.add(MARKER)  # seen: now only the drain is left
            if MARKER in outstanding and (not drain or outstanding == {MARKER}):
                break
    except (BrokenPipeError, ConnectionResetError):
        assert tail is not None
    finally:
        client.close()
    assert portal.call(engine.info).page_size == 4  # the server (and engine) still answer
