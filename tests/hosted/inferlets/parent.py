"""Spawns echo, relays its output, returns its result; or spawns hang and cancels it."""


async def main(rt, args):
    if args.argv[:1] == ["cancel"]:
        child = await rt.spawn("hang")
        async for text in child.output():
            await rt.session.send("child: " + text)
            break
        await child.cancel()
        try:
            await child
        except Exception as err:
            return type(err).__name__
        return "not cancelled"
    child = await rt.spawn("echo", args.argv)
    async for text in child.output():
        await rt.session.send("child: " + text)
    return "parent got " + await child
