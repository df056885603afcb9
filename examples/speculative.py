"""Prompt-lookup speculative decoding with explicit forward passes.

Drafts come from the context itself: after the last n-gram's earlier occurrence, propose
the tokens that followed it. One pass verifies the whole draft (greedy); accepted tokens
stay, the rest are truncated from the working pages (written with defer_commit, so the
truncation is lossless), and full pages are committed through the raw handle. The output
is identical to plain greedy decoding, in fewer passes when drafts hit.
"""

from pie_ctx import Context, Sampler

PROMPT = ("Copy this sentence exactly: The quick brown fox jumps over the lazy dog near the "
          "old stone bridge, and the miller's cat watches from the window.")


def add_arguments(parser):
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--draft", type=int, default=6, help="draft length")


def propose(history, k, n=3):
    """Tokens that followed the latest earlier occurrence of the last n tokens."""
    tail = history[-n:]
    for start in range(len(history) - n - 1, -1, -1):
        if history[start:start + n] == tail:
            return history[start + n:start + n + k]
    return []


async def speculate(ctx, stops, max_tokens, k):
    history = ctx.pending_tokens
    last = history[-1]
    await ctx.truncate(1)  # the last prompt token is fed by the first pass instead
    await ctx.flush()
    out, passes = [], 0
    while len(out) < max_tokens:
        draft = propose(history, min(k, max_tokens - len(out) - 1))
        inputs = [last] + draft
        res = await (ctx.forward().input(inputs)
                     .sample(range(len(inputs)), Sampler.greedy())
                     .defer_commit().execute())
        passes += 1
        accepted = 0
        while accepted < len(draft) and draft[accepted] == res.tokens[accepted]:
            accepted += 1
        new = draft[:accepted] + [res.tokens[accepted]]
        await ctx.truncate(len(draft) - accepted)  # reject the rest of the draft
        raw = ctx.inner()
        await raw.commit_working_pages(raw.num_working_tokens // raw.page_size)
        for t in new:
            out.append(t)
            history.append(t)
            if t in stops or len(out) == max_tokens:
                return out, passes
        last = new[-1]
    return out, passes


async def main(rt, args):
    ctx = Context(rt).user(PROMPT).cue()
    ref = ctx.fork()
    stops = set(rt.info.stop_token_ids)
    tokens, passes = await speculate(ctx, stops, args.max_tokens, args.draft)
    plain = await ref.generate(Sampler.greedy(), max_tokens=args.max_tokens).tokens()
    print(rt.tokenizer.decode(tokens, skip_special_tokens=True))
    print(f"{len(tokens)} tokens in {passes} passes (plain greedy: {len(plain)} passes); "
          f"identical to plain greedy: {tokens == plain[:len(tokens)]}")
    return tokens == plain[:len(tokens)]
