"""Holds a context, says so, then waits forever."""

import anyio

from pie_ctx import Context


async def main(rt, args):
    ctx = Context(rt).user("hold me")
    await ctx.flush()
    await rt.session.send("holding\n")
    await anyio.sleep(3600)
