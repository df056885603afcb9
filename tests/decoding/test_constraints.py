"""Constraints, logit bias and allowed tokens, in the engine, over both transports.

The tiny random model writes nonsense, which is what makes these tests strict: whatever it
wants to write, the output must match the constraint.
"""

from __future__ import annotations

import json
import re

import anyio
import jsonschema
import pytest

from pie_ctx import Context, Sampler, gather
from pie_ctx.constrain import AnyJson, Choice, Grammar, JsonSchema, Regex
from pie_ctx.errors import InvalidArgument
from pie_ctx.speculate import PromptLookup
from tests.sdk.harness import sdk_runtime

GREEDY = Sampler.greedy()
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "ok"],
    "additionalProperties": False,
}


def _samplers(n: int) -> list:
    return [GREEDY] + [Sampler.top_p(1.0, 0.95, seed=s) for s in range(n - 1)]


async def test_regex_choice_and_grammars_always_match(tiny_folder, transport):
    async with sdk_runtime(tiny_folder, transport) as (rt, engine):
        cases = [
            (Regex(r"[0-9]{3}-[0-9]{4}"), lambda t: re.fullmatch(r"[0-9]{3}-[0-9]{4}", t)),
            (Choice(["yes", "no", "maybe so"]), lambda t: t in ("yes", "no", "maybe so")),
            (Grammar('start: "(" item ("," item)* ")"\nitem: /[a-c]/'),
             lambda t: re.fullmatch(r"\([a-c](,[a-c])*\)", t)),
            (Grammar('root ::= "<" [xyz]+ ">"', syntax="ebnf"),
             lambda t: re.fullmatch(r"<[xyz]+>", t)),
        ]
        for constraint, ok in cases:
            gens = [Context(rt).user(f"q{i}").generate(s, max_tokens=60, constrain=constraint)
                    for i, s in enumerate(_samplers(4))]
            texts = await gather(*(g.text() for g in gens))
            for g, text in zip(gens, texts, strict=True):
                assert ok(text), (constraint, text)
                assert g.finish_reason == "constraint", (constraint, g.finish_reason)
        engine.store.check_invariants()


async def test_json_schema_and_any_json_always_parse(tiny_folder, transport):
    async with sdk_runtime(tiny_folder, transport) as (rt, _):
        gens = [Context(rt).user(f"person {i}").generate(s, max_tokens=200,
                                                         constrain=JsonSchema(SCHEMA))
                for i, s in enumerate(_samplers(6))]
        for text in await gather(*(g.text() for g in gens)):
            jsonschema.validate(json.loads(text), SCHEMA)
        any_json = Context(rt).user("anything").generate(GREEDY, max_tokens=60,
                                                         constrain=AnyJson())
        text = await any_json.text()
        if any_json.finish_reason == "constraint":
            json.loads(text)


@pytest.mark.fp32_only("re-batching moves a bf16 logit by one rounding unit, which can flip a "
                       "sampled token; tests/precision bounds that difference")
async def test_constrained_rows_leave_the_others_untouched(tiny_folder, transport):
    async with sdk_runtime(tiny_folder, transport) as (rt, engine):
        def plain(i: int):
            return Context(rt).user(f"story {i}").generate(
                Sampler.top_k(0.9, 40, seed=i), max_tokens=24, ignore_eos=True)

        alone = [await plain(i).tokens() for i in range(3)]
        calls = engine.executor.num_model_calls
        mixed = await gather(
            *(plain(i).tokens() for i in range(3)),
            *(Context(rt).user(f"json {i}").generate(GREEDY, max_tokens=40,
                                                     constrain=JsonSchema(SCHEMA)).text()
              for i in range(3)))
        assert mixed[:3] == alone
        assert engine.executor.num_model_calls - calls < 3 * 40  # they shared steps


async def test_a_fork_mid_conversation_keeps_its_constraint_independent(tiny_folder, transport):
    async with sdk_runtime(tiny_folder, transport) as (rt, _):
        base = Context(rt).system("answer briefly").user("a number?")
        await base.flush()
        a, b = base.fork(), base.fork()
        ta, tb = await gather(
            a.generate(GREEDY, max_tokens=20, constrain=Regex(r"[0-9]{2,4}")).text(),
            b.generate(GREEDY, max_tokens=20, constrain=Choice(["yes", "no"])).text())
        assert re.fullmatch(r"[0-9]{2,4}", ta) and tb in ("yes", "no")
        a.user("again?")  # the conversation goes on, constrained again
        assert re.fullmatch(r"[a-z]+", await a.generate(
            GREEDY, max_tokens=10, constrain=Regex("[a-z]+")).text())


