"""Best-of-N: prefill once, fork N times, sample concurrently, keep the most likely answer.

The forks share every committed page of the prompt; only their answers take new pages.
"""

from pie_ctx import Context, Sampler, gather


def add_arguments(parser):
    parser.add_argument("question", nargs="?", default="Give a name for a small grey cat.")
    parser.add_argument("-n", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)


async def main(rt, args):
    base = Context(rt).system("You are creative and brief.").user(args.question).cue()
    await base.flush()
    forks = [base.fork() for _ in range(args.n)]
    gens = [f.generate(Sampler.top_p(0.8, 0.95, seed=i), max_tokens=args.max_tokens)
            for i, f in enumerate(forks)]
    texts = await gather(*(g.text() for g in gens))
    scores = [sum(g.logprobs) / max(len(g.logprobs), 1) for g in gens]
    for text, score in zip(texts, scores):
        print(f"{score:8.3f}  {text!r}")
    best = max(range(args.n), key=scores.__getitem__)
    await gather(base.release(), *(f.release() for f in forks))
    return f"best: {texts[best]!r}"
