"""The HTTP front door against the in-process SDK: the same multi-turn chat workload both ways.

    .venv/bin/python benchmarks/http_api.py [--conversations 16] [--turns 4] [--in-flight 8]
                                        [--system-tokens 1000] [--max-tokens 32] [--smoke]

Workload: ``--conversations`` chats of ``--turns`` turns each, all starting with the same
``--system-tokens``-token system prompt; each turn sends the whole conversation so far (as an
OpenAI client does) and greedily generates ``--max-tokens`` tokens; ``--in-flight``
conversations run at once.

* HTTP: ``pie-ctx serve --http`` in a subprocess on the default model, driven by the official
  ``openai`` client (``AsyncOpenAI``, streaming, so time to first token is measured at the
  client).
* In-process: the same turns as SDK programs (``Runtime.local()`` in this process), built
  the way the HTTP inferlet builds them: a fresh context per turn from the messages.

Each side gets a fresh engine (no cache carried over) and warms it up with one request on
another system prompt. The last line is one JSON object:
``http_over_inprocess_wall`` (target <= 1.15), ``cached_token_fraction`` (prompt tokens the
engine found already computed, from ``usage.prompt_tokens_details.cached_tokens``),
``ttft_p50_ms``, ``ttft_p99_ms`` (HTTP, at the client), and the in-process TTFTs.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import anyio
from common import TEXT, emit, parse_args, table

ROOT = Path(__file__).resolve().parents[1]
READY = re.compile(r"serving HTTP on (http://\S+)")


def conversations(args: argparse.Namespace, system: str) -> list[list[str]]:
    """The user turns of every conversation."""
    return [[f"Conversation {c}, question {t}: what is on shelf {c * 7 + t}?"
             for t in range(args.turns)] for c in range(args.conversations)]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


async def run_http(url: str, system: str, chats: list[list[str]], args: argparse.Namespace
                   ) -> tuple[float, list[float], int, int]:
    """(wall s, TTFTs s, prompt tokens, cached prompt tokens) through the openai client."""
    import openai

    ttfts: list[float] = []
    totals = [0, 0]
    limit = anyio.Semaphore(args.in_flight)
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0,
                                  timeout=600) as client:
        model = (await client.models.list()).data[0].id

        async def chat(turns: list[str]) -> None:
            async with limit:
                messages = [{"role": "system", "content": system}]
                for user in turns:
                    messages.append({"role": "user", "content": user})
                    t0 = time.perf_counter()
                    first, parts = None, []
                    stream = await client.chat.completions.create(
                        model=model, messages=messages, temperature=0,
                        max_tokens=args.max_tokens, stream=True,
                        stream_options={"include_usage": True})
                    async for chunk in stream:
                        if chunk.usage is not None:
                            totals[0] += chunk.usage.prompt_tokens
                            totals[1] += chunk.usage.prompt_tokens_details.cached_tokens
                        for c in chunk.choices:
                            if c.delta.content:
                                first = first or time.perf_counter()
                                parts.append(c.delta.content)
                    ttfts.append((first or time.perf_counter()) - t0)
                    messages.append({"role": "assistant", "content": "".join(parts)})

        t0 = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for turns in chats:
                tg.start_soon(chat, turns)
        wall = time.perf_counter() - t0
    return wall, ttfts, totals[0], totals[1]


async def run_inprocess(system: str, chats: list[list[str]], args: argparse.Namespace,
                        warm_system: str) -> tuple[float, list[float]]:
    """(wall s, TTFTs s) of the same turns as SDK programs in this process."""
    from pie_ctx import Context, Runtime, Sampler

    ttfts: list[float] = []
    limit = anyio.Semaphore(args.in_flight)
    async with Runtime.local() as rt:
        async def chat(turns: list[str]) -> None:
            await chat_with(system, turns)

        async def chat_with(system: str, turns: list[str]) -> None:
            async with limit:
                history: list[tuple[str, str]] = []
                for user in turns:
                    t0 = time.perf_counter()
                    ctx = Context(rt).system(system)
                    for u, a in history:
                        ctx.user(u).assistant(a)
                    ctx.user(user).cue()
                    await ctx.flush()
                    gen = ctx.generate(Sampler.greedy(), max_tokens=args.max_tokens, cue=False)
                    first, parts = None, []
                    async for delta in gen:
                        first = first or time.perf_counter()
                        parts.append(delta.text)
                    ttfts.append((first or time.perf_counter()) - t0)
                    await ctx.release()
                    history.append((user, "".join(parts)))

        # The model's first call pays one-time costs; warm up on another system prompt, as
        # the HTTP side does, so neither side starts with the timed prompt cached.
        await chat_with(warm_system, ["warm up"])
        ttfts.clear()
        t0 = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for turns in chats:
                tg.start_soon(chat, turns)
        wall = time.perf_counter() - t0
    return wall, ttfts


def start_server(tmp: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "runtime.server", "serve", "--socket",
                             os.path.join(tmp, "e.sock"), "--http", "127.0.0.1:0",
                             "--memory-snapshots", "--no-access-log"],  # stderr not read
                            cwd=ROOT, stderr=subprocess.PIPE, text=True)
    for line in proc.stderr:  # type: ignore[union-attr]
        m = READY.search(line)
        if m:
            return proc, m.group(1)
    raise RuntimeError("the server did not start")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--in-flight", type=int, default=8)
    ap.add_argument("--system-tokens", type=int, default=1000)
    ap.add_argument("--max-tokens", type=int, default=32)
    args = parse_args(ap, conversations=2, turns=2, in_flight=2, system_tokens=64,
                      max_tokens=4)

    from runtime.model.loader import load_model

    tokenizer = load_model(None, progress=False).tokenizer
    system = tokenizer.decode(tokenizer.encode(TEXT)[:args.system_tokens])
    chats = conversations(args, system)

    with tempfile.TemporaryDirectory() as tmp:
        proc, url = start_server(tmp)
        try:
            async def warm() -> None:
                await run_http(url, system, [["warm up"]], argparse.Namespace(
                    in_flight=1, max_tokens=2))
            anyio.run(warm)
            # a fresh system prompt for the timed run, so the warm-up's pages do not count
            timed_system = "Session two. " + system
            http_wall, ttfts, prompt, cached = anyio.run(run_http, url, timed_system, chats,
                                                         args)
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    local_wall, local_ttfts = anyio.run(run_inprocess, "Session two. " + system, chats, args,
                                        system)

    turns = args.conversations * args.turns
    result = {
        "http_over_inprocess_wall": http_wall / local_wall,
        "http_wall_s": http_wall, "inprocess_wall_s": local_wall,
        "cached_token_fraction": cached / prompt if prompt else 0.0,
        "prompt_tokens": prompt, "cached_tokens": cached,
        "ttft_p50_ms": 1e3 * statistics.median(ttfts),
        "ttft_p99_ms": 1e3 * percentile(ttfts, 0.99),
        "inprocess_ttft_p50_ms": 1e3 * statistics.median(local_ttfts),
        "inprocess_ttft_p99_ms": 1e3 * percentile(local_ttfts, 0.99),
        "conversations": args.conversations, "turns": args.turns,
        "in_flight": args.in_flight, "system_tokens": args.system_tokens,
        "max_tokens": args.max_tokens,
    }
    table([("workload", f"{args.conversations} conversations x {args.turns} turns, "
                        f"{args.system_tokens}-token shared system prompt, {args.in_flight} "
                        f"in flight, {args.max_tokens} tokens per answer ({turns} requests)"),
           ("wall s: HTTP / in-process", f"{http_wall:.2f} / {local_wall:.2f} "
                                         f"({result['http_over_inprocess_wall']:.3f}x)"),
           ("prompt tokens served from cache", f"{cached} of {prompt} "
                                               f"({result['cached_token_fraction']:.1%})"),
           ("TTFT p50 / p99 ms: HTTP", f"{result['ttft_p50_ms']:.0f} / "
                                        f"{result['ttft_p99_ms']:.0f}"),
           ("TTFT p50 / p99 ms: in-process", f"{result['inprocess_ttft_p50_ms']:.0f} / "
                                              f"{result['inprocess_ttft_p99_ms']:.0f}")])
    emit(result)


if __name__ == "__main__":
    main()