async def test_cancel_mid_constrained_generation_changes_nothing(tiny_folder, transport):
    async with sdk_runtime(tiny_folder, transport) as (rt, engine):
        ctx = Context(rt).user("long json")
        await ctx.flush()
        before = ctx.seq_len
        gen = ctx.generate(GREEDY, max_tokens=200, constrain=JsonSchema(SCHEMA))
        async for _ in gen:
            break
        await gen.aclose()
        assert ctx.seq_len == before and (await ctx.refresh()).seq_len == before
        text = await ctx.generate(GREEDY, max_tokens=200, constrain=JsonSchema(SCHEMA)).text()
        jsonschema.validate(json.loads(text), SCHEMA)
        engine.store.check_invariants()


@pytest.mark.fp16
async def test_preemption_under_oversubscription_keeps_outputs_valid(tiny_folder, transport):
    # Six generations that together need about twice the pool: some are preempted and
    # replayed, and every output still matches.
    async with sdk_runtime(tiny_folder, transport, num_pages=48, stall_timeout=10) as (rt, eng):
        async def one(i: int) -> str:
            async with Context(rt).append([40 + i] * 30) as ctx:
                return await ctx.generate(Sampler.top_p(1.0, 0.9, seed=i), max_tokens=34,
                                          constrain=Regex(r"[a-f]{5,30}")).text()

        with anyio.fail_after(120):
            texts = await gather(*(one(i) for i in range(6)))
        assert all(re.fullmatch(r"[a-f]{5,30}", t) for t in texts), texts
        assert eng.scheduler.num_preemptions > 0
        eng.store.check_invariants()


async def test_logit_bias_and_allowed_tokens(tiny_folder, transport):
    async with sdk_runtime(tiny_folder, transport) as (rt, _):
        allowed = [97, 98, 99]
        toks = await Context(rt).user("x").generate(GREEDY, max_tokens=12, ignore_eos=True,
                                                    allowed_tokens=allowed).tokens()
        assert set(toks) <= set(allowed)
        plain = await Context(rt).user("x").generate(GREEDY, max_tokens=4,
                                                     ignore_eos=True).tokens()
        biased = await Context(rt).user("x").generate(
            GREEDY, max_tokens=4, ignore_eos=True, logit_bias={plain[0]: -1e4, 200: 50.0}
        ).tokens()
        assert biased[0] == 200 and plain[0] not in biased
        out = await (Context(rt).append([3, 4, 5]).forward().input([6])
                     .sample([0], GREEDY, allowed_tokens=[42]).execute())
        assert out.tokens == [42]


BAD = {
    "bias out of range": dict(logit_bias={10**6: 1.0}),
    "bias not finite": dict(logit_bias={3: float("inf")}),
    "bias of the wrong type": dict(logit_bias=[1, 2]),
    "allowed out of range": dict(allowed_tokens=[-1]),
    "allowed empty": dict(allowed_tokens=[]),
    "top_logprobs too many": dict(top_logprobs=21),
    "constraint of the wrong type": dict(constrain="[0-9]+"),
    "regex that does not compile": dict(constrain=Regex("(")),
    "schema that does not compile": dict(constrain=JsonSchema({"type": "nonsense"})),
    "grammar that does not parse": dict(constrain=Grammar("start: (")),
    "no token allowed": dict(constrain=Regex("[0-9]+"), allowed_tokens=[97]),
    "speculator of the wrong type": dict(speculator=3),
    # prompt lookup runs in the engine, under any constraint; a speculator of yours cannot
    "speculator of yours with a constraint": dict(speculator=PromptLookup([1, 2, 3]),
                                                  constrain=Regex("a")),
}


@pytest.mark.parametrize("case", sorted(BAD))
async def test_bad_decoding_arguments_are_typed_and_change_nothing(tiny_folder, transport, case):
    async with sdk_runtime(tiny_folder, transport) as (rt, engine):
        ctx = Context(rt).user("hello")
        await ctx.flush()
        before = (ctx.seq_len, ctx.pending_tokens)
        with pytest.raises(InvalidArgument):
            await ctx.generate(GREEDY, max_tokens=8, **BAD[case]).text()
        assert (ctx.seq_len, ctx.pending_tokens) == before
        assert (await ctx.refresh()).seq_len == before[0]
        engine.store.check_invariants()
    for build in (lambda: Regex(""), lambda: JsonSchema("{oops"), lambda: Choice([]),
                  lambda: Choice(["a", ""]), lambda: Grammar("x", syntax="peg")):
        with pytest.raises(InvalidArgument):
            build()
