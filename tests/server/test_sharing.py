"""Cross-process sharing: a prefix one client process computed is reused by the next."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import anyio

from runtime.server.testing import serve_in_background
from tests.server.helpers import fake_engine, wait_settled

REPO = str(Path(__file__).resolve().parents[2])

CLIENT = """
import json, sys, anyio
from pie_ctx.proto import messages as P
from pie_ctx.socket_transport import SocketTransport

async def main(address, tokens):
    async with SocketTransport.open(address) as t:
        ctx = (await t.request(P.CreateContext())).ctx
        reply = await t.request(P.Forward(ctx=ctx, tokens=tokens, reuse_prefix=True))
    r = reply.report
    print(json.dumps({"reused": r.pages_reused, "computed": r.pages_computed,
                      "tokens_computed": r.tokens_computed}))

anyio.run(main, sys.argv[1], json.loads(sys.argv[2]))
"""

SYSTEM = list(range(1, 25))  # six pages of 4 tokens


async def _client(address: str, tokens: list[int]) -> dict[str, int]:
    proc = await anyio.run_process([sys.executable, "-c", CLIENT, address, json.dumps(tokens)],
                                   env={**os.environ, "PYTHONPATH": REPO}, check=True)
    return json.loads(proc.stdout.decode().strip().splitlines()[-1])


async def test_second_process_computes_only_its_suffix():
    engine = fake_engine()
    async with serve_in_background(engine) as srv:
        with anyio.fail_after(60):
            first = await _client(srv.address, SYSTEM + [30, 31, 32])
            second = await _client(srv.address, SYSTEM + [40, 41, 42, 43, 44])
        assert first == {"reused": 0, "computed": 6, "tokens_computed": 27}
        assert second["reused"] == 6  # the whole system prompt, computed by another process
        assert second["tokens_computed"] == 5  # only the suffix ran through the model
        await wait_settled(engine)
