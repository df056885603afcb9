"""Speculative decoding with prompt lookup: drafts from the context, verified in one pass.

`generate(speculator="prompt_lookup")` drafts the tokens that followed the latest earlier
occurrence of the last few tokens; each round the engine verifies the whole draft in one
pass (by speculative rejection sampling, so the output is exactly what plain decoding
would give, greedy or sampled) and drops the rejected tokens from the working pages.
Copying or editing a given text is where drafts hit.
"""

from pie_ctx import Context, Sampler

PROMPT = ("Copy this sentence exactly: The quick brown fox jumps over the lazy dog near the "
          "old stone bridge, and the miller's cat watches from the window.")


def add_arguments(parser):
    parser.add_argument("--max-tokens", type=int, default=48)


async def main(rt, args):
    ctx = Context(rt).user(PROMPT)
    ref = ctx.fork()
    stats0 = await rt.stats()
    gen = ctx.generate(Sampler.greedy(), max_tokens=args.max_tokens, speculator="prompt_lookup")
    tokens = await gen.tokens()
    stats1 = await rt.stats()
    plain = await ref.generate(Sampler.greedy(), max_tokens=args.max_tokens).tokens()
    stats2 = await rt.stats()
    print(rt.tokenizer.decode(tokens, skip_special_tokens=True))
    print(f"{len(tokens)} tokens in {stats1.num_steps - stats0.num_steps} steps with "
          f"speculation, {stats2.num_steps - stats1.num_steps} without; identical: "
          f"{tokens == plain}")
    return tokens == plain
