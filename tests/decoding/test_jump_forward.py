"""Jump-forward: the tokens a constraint forces ride along with the next sampled token.

The output must be exactly that of plain constrained decoding: the same tokens under
greedy, and under sampling the same distribution (where the model may write the forced
bytes with other tokens, verification keeps its choice) and, with a seed, the same tokens.
Prompt lookup in the engine too.
"""

from __future__ import annotations

import collections
import json
import math

import pytest

from pie_ctx import Context, Sampler, gather
from pie_ctx.constrain import Grammar, JsonSchema, Regex
from tests.sdk.harness import sdk_runtime

SCHEMA = {"type": "object", "properties": {
    "name": {"const": "get_weather"},
    "arguments": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 6},
        "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}},
    "required": ["name", "arguments"], "additionalProperties": False}
CONSTRAINTS = [
    JsonSchema(SCHEMA),
    Regex(r"hello world, (hello|world) [0-9]{2}!"),
    Grammar('start: "<call>" ("hello" | "help") " well " /[a-z]{1,4}/ "</call>"'),
]


async def _run(rt, constraint, sampler, *, jump: bool, prompt: str = "q"):
    async with Context(rt).user(prompt) as ctx:  # released at once: many run at a time
        await ctx.flush()
        gen = ctx.generate(sampler, max_tokens=120, constrain=constraint, jump_forward=jump)
        await gen.text()
    return gen


@pytest.mark.parametrize("constraint", CONSTRAINTS, ids=["json", "regex", "lark"])
async def test_greedy_output_is_token_identical_in_fewer_steps(tiny_folder, transport,
                                                               constraint):
    async with sdk_runtime(tiny_folder, transport) as (rt, engine):
        plain = await _run(rt, constraint, Sampler.greedy(), jump=False)
        jumped = await _run(rt, constraint, Sampler.greedy(), jump=True)
        assert jumped.tokens_out == plain.tokens_out
        assert jumped.text_out == plain.text_out
        assert jumped.finish_reason == plain.finish_reason == "constraint"
        assert plain.report.num_steps == len(plain.tokens_out)
        assert jumped.report.num_steps < plain.report.num_steps * 0.7, \
            (jumped.report.num_steps, plain.report.num_steps)
        # the stream reports every token, jumped or not, with its log-probability
        assert len(jumped.logprobs) == len(jumped.tokens_out)
        assert all(lp <= 0 for lp in jumped.logprobs)
        engine.store.check_invariants()


@pytest.mark.fp32_only("a distribution test: one dtype is enough")
async def test_sampled_output_has_the_same_distribution(tiny_folder):
    """The free choices between forced runs (and the tokenization of the forced runs,
    where the model could split them otherwise) are distributed as without jump-forward:
    a two-sample chi-square test over the sampled token sequences (fixed seeds, so the
    test is deterministic)."""
    constraint = Regex(r"hello [a-c], hello world [a-c]")
    n = 300
    async with sdk_runtime(tiny_folder, "local") as (rt, _):
        counts = []
        for jump in (False, True):
            gens = await gather(*(_run(rt, constraint, Sampler.top_p(4.0, 1.0, seed=s),
                                       jump=jump) for s in range(n)))
            counts.append(collections.Counter(tuple(g.tokens_out) for g in gens))
    outcomes = sorted(set(counts[0]) | set(counts[1]))
    assert len(outcomes) > 3, "the test needs several outcomes to compare"
    # pool rare outcomes so every cell has a fair expected count
    common = [o for o in outcomes if counts[0][o] + counts[1][o] >= 10]
    table = [[c[o] for o in common] + [n - sum(c[o] for o in common)] for c in counts]
    chi2, dof = 0.0, -1
    for j in range(len(table[0])):
        total = table[0][j] + table[1][j]
        if total == 0:
            continue
        dof += 1
        for row in table:
            expected = total / 2
            chi2 += (row[j] - expected) ** 2 / expected
    # the 99.9th percentile of chi-square: dof + 3.1 * sqrt(2 dof) + 10 is conservative
    assert dof >= 1 and chi2 < dof + 3.1 * math.sqrt(2 * dof) + 10, (chi2, dof, table)


