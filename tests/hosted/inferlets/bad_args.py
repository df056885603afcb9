"""Takes one integer option."""


def add_arguments(parser):
    parser.add_argument("--n", type=int, required=True)


async def main(rt, args):
    return args.n
