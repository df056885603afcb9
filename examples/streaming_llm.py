"""StreamingLLM as a program: keep the first `--sinks` tokens and a recent window, never
more than `--budget` tokens, however long the conversation runs.

The prompt goes in chunk by chunk and the answer comes out `--step` tokens at a time; each
time the context outgrows its budget, `ctx.compact` drops the middle. Kept tokens keep
their positions, so the model reads the sinks, a gap, then the window (docs/compaction.md).
"""

from pie_ctx import Context, Sampler
from pie_ctx.policies import streaming_keep


def add_arguments(parser):
    parser.add_argument("--budget", type=int, default=48)
    parser.add_argument("--sinks", type=int, default=4)
    parser.add_argument("--step", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--prompt", default="Tell me a long story about a lighthouse keeper. " * 6)


async def main(rt, args):
    ctx = Context(rt)
    tokens = rt.tokenizer.encode(args.prompt)
    peak, out = 0, []
    for start in range(0, len(tokens), args.step):
        ctx.append(tokens[start:start + args.step])
        await ctx.flush()
        if ctx.seq_len > args.budget:
            await ctx.compact(streaming_keep(ctx.seq_len, args.budget, args.sinks))
        peak = max(peak, ctx.seq_len)
    while len(out) < args.max_tokens:
        gen = ctx.generate(Sampler.greedy(), max_tokens=args.step, ignore_eos=True)
        out += await gen.tokens()
        await ctx.flush()  # the pending last token goes in too
        if ctx.seq_len > args.budget:
            await ctx.compact(streaming_keep(ctx.seq_len, args.budget, args.sinks))
        peak = max(peak, ctx.seq_len)
    print(rt.tokenizer.decode(out, skip_special_tokens=True))
    print(f"{len(tokens) + len(out)} tokens seen; at most {peak} held (budget {args.budget})")
    await ctx.release()
    return peak
