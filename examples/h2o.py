"""H2O as a program: keep the heavy hitters (the tokens that received the most attention
so far) and a recent window, never more than `--budget` tokens.

Every pass asks for the attention its rows gave each KV entry (`attention_scores`), the
program adds it to a running total per token, and when the context outgrows its budget
`ctx.compact` keeps the top scorers plus the window; the totals follow the kept tokens.
"""

import numpy as np

from pie_ctx import Context, Sampler
from pie_ctx.policies import heavy_hitters_keep


def add_arguments(parser):
    parser.add_argument("--budget", type=int, default=48)
    parser.add_argument("--window", type=int, default=16)
    parser.add_argument("--step", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--prompt", default="Tell me a long story about a lighthouse keeper. " * 6)


async def main(rt, args):
    ctx = Context(rt)
    total = np.zeros(0)
    peak, out = 0, []

    async def absorb(scores):  # add a pass's scores, then compact if over budget
        nonlocal total, peak
        total = np.pad(total, (0, len(scores) - len(total))) + scores
        if ctx.seq_len > args.budget:
            keep = heavy_hitters_keep(total[:ctx.seq_len], args.budget, args.window)
            await ctx.compact(keep)
            total = total[keep]
        peak = max(peak, ctx.seq_len)

    tokens = rt.tokenizer.encode(args.prompt)
    for start in range(0, len(tokens), args.step):
        chunk = tokens[start:start + args.step]
        res = await ctx.forward().input(chunk).attention_scores(range(len(chunk))).execute()
        await absorb(res.attention_scores[0])
    while len(out) < args.max_tokens:
        gen = ctx.generate(Sampler.greedy(), max_tokens=args.step, ignore_eos=True,
                           attention_scores=True)
        out += await gen.tokens()
        await ctx.flush()  # the pending last token goes in too (it is scored next pass)
        await absorb(np.pad(gen.attention_scores, (0, 1)))
    print(rt.tokenizer.decode(out, skip_special_tokens=True))
    print(f"{len(tokens) + len(out)} tokens seen; at most {peak} held (budget {args.budget})")
    await ctx.release()
    return peak
