"""Holds a context, then raises."""

from pie_ctx import Context


async def main(rt, args):
    ctx = Context(rt).user("hold me")
    await ctx.flush()
    raise ValueError("boom")
