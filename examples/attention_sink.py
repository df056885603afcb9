"""A sliding attention window with sink tokens, built from the raw handle and masks.

Each new token attends to the first `--sinks` entries of the context and the last
`--window` ones (StreamingLLM's recipe), at a position capped at sinks + window so the
model never sees positions beyond what it attends to. Pages are reserved ahead through the
raw handle; tokens written under a custom mask get their own page hashes and are never
shared with causal ones.
"""

from pie_ctx import Context, Sampler


def add_arguments(parser):
    parser.add_argument("--sinks", type=int, default=4)
    parser.add_argument("--window", type=int, default=24)
    parser.add_argument("--max-tokens", type=int, default=40)


async def main(rt, args):
    ctx = Context(rt).user("Tell me a long story about a lighthouse keeper.").cue()
    last = ctx.pending_tokens[-1]
    await ctx.truncate(1)
    await ctx.flush()
    raw = ctx.inner()
    pages_needed = -(-(ctx.seq_len + args.max_tokens) // ctx.page_size) - raw.num_committed_pages
    if not await raw.reserve_working_pages(max(pages_needed - raw.num_working_pages, 0)):
        raise RuntimeError("not enough KV pages for the window right now")
    out = []
    for _ in range(args.max_tokens):
        n = ctx.seq_len  # entries already in the context
        row = [i < args.sinks or i >= n - args.window for i in range(n)] + [True]
        position = min(ctx.next_position, args.sinks + args.window)
        res = await (ctx.forward().input_at([last], [position]).attention_mask([row])
                     .sample([0], Sampler.greedy()).execute())
        last = res.tokens[0]
        out.append(last)
        if last in rt.info.stop_token_ids:
            break
    print(rt.tokenizer.decode(out, skip_special_tokens=True))
    print(f"{len(out)} tokens; each attended to at most {args.sinks + args.window + 1} entries")
    await ctx.release()
