"""Constraints on the real default model (SmolLM2-135M-Instruct): every output is valid.

30 extraction prompts across three JSON schemas (nested objects, arrays, enums, numbers with
ranges, required fields), judged by the ``jsonschema`` library; plus regex and choice. All
run batched together, greedy and sampled.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from pie_ctx import Context, Runtime, Sampler, gather
from pie_ctx.constrain import Choice, JsonSchema, Regex

pytestmark = pytest.mark.real_model

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "city": {"type": "string", "maxLength": 40},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
ORDER = {
    "type": "object",
    "properties": {
        "items": {"type": "array", "minItems": 1, "maxItems": 4, "items": {
            "type": "object",
            "properties": {"product": {"type": "string", "maxLength": 30},
                           "quantity": {"type": "integer", "minimum": 1, "maximum": 99}},
            "required": ["product", "quantity"], "additionalProperties": False}},
        "priority": {"enum": ["low", "normal", "high"]},
    },
    "required": ["items", "priority"],
    "additionalProperties": False,
}
REVIEW = {
    "type": "object",
    "properties": {
        "sentiment": {"enum": ["positive", "negative", "mixed"]},
        "score": {"type": "number", "minimum": 0, "maximum": 5},
        "reviewer": {"type": "object", "properties": {
            "verified": {"type": "boolean"}, "country": {"type": "string", "maxLength": 20}},
            "required": ["verified"], "additionalProperties": False},
    },
    "required": ["sentiment", "score", "reviewer"],
    "additionalProperties": False,
}
PEOPLE = ["Ada, 36, from London", "Linus, 54, lives in Portland", "Grace aged 85 in Arlington",
          "Alan (41) of Wilmslow", "Marie, 66, Paris", "Tim, 69, Geneva", "Hedy, 85, Vienna",
          "Katherine, 101, Hampton", "Edsger, 72, Nuenen", "Barbara, 92, New York"]
ORDERS = ["3 apples and 2 pears, urgent", "one laptop, whenever", "10 pens",
          "2 chairs and a table, high priority", "5 kg of rice, low priority",
          "a bike and 2 helmets", "7 notebooks, normal", "milk and eggs asap",
          "4 tyres", "12 roses, low"]
REVIEWS = ["Great phone, 5 stars, verified buyer from Spain", "Broke after a day. 1/5",
           "Good value but slow shipping, 3.5", "Loved it! - verified, Canada",
           "Meh. 2 stars", "Works as described, 4/5, Germany", "Terrible support, 0.5",
           "Nice colour, bad battery, 2.5 (verified)", "Perfect gift, 5/5", "It's ok, 3"]


async def test_thirty_json_schema_extractions_all_validate():
    async with Runtime.local(None, num_pages=4096) as rt:
        jobs = []
        for schema, texts, what in ((PERSON, PEOPLE, "the person"), (ORDER, ORDERS, "the order"),
                                    (REVIEW, REVIEWS, "the review")):
            for i, text in enumerate(texts):
                ctx = Context(rt).system("Reply with JSON only.").user(
                    f"Extract {what} as JSON: {text}")
                sampler = Sampler.greedy() if i % 2 == 0 else Sampler.top_p(0.8, 0.95, seed=i)
                jobs.append((schema, ctx.generate(sampler, max_tokens=160,
                                                  constrain=JsonSchema(schema))))
        texts = await gather(*(g.text() for _, g in jobs))
        for (schema, gen), text in zip(jobs, texts, strict=True):
            assert gen.finish_reason == "constraint", (gen.finish_reason, text)
            jsonschema.validate(json.loads(text), schema)


async def test_regex_and_choice_on_the_default_model():
    async with Runtime.local(None, num_pages=2048) as rt:
        phones = [Context(rt).user(f"Make up a phone number, number {i}.").generate(
            Sampler.top_p(0.9, 0.95, seed=i), max_tokens=20, constrain=Regex(r"\d{3}-\d{4}"))
            for i in range(6)]
        answers = [Context(rt).user(q).generate(Sampler.greedy(), max_tokens=10,
                                                constrain=Choice(["yes", "no", "maybe"]))
                   for q in ("Is water wet?", "Is fire cold?", "Will it rain tomorrow?")]
        for text in await gather(*(g.text() for g in phones)):
            assert re.fullmatch(r"\d{3}-\d{4}", text), text
        for text in await gather(*(g.text() for g in answers)):
            assert text in ("yes", "no", "maybe")
