"""Server overhead: best-of-8 on the default model, in-process vs over the Unix socket.

    python benchmarks/server.py [--prompt-len 1024] [--n 8] [--new-tokens 64] [--repeats 3]
                                [--smoke]

Workload (one run): a fresh context, one ``Forward`` of the prompt (``reuse_prefix=True``),
``n`` forks, ``n`` concurrent ``Generate``s of ``new_tokens`` tokens each (temperature 0.8,
top-p 0.95, fixed seeds, never stopping early), then release. Runs alternate between the
in-process ``LocalTransport`` and a ``SocketTransport`` to a server on a Unix socket that
serves the *same* engine from the same process (so the ratio measures framing, encoding,
the socket and the extra event-loop work, not a different engine). Each run uses its own
prompt, so no run reuses another's pages. A warm-up run on one shared prompt checks that
both transports produce identical tokens.

Also measured: the round-trip time of a no-op request (``GetInfo``) over the socket.
The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import anyio
from common import emit, parse_args, table

from pie_ctx.proto import messages as P
from pie_ctx.socket_transport import SocketTransport
from pie_ctx.transport import LocalTransport
from runtime.server.testing import serve_in_background

TEXT = ("A server lets many inferlet processes share one engine, so a prefix computed by one "
        "of them is a cache hit for all the others. ") * 300


def prompt_for(tokenizer: Any, n: int, salt: int) -> list[int]:
    ids = tokenizer.encode(f"Run {salt}. " + TEXT)
    if len(ids) < n:
        raise ValueError("TEXT is too short for this prompt length")
    return ids[:n]


async def best_of_n(t: Any, prompt: list[int], n: int, new_tokens: int, seed: int) -> list[list[int]]:
    """One best-of-n run through transport ``t``; returns each fork's tokens."""
    base = (await t.request(P.CreateContext())).ctx
    await t.request(P.Forward(ctx=base, tokens=prompt, reuse_prefix=True))
    forks = [(await t.request(P.ForkContext(ctx=base))).ctx for _ in range(n)]
    outs: list[list[int]] = [[] for _ in range(n)]

    async def one(i: int) -> None:
        sampler = P.SamplerSpec(temperature=0.8, top_p=0.95, seed=seed + i)
        stream = await t.generate(P.Generate(ctx=forks[i], tokens=[], sampler=sampler,
                                             max_tokens=new_tokens, stop_token_ids=[]))
        async for msg in stream:
            if isinstance(msg, P.GenerateDone):
                outs[i] = msg.tokens
            elif isinstance(msg, P.ErrorReply):
                raise RuntimeError(f"{msg.kind}: {msg.message}")

    async with anyio.create_task_group() as tg:
        for i in range(n):
            tg.start_soon(one, i)
    for ctx in (base, *forks):
        await t.request(P.ReleaseContext(ctx=ctx))
    if any(len(o) != new_tokens for o in outs):
        raise RuntimeError("a generation stopped early")
    return outs


async def rtt_us(t: Any, count: int) -> list[float]:
    out = []
    for _ in range(count):
        t0 = time.perf_counter()
        await t.request(P.GetInfo())
        out.append((time.perf_counter() - t0) * 1e6)
    return out


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    from runtime.boot import boot_engine

    engine = boot_engine(None, page_size=args.page_size, kv_memory_gb=1.0)
    tok = engine.tokenizer
    async with engine, serve_in_background(engine, run_engine=False) as srv, \
            SocketTransport.open(srv.address) as remote:
        local = LocalTransport(engine)
        warm = prompt_for(tok, min(args.prompt_len, 128), salt=-1)
        a = await best_of_n(local, warm, args.n, 8, args.seed)
        b = await best_of_n(remote, warm, args.n, 8, args.seed)
        if a != b:
            raise RuntimeError("socket and in-process outputs differ")
        walls: dict[str, list[float]] = {"inprocess": [], "socket": []}
        for r in range(args.repeats):
            for mode, t in (("inprocess", local), ("socket", remote))[:: 1 if r % 2 == 0 else -1]:
                prompt = prompt_for(tok, args.prompt_len, salt=2 * r + (mode == "socket"))
                t0 = time.perf_counter()
                await best_of_n(t, prompt, args.n, args.new_tokens, args.seed)
                walls[mode].append(time.perf_counter() - t0)
                print(f"run {r} {mode:>9}: {walls[mode][-1]:.3f} s", flush=True)
        socket_rtt = await rtt_us(remote, args.rtt_count)
        local_rtt = await rtt_us(local, args.rtt_count)
        await local.aclose()
    socket_rtt.sort()
    inproc = statistics.median(walls["inprocess"])
    sock = statistics.median(walls["socket"])
    return {
        "inprocess_wall_s": inproc,
        "socket_wall_s": sock,
        "overhead_ratio": sock / inproc,
        "noop_rtt_median_us": statistics.median(socket_rtt),
        "noop_rtt_p99_us": socket_rtt[min(len(socket_rtt) - 1, int(0.99 * len(socket_rtt)))],
        "inprocess_noop_median_us": statistics.median(local_rtt),
        "prompt_len": args.prompt_len, "n": args.n, "new_tokens": args.new_tokens,
        "repeats": args.repeats, "model": engine.model_name,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--rtt-count", type=int, default=2000)
    args = parse_args(parser, prompt_len=32, n=2, new_tokens=4, repeats=1, rtt_count=20)
    result = anyio.run(main_async, args)
    table([(k, f"{v:.4f}" if isinstance(v, float) else str(v)) for k, v in result.items()])
    emit(result)


if __name__ == "__main__":
    main()
