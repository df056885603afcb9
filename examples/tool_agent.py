"""A tool-calling agent: the model calls Python functions, the inferlet runs them.

    pie-ctx run examples/tool_agent.py -- "What is 17 + 25?"

Every call is generated under a constraint, so its arguments always fit the function's
signature. The context keeps the whole exchange: each round computes only the tool's
result and the next call, never the conversation again.

The model decides each round (``tool_choice="auto"``): another call, or its answer. Two
guards keep a small model from looping or going quiet (docs/examples.md): a call it has
made already ends the rounds (it has that result), and if its answer is empty or another
call (a model that has just seen tool declarations may keep writing calls even under
``tool_choice="none"``), the answer comes from a fresh context that holds the question and
the results, without the tools.
"""

from pie_ctx import Context, Sampler
from pie_ctx.tools import Tool


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def multiply(a: int, b: int) -> int:
    """Multiply two integers."""
    return a * b


TOOLS = {t.name: t for t in map(Tool.from_function, (add, multiply))}
SYSTEM = "Use the tools for arithmetic, then answer in one sentence."


def _shown(name, arguments):
    return f"{name}({', '.join(f'{k}={v!r}' for k, v in arguments.items())})"


def add_arguments(parser):
    parser.add_argument("question", nargs="?", default="What is 17 + 25?")
    parser.add_argument("--rounds", type=int, default=4)


async def main(rt, args):
    log, made = [], set()  # "name(a=1, b=2) = result" of every call that ran; the calls
    async with Context(rt).system(SYSTEM, tools=list(TOOLS.values())) as ctx:
        ctx.user(args.question)
        answer = ""
        for _ in range(args.rounds):
            gen = ctx.generate(Sampler.greedy(), max_tokens=96, tool_choice="auto",
                               parallel_tool_calls=False)
            calls = await gen.calls()  # valid for the tool's schema, always
            if not calls:  # it answered
                answer = (await gen.text()).strip()
                break
            if all(_shown(c.name, c.arguments) in made for c in calls):
                break  # it asks again for what it has
            for call in calls:
                result = await TOOLS[call.name].run(call.arguments)
                made.add(_shown(call.name, call.arguments))
                log.append(f"{_shown(call.name, call.arguments)} = {result}")
                print(log[-1])
                ctx.tool_result(call.id, result)
        if not answer:
            gen = ctx.generate(Sampler.greedy(), max_tokens=48, tool_choice="none", stop=["\n"])
            answer = (await gen.text()).strip()
            if gen.finish_reason == "tool_calls" or answer.startswith("{"):
                answer = ""  # another call, not an answer
        if answer:
            print(answer)
            return
    # the model kept calling tools: answer from the results, in a context without them
    results = "\n".join(log) or "(no tool was called)"
    async with Context(rt).system("Answer in one sentence from the calculator's results.") \
            .user(f"{args.question}\nCalculator:\n{results}").cue() as plain:
        print((await plain.generate(Sampler.greedy(), max_tokens=48, stop=["\n"])
               .text()).strip())
