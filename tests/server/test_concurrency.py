"""64 concurrent clients over loopback TCP, a third of them vanishing mid-generation."""

from __future__ import annotations

import anyio

from pie_ctx.proto import messages as P
from pie_ctx.transport import LocalTransport
from runtime.server.testing import serve_in_background
from tests.server.helpers import collect, connect, fake_engine, wait_settled

NUM_CLIENTS = 64
SYSTEM = list(range(1, 17))  # four shared pages of 4 tokens


def _prompt(i: int) -> list[int]:
    return [1 + (i * 7 + k) % 50 for k in range(3 + i % 5)]


def _generate(i: int) -> P.Generate:
    return P.Generate(ctx=0, tokens=_prompt(i), max_tokens=24, stop_token_ids=[],
                      sampler=P.SamplerSpec(temperature=0.8, top_k=20, seed=1000 + i))


async def _client_script(t, i: int, abort_after: int | None = None) -> list[int] | None:
    ctx = (await t.request(P.CreateContext())).ctx
    await t.request(P.Forward(ctx=ctx, tokens=SYSTEM, reuse_prefix=True))
    fork = (await t.request(P.ForkContext(ctx=ctx))).ctx
    req = _generate(i)
    stream = await t.generate(P.Generate(ctx=fork, tokens=req.tokens, max_tokens=req.max_tokens,
                                         stop_token_ids=[], sampler=req.sampler))
    if abort_after is None:
        tokens, final = await collect(stream)
        assert isinstance(final, P.GenerateDone), final
        return tokens
    seen = 0
    async for _msg in stream:
        seen += 1
        if seen >= abort_after:
            await anyio.aclose_forcefully(t._stream)  # a crash: no Bye, no Cancel
            return None
    raise AssertionError("generation ended before the client could vanish")


async def test_64_clients_with_a_third_vanishing_match_solo_runs():
    solo_engine = fake_engine(num_pages=256)
    expected: dict[int, list[int]] = {}
    async with solo_engine:
        for i in range(NUM_CLIENTS):
            if i % 3 != 0:
                local = LocalTransport(solo_engine)
                expected[i] = await _client_script(local, i)
                await local.aclose()

    engine = fake_engine(num_pages=2048)
    results: dict[int, list[int] | None] = {}
    async with serve_in_background(engine, tcp=True) as srv:
        assert srv.address.startswith("tcp:127.0.0.1:")

        async def run(i: int) -> None:
            async with connect(srv.address, token=srv.token) as t:
                results[i] = await _client_script(t, i,
                                                  abort_after=3 + i % 4 if i % 3 == 0 else None)

        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                for i in range(NUM_CLIENTS):
                    tg.start_soon(run, i)
        await wait_settled(engine)
        stats = engine.stats()
        assert stats.num_pages_used == 0 and stats.num_contexts == 0
        assert stats.pages_reused > 0  # the shared system prompt was computed once
    for i, tokens in expected.items():
        assert results[i] == tokens, f"client {i} differs from its solo run"
    assert sum(1 for i in results if results[i] is None) == len(range(0, NUM_CLIENTS, 3))
