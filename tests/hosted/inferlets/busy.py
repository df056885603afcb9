"""Pure-Python CPU work for a few seconds (never awaits), then returns how many loops."""

import time


def add_arguments(parser):
    parser.add_argument("--seconds", type=float, default=2.0)


async def main(rt, args):
    await rt.session.send("busy\n")
    end = time.perf_counter() + args.seconds
    loops = 0
    while time.perf_counter() < end:
        loops += sum(i * i for i in range(1000)) > 0
    return loops
