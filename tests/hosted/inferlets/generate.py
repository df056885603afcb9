"""Generates a few tokens greedily and streams them to its session."""

from pie_ctx import Context, Sampler


def add_arguments(parser):
    parser.add_argument("prompt")
    parser.add_argument("--tokens", type=int, default=4)


async def main(rt, args):
    ctx = Context(rt).user(args.prompt).cue()
    gen = ctx.generate(Sampler.greedy(), max_tokens=args.tokens)
    async for delta in gen:
        await rt.session.send(delta.text)
    return await gen.text()
