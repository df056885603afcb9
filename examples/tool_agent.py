"""A tool-calling agent whose calls always fit a JSON schema.

Each turn the model either calls a tool or answers, as one JSON object constrained by a
schema (a `oneOf` of the two shapes). Tool results go back into the conversation as user
turns; the context keeps the whole exchange, so every turn only computes its new tokens.
"""

import json

from pie_ctx import Context, Sampler
from pie_ctx.constrain import JsonSchema

TOOLS = {
    "add": lambda a, b: a + b,
    "multiply": lambda a, b: a * b,
}
SCHEMA = {
    "oneOf": [
        {"type": "object",
         "properties": {"tool": {"enum": sorted(TOOLS)},
                        "a": {"type": "integer", "minimum": -1000, "maximum": 1000},
                        "b": {"type": "integer", "minimum": -1000, "maximum": 1000}},
         "required": ["tool", "a", "b"], "additionalProperties": False},
        {"type": "object",
         "properties": {"answer": {"type": "string", "maxLength": 80}},
         "required": ["answer"], "additionalProperties": False},
    ]
}
SYSTEM = ("You can call tools by replying with JSON: {\"tool\": \"add\" or \"multiply\", "
          "\"a\": int, \"b\": int}. When you know the answer reply {\"answer\": \"...\"}.")


def add_arguments(parser):
    parser.add_argument("question", nargs="?", default="What is (12 + 30) * 2?")
    parser.add_argument("--turns", type=int, default=4)


async def main(rt, args):
    async with Context(rt).system(SYSTEM).user(args.question) as ctx:
        for turn in range(args.turns):
            gen = ctx.generate(Sampler.greedy(), max_tokens=160, constrain=JsonSchema(SCHEMA))
            text = await gen.text()
            if gen.finish_reason != "constraint":  # cut off by max_tokens: not whole JSON
                print(f"turn {turn}: no complete reply ({gen.finish_reason})")
                return None
            reply = json.loads(text)
            print(f"turn {turn}: {json.dumps(reply)}")
            if "answer" in reply:
                return reply["answer"]
            result = TOOLS[reply["tool"]](reply["a"], reply["b"])
            ctx.user(f"Tool result: {result}")
    return None
