"""The socket's side of the delivery guarantee: a receive that takes a message after its
``Cancel`` arrived gives the message back instead of replying (the client drops replies to
cancelled calls)."""

from __future__ import annotations

from typing import Any

import anyio

from pie_ctx.proto import messages as P
from pie_ctx.proto import wire
from runtime.server.testing import serve_in_background
from tests.server.helpers import HELLO, RawClient


class _TakesDespiteCancel:
    """A stand-in engine whose receive finishes taking its message even though the call
    was cancelled meanwhile (the race a real engine can lose by one scheduling step)."""

    tokenizer = None

    def __init__(self) -> None:
        self.release = anyio.Event()
        self.requests: list[Any] = []

    def info(self) -> P.EngineInfo:
        return P.EngineInfo(protocol_version=P.PROTOCOL_VERSION, model_name="stub", page_size=4,
                            num_pages=1, vocab_size=8, max_seq_len=8, stop_token_ids=[],
                            max_step_tokens=8)

    def cap_reply_bytes(self, limit: int) -> None:
        pass

    def release_owner(self, owner: Any) -> int:
        return 0

    async def handle(self, req: Any, *, owner: Any, namespace: str) -> Any:
        self.requests.append(req)
        if isinstance(req, P.ChannelReceive):
            with anyio.CancelScope(shield=True):
                await self.release.wait()
            return P.ChannelMessage(payload=b"taken", text=True, lease=req.lease)
        return P.Ok()


async def test_a_receive_cancelled_while_taking_gives_its_message_back() -> None:
    engine = _TakesDespiteCancel()
    async with serve_in_background(engine, run_engine=False) as srv:
        client = await RawClient.open(srv.address, HELLO)
        try:
            await client.call(1, P.ChannelReceive(channel="q", lease=7))
            await client.send(wire.Cancel(id=1))
            await anyio.sleep(0.05)  # the server has read the Cancel
            engine.release.set()
            final = await client.receive()
        finally:
            await client.aclose()
    assert final == wire.Cancelled(id=1)  # no reply carrying the message...
    assert engine.requests[1:] == [P.SettleMessage(lease=7, delivered=False)]  # ...it went back
