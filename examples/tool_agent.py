"""A tool-calling agent: the model calls Python functions, the inferlet runs them.

    pie-ctx run examples/tool_agent.py -- "What is (12 + 30) * 2?"

Every call is generated under a constraint, so its arguments always fit the function's
signature. The context keeps the whole exchange: each round computes only the tool's
result and the next call, never the conversation again.
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


def add_arguments(parser):
    parser.add_argument("question", nargs="?", default="What is (12 + 30) * 2?")
    parser.add_argument("--rounds", type=int, default=3)


async def main(rt, args):
    system = "Use the tools for arithmetic, then answer in one sentence."
    async with Context(rt).system(system, tools=list(TOOLS.values())) as ctx:
        ctx.user(args.question)
        for _ in range(args.rounds):
            gen = ctx.generate(Sampler.greedy(), max_tokens=96, tool_choice="required",
                               parallel_tool_calls=False)
            for call in await gen.calls():  # valid for the tool's schema, always
                result = await TOOLS[call.name].run(call.arguments)
                print(f"{call.name}({call.arguments}) -> {result}")
                ctx.tool_result(call.id, result)
        answer = await ctx.generate(Sampler.greedy(), max_tokens=48, tool_choice="none").text()
        print(answer)
        return answer
