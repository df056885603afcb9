"""Adds one to the store's counter N times, reading and writing the store."""


async def main(rt, args):
    for _ in range(int(args.argv[0]) if args.argv else 1):
        value = int(await rt.store.get("counter", "0"))
        await rt.store.set("counter", str(value + 1))
    return await rt.store.get("counter")
