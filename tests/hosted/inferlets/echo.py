"""Sends each word to its session, returns them joined."""


async def main(rt, args):
    for word in args.argv:
        await rt.session.send(word + "\n")
    return " ".join(args.argv)
