"""A second ``generate()`` continues the same assistant turn; ``user()`` or ``cue()`` then
starts a new one, and the context holds exactly what the chat template renders."""

from __future__ import annotations

import pytest

from pie_ctx import Context, Sampler
from tests.sdk.harness import sdk_runtime

GREEDY = Sampler.greedy()


async def _answer(ctx: Context, letters: list[int]) -> str:
    # letters only: the tiny random model writes no end of turn, so the turn stays open
    gen = ctx.generate(GREEDY, max_tokens=3, allowed_tokens=letters)
    text = await gen.text()
    assert gen.finish_reason == "length"
    return text


@pytest.mark.fp32_only("the conversation's text, not the numbers")
async def test_a_second_generate_continues_the_turn_and_user_starts_the_next(tiny_folder):
    async with sdk_runtime(tiny_folder, "local") as (rt, _):
        letters = rt.tokenizer.encode("abcdefghijklmnop")
        ctx = Context(rt).user("Hi")
        first = await _answer(ctx, letters)
        second = await _answer(ctx, letters)  # goes on with the same answer
        ctx.user("And then?")
        await ctx.generate(GREEDY, max_tokens=1, allowed_tokens=letters).text()  # cues itself
        text = rt.tokenizer.decode(await ctx.tokens())
        expected = rt.tokenizer.render_chat(
            [{"role": "user", "content": "Hi"},
             {"role": "assistant", "content": first + second},
             {"role": "user", "content": "And then?"}], add_generation_prompt=True)
        assert text.startswith(expected) and len(text) > len(expected)


@pytest.mark.fp32_only("the conversation's text, not the numbers")
async def test_cue_after_an_answer_starts_a_new_assistant_turn(tiny_folder):
    async with sdk_runtime(tiny_folder, "local") as (rt, _):
        letters = rt.tokenizer.encode("abcdefghijklmnop")
        ctx = Context(rt).user("Hi")
        first = await _answer(ctx, letters)
        ctx.cue()
        expected = rt.tokenizer.render_chat(
            [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": first}],
            add_generation_prompt=True)
        assert rt.tokenizer.decode(await ctx.tokens()) == expected


@pytest.mark.fp32_only("the conversation's text, not the numbers")
async def test_the_next_turn_follows_a_matched_stop_string(tiny_folder):
    async with sdk_runtime(tiny_folder, "local") as (rt, _):
        letters = rt.tokenizer.encode("abcdefghijklmnop")
        ctx = Context(rt).user("Hi")
        probe = ctx.fork()
        greedy = await _answer(probe, letters)
        await probe.release()
        gen = ctx.generate(GREEDY, max_tokens=3, allowed_tokens=letters, stop=[greedy[-1]])
        shown = await gen.text()
        assert gen.finish_reason == "stop_string" and greedy[-1] not in shown
        held = rt.tokenizer.decode(gen.tokens_out)  # the stop string's tokens are in the context
        assert held.startswith(shown) and held.endswith(greedy[-1])
        ctx.user("And then?").cue()
        expected = rt.tokenizer.render_chat(
            [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": held},
             {"role": "user", "content": "And then?"}], add_generation_prompt=True)
        assert rt.tokenizer.decode(await ctx.tokens()) == expected
