"""Save a long system prompt once as a named snapshot; answer questions from it.

Run it twice: the second run (same engine, e.g. under `pie-ctx serve`) finds the snapshot
and computes only the questions. Restart the server between the runs and the second run
still finds it: the snapshot's pages come back from the snapshot directory, not recomputed.
"""

from pie_ctx import Context, Sampler

HANDBOOK = (
    "You answer questions about the Lighthouse Hotel. Facts: check-in is from 3 pm and "
    "check-out is until 11 am. Breakfast is served from 7 to 10 am in the garden room. "
    "The pool is on the roof and opens at 8 am. Parking costs 12 euros a night. Pets up "
    "to 10 kg are welcome. The nearest train station is a 10 minute walk to the north. "
    "Answer in one short sentence."
)
QUESTIONS = ["When is breakfast?", "Can I bring my dog?", "Where is the pool?"]
NAME = "lighthouse-handbook"


def add_arguments(parser):
    parser.add_argument("--max-tokens", type=int, default=24)


async def main(rt, args):
    if NAME not in await rt.snapshots():
        base = Context(rt).system(HANDBOOK)
        report = await base.flush()
        await base.save(NAME)
        print(f"saved {NAME!r}: {base.seq_len} tokens, {report.pages_computed} pages computed")
        await base.release()
    for question in QUESTIONS:
        async with await Context.open(rt, NAME) as ctx:
            shared, from_disk = ctx.num_committed_pages, ctx.open_report.pages_from_disk
            ctx.user(question).cue()
            report = await ctx.flush()
            answer = await ctx.generate(Sampler.greedy(), max_tokens=args.max_tokens).text()
            print(f"{question} -> {answer.strip()!r}  ({shared} pages shared from the "
                  f"snapshot, {from_disk} loaded from disk, {report.tokens_computed} tokens "
                  "computed)")
