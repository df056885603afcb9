"""Structured output: extract fields from text as JSON that always fits a schema.

The engine masks every step with the schema's grammar, so the reply parses and validates
whatever the model would have written; the generation ends as soon as the JSON is complete.
"""

import json

from pie_ctx import Context, Sampler
from pie_ctx.constrain import JsonSchema

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "languages": {"type": "array", "items": {"type": "string", "maxLength": 12},
                      "maxItems": 3},
    },
    "required": ["name", "age", "languages"],
    "additionalProperties": False,
}


def add_arguments(parser):
    parser.add_argument("text", nargs="?",
                        default="Grace Hopper, 85, wrote COBOL and FLOW-MATIC programs.")
    parser.add_argument("--max-tokens", type=int, default=256)


async def main(rt, args):
    async with Context(rt).system("Reply with JSON only.").user(
            f"Extract the person from: {args.text}") as ctx:
        gen = ctx.generate(Sampler.greedy(), max_tokens=args.max_tokens,
                           constrain=JsonSchema(SCHEMA))
        text = await gen.text()
    if gen.finish_reason != "constraint":  # cut off by max_tokens: not a whole object yet
        print(f"no complete JSON within {args.max_tokens} tokens: {text}")
        return None
    person = json.loads(text)
    print(json.dumps(person, indent=2))
    print(f"({gen.finish_reason}: {len(gen.tokens_out)} tokens)")
    return person
