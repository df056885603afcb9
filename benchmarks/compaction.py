"""What memory policies written as programs cost in quality and buy in memory and speed.

    python benchmarks/compaction.py [--cases 50] [--context 8192] [--budget 0.25]
                                    [--ppl-tokens 512] [--decode-tokens 64] [--smoke]

On the default model, the KV budget a fraction ``--budget`` of ``--context`` tokens
(cut to what the model's positions hold with the generated tokens after it: 8,128 for the
default model's 8,192 at ``--decode-tokens 64``):

* passkey retrieval: a five-digit number hidden at a random depth (50%-87.5% of the
  context: 4k-7k tokens of 8k) of filler text, asked for at the end; ``--cases`` cases,
  the accuracy of the full context and of each policy: ``full_passkey_acc``,
  ``snapkv_passkey_acc``, ``h2o_passkey_acc``, ``streaming_passkey_acc`` and
  ``truncate_passkey_acc`` (only the last ``budget`` tokens of the prompt);
* perplexity of the last ``--ppl-tokens`` tokens of a long text (benchmarks/data, repeated
  to the context's length) after its prefix was held under each policy, vs full
  (``ppl_full``, ``ppl_<policy>``, ``ppl_<policy>_over_full``);
* decode tok/s at the budget (after a SnapKV compaction) over the full context's, and the
  pages each holds (``compaction_decode_speedup``, ``pages_held_budget``/``_full``);
* ``attention_scores_overhead``: a decode step's time with ``attention_scores=True``
  over without, on the full context.

The policies are examples/'s (``pie_ctx.policies``): StreamingLLM (4 sinks and a recent
window), H2O (accumulated attention of every row, plus a window of an eighth of the
budget, compacting whenever the context outgrows the budget while the prompt streams in
chunks of ``--chunk``), SnapKV (the whole prompt, then the last 32 tokens' attention,
pooled, chooses the rest of the budget once). The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
from common import emit, parse_args, table

from pie_ctx import Context, Runtime, Sampler
from pie_ctx.policies import heavy_hitters_keep, pooled, streaming_keep

FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. "
          "There and back again. ")
TEXT = Path(__file__).resolve().parent / "data" / "alice_chapter_1.txt"
POLICIES = ("full", "snapkv", "h2o", "streaming", "truncate")
SINKS, SNAP_WINDOW = 4, 32


def passkey_prompt(tok: Any, context: int, rng: random.Random) -> tuple[list[int], str]:
    """Filler with the key at a random depth of 50%-87.5%, then the question."""
    key = str(rng.randrange(10_000, 100_000))
    needle = tok.encode(f" The pass key is {key}. Remember it. {key} is the pass key. ")
    question = tok.encode(" What is the pass key? The pass key is")
    filler = tok.encode(FILLER)
    body = (filler * (context // len(filler) + 1))[: context - len(needle) - len(question)]
    depth = rng.randrange(context // 2, context * 7 // 8 - len(needle))
    return body[:depth] + needle + body[depth:] + question, key


async def held(ctx: Context, tokens: list[int], policy: str, budget: int, chunk: int) -> None:
    """Write ``tokens`` into ``ctx`` under ``policy`` (the context ends within budget)."""
    if policy == "truncate":
        ctx.append(tokens[-budget:])
        await ctx.flush()
        return
    if policy in ("full", "snapkv"):
        body = tokens if policy == "full" else tokens[:-SNAP_WINDOW]
        for s in range(0, len(body), chunk):
            ctx.append(body[s:s + chunk])
            await ctx.flush()
        if policy == "snapkv":
            w = tokens[-SNAP_WINDOW:]
            out = await ctx.forward().input(w).attention_scores(range(len(w))).execute()
            await ctx.compact(heavy_hitters_keep(pooled(out.attention_scores[0]), budget,
                                                 SNAP_WINDOW))
        return
    total = np.zeros(0)
    for s in range(0, len(tokens), chunk):
        part = tokens[s:s + chunk]
        if policy == "h2o":
            out = await ctx.forward().input(part).attention_scores(range(len(part))).execute()
            scores = out.attention_scores[0]
            total = np.pad(total, (0, len(scores) - len(total))) + scores
        else:
            ctx.append(part)
            await ctx.flush()
        if ctx.seq_len > budget:
            if policy == "h2o":
                keep = heavy_hitters_keep(total, budget, max(budget // 8, 1))
                total = total[keep]
            else:
                keep = streaming_keep(ctx.seq_len, budget, SINKS)
            await ctx.compact(keep)


async def passkey(rt: Runtime, args: argparse.Namespace, budget: int) -> dict[str, float]:
    rng = random.Random(0)
    cases = [passkey_prompt(rt.tokenizer, args.context, rng) for _ in range(args.cases)]
    out = {}
    for policy in POLICIES:
        hits = 0
        for tokens, key in cases:
            async with Context(rt) as ctx:
                await held(ctx, tokens, policy, budget, args.chunk)
                text = await ctx.generate(Sampler.greedy(), max_tokens=8, ignore_eos=True).text()
                hits += key in text
        out[f"{policy}_passkey_acc"] = hits / len(cases)
    return out


async def perplexity(rt: Runtime, args: argparse.Namespace, budget: int) -> dict[str, float]:
    ids = rt.tokenizer.encode(TEXT.read_text())
    ids = (ids * (args.context // len(ids) + 1))[: args.context]
    prefix, tail = ids[: -args.ppl_tokens], ids[-args.ppl_tokens:]
    out = {}
    for policy in POLICIES:
        async with Context(rt) as ctx:
            await held(ctx, prefix, policy, budget, args.chunk)
            fwd = ctx.forward().input(tail)  # scored: every tail token after the first
            for j in range(len(tail) - 1):
                fwd.logprobs(j, [tail[j + 1]])
            res = await fwd.execute()
            nll = -sum(lp[0] for lp in res.logprobs)
            out[f"ppl_{policy}"] = math.exp(nll / (len(tail) - 1))
    for policy in POLICIES[1:]:
        out[f"ppl_{policy}_over_full"] = out[f"ppl_{policy}"] / out["ppl_full"]
    return out


async def decode_rate(ctx: Context, n: int, **kw: Any) -> float:
    """Decode tokens per second of an ``n``-token greedy generation on a fork."""
    async with ctx.fork() as f:
        t0 = time.perf_counter()
        await f.generate(Sampler.greedy(), max_tokens=n, ignore_eos=True, **kw).tokens()
        return n / (time.perf_counter() - t0)


async def speed(rt: Runtime, args: argparse.Namespace, budget: int) -> dict[str, float]:
    tokens, _ = passkey_prompt(rt.tokenizer, args.context, random.Random(1))
    async with Context(rt) as full, Context(rt) as small:
        await held(full, tokens, "full", budget, args.chunk)
        await held(small, tokens, "snapkv", budget, args.chunk)
        await decode_rate(full, 2)  # warm
        plain = await decode_rate(full, args.decode_tokens)
        scored = await decode_rate(full, args.decode_tokens, attention_scores=True)
        at_budget = await decode_rate(small, args.decode_tokens)
        return {"compaction_decode_speedup": at_budget / plain,
                "attention_scores_overhead": plain / scored,
                "decode_tok_s_full": plain, "decode_tok_s_budget": at_budget,
                "pages_held_full": full.num_committed_pages + full.num_working_pages,
                "pages_held_budget": small.num_committed_pages + small.num_working_pages}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    async with Runtime.local(kv_memory_gb=args.kv_memory_gb) as rt:
        # the prompt and what is generated after it must fit the model's positions
        room = rt.info.max_seq_len - max(args.decode_tokens, 8)
        if args.context > room:
            print(f"--context {args.context}: the model holds {rt.info.max_seq_len} tokens "
                  f"and {max(args.decode_tokens, 8)} are generated after it; using {room}")
            args.context = room
        budget = max(int(args.context * args.budget), SNAP_WINDOW + SINKS + 8)
        result: dict[str, Any] = {"context": args.context, "budget_tokens": budget,
                                  "cases": args.cases}
        result.update(await passkey(rt, args, budget))
        result.update(await perplexity(rt, args, budget))
        result.update(await speed(rt, args, budget))
        return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=50)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--budget", type=float, default=0.25, help="KV budget / context")
    ap.add_argument("--chunk", type=int, default=512, help="prompt tokens per pass")
    ap.add_argument("--ppl-tokens", type=int, default=512)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--kv-memory-gb", type=float, default=2.0)
    args = parse_args(ap, cases=1, context=256, budget=0.5, chunk=128, ppl_tokens=16,
                      decode_tokens=4, kv_memory_gb=0.5)
    result = asyncio.run(run(args))
    table([(k, str(v)) for k, v in result.items()])
    emit(result)


if __name__ == "__main__":
    main()
