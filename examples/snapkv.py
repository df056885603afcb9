"""SnapKV as a program: read the whole prompt, let its last `--window` tokens (the
question) vote on which earlier tokens matter, keep those and the window, `--budget`
tokens in all, then answer from the compacted context.

One pass scores the window's attention over everything before it (`attention_scores`);
the scores are smoothed so the neighbours of a chosen token come with it (`pooled`); one
`ctx.compact` keeps the best. The answer is generated over the budget, not the prompt.
"""

from pie_ctx import Context, Sampler
from pie_ctx.policies import heavy_hitters_keep, pooled


def add_arguments(parser):
    parser.add_argument("--budget", type=int, default=48)
    parser.add_argument("--window", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--prompt", default="The keeper's cat is called Moss. " +
                        "The sea was grey and the wind was cold. " * 8 +
                        "What is the cat called?")


async def main(rt, args):
    ctx = Context(rt).user(args.prompt).cue()
    tokens = ctx.pending_tokens
    await ctx.truncate(args.window)  # the observation window goes in with the scores pass
    await ctx.flush()
    w = tokens[len(tokens) - args.window:]
    res = await ctx.forward().input(w).attention_scores(range(len(w))).execute()
    keep = heavy_hitters_keep(pooled(res.attention_scores[0]), args.budget, args.window)
    await ctx.compact(keep)
    held = ctx.seq_len
    answer = await ctx.generate(Sampler.greedy(), max_tokens=args.max_tokens).text()
    print(answer)
    print(f"prompt of {len(tokens)} tokens answered from {held} (budget {args.budget})")
    await ctx.release()
    return held
