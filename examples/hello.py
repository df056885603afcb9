"""A chat turn, streamed token by token.

    pie-ctx run examples/hello.py -- "Why is the sky blue?"
"""

from pie_ctx import Context, Sampler


def add_arguments(parser):
    parser.add_argument("question", nargs="?", default="What is the capital of France?")
    parser.add_argument("--max-tokens", type=int, default=64)


async def main(rt, args):
    async with Context(rt) as ctx:
        ctx.system("You are a helpful assistant. Answer in one sentence.").user(args.question).cue()
        async for delta in ctx.generate(Sampler.greedy(), max_tokens=args.max_tokens):
            print(delta.text, end="", flush=True)
        print()
