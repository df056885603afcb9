"""Prefix reuse on the default model: one 1,024-token system prompt, 16 sequential requests.

    python benchmarks/prefix_reuse.py [--requests 16] [--system-len 1024] [--smoke]

Each request opens a fresh context with the same system prompt and a different user turn,
and generates its first token. The first request computes everything; later ones find the
system prompt's pages (released but cached) and compute only their own turn. Reported:
time to first token (TTFT) of the miss vs the hits, and prefill tokens computed vs requested.
"""

from __future__ import annotations

import argparse
import statistics
import time

import anyio
from common import TEXT, emit, parse_args, summary, table

from pie_ctx import Context, Runtime, Sampler


async def main_async(args):
    from runtime.boot import boot_engine

    engine = boot_engine(None, page_size=args.page_size, kv_memory_gb=1.0)
    tok = engine.tokenizer
    system = tok.decode(tok.encode(TEXT)[: args.system_len])
    questions = [f"Question {i}: in one word, what is page {i} for?" for i in range(args.requests)]
    ttft, computed, requested = [], 0, 0
    async with engine, Runtime.local(engine=engine) as rt:
        warm = Context(rt).user("warm up").cue()
        await warm.generate(Sampler.greedy(), max_tokens=1).text()
        await warm.release()
        for q in questions:
            t0 = time.perf_counter()
            ctx = Context(rt).system(system).user(q).cue()
            requested += len(ctx.pending_tokens)
            gen = ctx.generate(Sampler.greedy(), max_tokens=1)
            async for _ in gen:
                break
            ttft.append(time.perf_counter() - t0)
            await gen.text()
            computed += gen.report.tokens_computed
            await ctx.release()
    prompt_len = requested // args.requests
    turns = requested - args.requests * (args.system_len)
    hits = summary(ttft[1:])
    table([("TTFT miss s", f"{ttft[0]:.3f}"),
           ("TTFT hit s", f"median {hits['median']:.3f} (range {hits['min']:.3f}-{hits['max']:.3f})"),
           ("hit / miss", f"{hits['median'] / ttft[0]:.3f}"),
           ("prefill tokens", f"computed {computed} of {requested} requested "
                              f"(~{prompt_len} per request)")])
    emit({"ttft_first_s": ttft[0], "ttft_hit_median_s": statistics.median(ttft[1:]),
          "ttft_hit_over_miss": hits["median"] / ttft[0],
          "prefill_tokens_computed": computed, "prefill_tokens_requested": requested,
          "computed_over_one_prompt_plus_turns": computed / (prompt_len + max(turns, 1)),
          "requests": args.requests, "system_len": args.system_len})


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--system-len", type=int, default=1024)
    ap.add_argument("--page-size", type=int, default=16)
    anyio.run(main_async, parse_args(ap, requests=3, system_len=64))


if __name__ == "__main__":
    main()
