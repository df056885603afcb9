"""Classification by select: score each label as a continuation, in one pass.

`ctx.select(labels)` reads the context's pages once for all labels (labels sharing their
first tokens share that work), returns the best label's index and every score, and leaves
the context as it was; `assistant(label)` then records the answer in the conversation.
"""

from pie_ctx import Context

LABELS = ["positive", "negative", "neutral"]


def add_arguments(parser):
    parser.add_argument("review", nargs="?",
                        default="The battery lasts two days and the screen is gorgeous.")
    parser.add_argument("--method", default="token_length_normalized")


async def main(rt, args):
    async with Context(rt).system("Classify the sentiment of the review.").user(
            args.review).cue() as ctx:
        best, scores = await ctx.select(LABELS, method=args.method)
        for label, score in zip(LABELS, scores):
            print(f"{score:9.3f}  {label}{'  <-' if label == LABELS[best] else ''}")
        ctx.assistant(LABELS[best])  # the idiom: select, then write the answer
        await ctx.flush()
    return LABELS[best]