async def test_engine_prompt_lookup_is_lossless_and_drafts_under_a_constraint(tiny_folder,
                                                                              transport):
    async with sdk_runtime(tiny_folder, transport) as (rt, _):
        text = "abcabcabcabcabc " * 6
        plain = Context(rt).append(text)
        looked = Context(rt).append(text)
        a = plain.generate(Sampler.greedy(), max_tokens=40, ignore_eos=True)
        b = looked.generate(Sampler.greedy(), max_tokens=40, ignore_eos=True,
                            speculator="prompt_lookup")
        assert await b.tokens() == await a.tokens()
        assert b.report.num_steps <= a.report.num_steps
        # under a constraint too (drafts are trimmed to what it accepts)
        schema = JsonSchema({"type": "array", "items": {"const": "abcabc"}, "minItems": 6,
                             "maxItems": 6})
        c = Context(rt).append(text).generate(Sampler.greedy(), max_tokens=80,
                                              constrain=schema, speculator="prompt_lookup")
        assert json.loads(await c.text()) == ["abcabc"] * 6


async def test_a_seeded_sampled_generation_writes_the_same_tokens_with_drafts(tiny_folder,
                                                                          monkeypatch):
    """Verification decodes each row as a plain step does (one uniform number a token it
    produces), so neither jump-forward nor prompt lookup changes a token of a seeded
    sampled generation. (Rejection sampling as first built drew a number a draft token
    judged, plus one for a replacement: kept drafts alone shifted every later draw.)"""
    from runtime.engine import decoding

    groups = []
    real = decoding.verify

    def spy(adjusted, draft, params, gen, stops):
        out = real(adjusted, draft, params, gen, stops)
        groups.append((len(draft), out[0]))
        return out

    monkeypatch.setattr(decoding, "verify", spy)
    text = "abcabcabcabcabc " * 6
    looked_up = JsonSchema({"type": "array", "items": {"const": "abcabc"}, "minItems": 6,
                            "maxItems": 6})
    async with sdk_runtime(tiny_folder, "local") as (rt, engine):
        for seed in range(3):
            for t in (4.0, 1.0, 0.3):  # hot: the model splits forced runs its own way
                sampler = Sampler.top_p(t, 0.95, seed=seed)
                for constraint in (*CONSTRAINTS, Regex(r"hello [a-c], hello world [a-c]")):
                    plain = await _run(rt, constraint, sampler, jump=False, prompt=f"q{seed}")
                    jumped = await _run(rt, constraint, sampler, jump=True, prompt=f"q{seed}")
                    assert jumped.tokens_out == plain.tokens_out, (seed, t, constraint)
                outs = []  # prompt lookup, free and under a constraint
                for spec in (None, "prompt_lookup"):
                    free = Context(rt).append(text).generate(
                        sampler, max_tokens=30, ignore_eos=True, speculator=spec)
                    held = Context(rt).append(text).generate(
                        sampler, max_tokens=60, constrain=looked_up, speculator=spec)
                    outs.append((await free.tokens(), await held.tokens()))
                assert outs[0] == outs[1], (seed, t)
        engine.store.check_invariants()
    # the drafts were kept whole here (rejected ones: tests/decoding/test_speculation.py's
    # test_verify_produces_plain_decodings_tokens_and_uses_its_numbers)
    assert sum(kept for n, kept in groups if n) >= 20


async def test_min_tokens_masks_the_stop_tokens_until_reached(tiny_folder, transport):
    async with sdk_runtime(tiny_folder, transport) as (rt, _):
        eos = rt.info.stop_token_ids[0]
        gen = Context(rt).user("x").generate(Sampler.greedy(), max_tokens=30, min_tokens=12,
                                             logit_bias={eos: 100.0})
        tokens = await gen.tokens()
        assert len(tokens) == 13 and tokens[-1] == eos and gen.finish_reason == "stop_token"
        assert eos not in tokens[:12]
