"""Tree of thought: branch, branch again, score every leaf, keep the best path.

Forks nest: each level forks the node it expands, and siblings run concurrently.
"""

from pie_ctx import Context, Sampler, gather


def add_arguments(parser):
    parser.add_argument("--width", type=int, default=2, help="branches per node")
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--step-tokens", type=int, default=12)


async def expand(node, depth, args, path, seed):
    """Return (mean logprob, path of texts) of the best leaf under `node`."""
    if depth == 0:
        return path
    children = [node.fork() for _ in range(args.width)]
    gens = [c.generate(Sampler.temperature(0.9, seed=seed * 31 + i), max_tokens=args.step_tokens,
                       stop=["\n"])
            for i, c in enumerate(children)]
    texts = await gather(*(g.text() for g in gens))
    subtrees = await gather(*(
        expand(c, depth - 1, args, path + [(t, sum(g.logprobs) / max(len(g.logprobs), 1))],
               seed * 7 + i + 1)
        for i, (c, g, t) in enumerate(zip(children, gens, texts))))
    await gather(*(c.release() for c in children))
    return max(subtrees, key=lambda p: sum(s for _, s in p) / len(p))


async def main(rt, args):
    root = Context(rt).user("Plan a one-day trip to the seaside, one step per line.").cue()
    await root.flush()
    best = await expand(root, args.depth, args, [], seed=1)
    for depth, (text, score) in enumerate(best):
        print(f"{'  ' * depth}{score:7.3f}  {text.strip()!r}")
    await root.release()
    return len(best)
