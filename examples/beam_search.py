"""Beam search with fork and release: keep the `--beams` most likely continuations.

Each step scores every beam's next-token distribution in one pass per beam (the engine
batches the beams into one model call), forks the survivors and releases the rest.
"""

import math

from pie_ctx import Context, gather


def add_arguments(parser):
    parser.add_argument("--beams", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)


async def main(rt, args):
    root = Context(rt).user("Complete the sentence: The best thing about mornings is").cue()
    last = root.pending_tokens[-1]
    await root.truncate(1)
    await root.flush()
    beams = [(root, 0.0, [], last)]  # (context, log-prob, tokens, token to feed)
    stops = set(rt.info.stop_token_ids)
    for _ in range(args.steps):
        outs = await gather(*(ctx.forward().input([tok]).distribution(0, args.beams).execute()
                              for ctx, _, _, tok in beams))
        candidates = []
        for (ctx, score, toks, _), out in zip(beams, outs):
            ids, probs = out.distributions[0]
            for t, p in zip(ids, probs):
                candidates.append((score + math.log(max(p, 1e-30)), ctx, toks + [t], t))
        candidates.sort(key=lambda c: c[0], reverse=True)
        survivors = candidates[: args.beams]
        new_beams = [(ctx.fork(), score, toks, t) for score, ctx, toks, t in survivors]
        await gather(*(ctx.release() for ctx, _, _, _ in beams))
        beams = new_beams
        if all(toks[-1] in stops for _, _, toks, _ in beams):
            break
    for _ctx, score, toks, _ in beams:
        print(f"{score:8.3f}  {rt.tokenizer.decode(toks, skip_special_tokens=True)!r}")
    await gather(*(ctx.release() for ctx, _, _, _ in beams))
    return rt.tokenizer.decode(beams[0][2], skip_special_tokens=True)
