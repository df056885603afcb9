"""Isolation: one owner's bad request fails that request only, over both transports.

Two lines of defence, each tested: every property the model step relies on is checked at
admission (a bad pass never joins a batch), and if a step fails anyway the engine bisects
the batch so only the jobs whose rows break it fail.
"""

from __future__ import annotations

import anyio
import pytest

from pie_ctx import Context, Sampler, gather
from pie_ctx.errors import InvalidArgument, PieError
from tests.sdk.harness import sdk_owners

GREEDY = Sampler.greedy()
POISON = 7  # a token id the injected fault fires on


async def _victim_run(rt, prompt: str, max_tokens: int = 24) -> list[int]:
    ctx = Context(rt).user(prompt)
    return await ctx.generate(GREEDY, max_tokens=max_tokens, ignore_eos=True).tokens()


BAD_PASSES = {
    "all-false mask row": lambda f: f.input([3, 4]).attention_mask(
        [[True, True, True, True, False], [False, False, False, False, False]]),
    "ragged mask": lambda f: f.input([3, 4]).attention_mask([[True], [True, True]]),
    "mask too wide": lambda f: f.input([3]).attention_mask([[True] * 50]),
    "logits index out of range": lambda f: f.input([3]).logits([1]),
    "distribution top_k too large": lambda f: f.input([3]).distribution(0, 10**6),
    "position past the model": lambda f: f.input_at([3], [10**6]),
    "huge reply": lambda f: f.input([3]).logits([0] * 5000),
}


@pytest.mark.parametrize("case", sorted(BAD_PASSES))
async def test_a_bad_pass_is_refused_before_it_joins_a_batch(tiny_folder, transport, case):
    async with sdk_owners(tiny_folder, transport, 2, max_reply_bytes=2**20) as (
            (good, bad), engine):
        alone = await _victim_run(good, "count to ten")
        hostile = Context(bad).append([1, 2, 3])
        await hostile.flush()
        before = hostile.seq_len

        async def attack() -> None:
            for _ in range(5):
                with pytest.raises(InvalidArgument):
                    await BAD_PASSES[case](hostile.forward()).execute()
                await anyio.sleep(0)

        with anyio.fail_after(60):
            results = await gather(_victim_run(good, "count to ten"), attack())
        assert results[0] == alone  # the other owner never noticed
        assert hostile.seq_len == before
        assert engine.stats().num_isolated_failures == 0  # refused, never ran
        engine.store.check_invariants()


class _FaultyRunner:
    """Wraps the real runner; a step whose batch holds POISON raises (an injected fault)."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.calls = 0

    def forward(self, batch):
        self.calls += 1
        if any(POISON in seq.tokens for seq in batch):
            raise RuntimeError("injected fault in one row")
        return self.runner.forward(batch)


async def test_a_step_that_fails_anyway_fails_only_the_job_that_broke_it(tiny_folder,
                                                                        transport):
    async with sdk_owners(tiny_folder, transport, 3) as ((a, b, hostile), engine):
        solo_a = await _victim_run(a, "tell me a story")
        solo_b = await _victim_run(b, "name three colours")
        engine.executor.runner = _FaultyRunner(engine.executor.runner)
        poisoned = Context(hostile).append([1, 2, 3, POISON, 5])

        async def attack() -> BaseException | None:
            try:
                await poisoned.flush()
            except PieError as err:
                return err
            return None

        with anyio.fail_after(60):
            got_a, got_b, err = await gather(_victim_run(a, "tell me a story"),
                                             _victim_run(b, "name three colours"), attack())
        assert got_a == solo_a and got_b == solo_b
        assert isinstance(err, PieError) and "injected fault" in str(err)
        assert poisoned.seq_len == 0 and poisoned.pending_tokens == [1, 2, 3, POISON, 5]
        assert engine.stats().num_isolated_failures == 1
        # The faulty owner can go on once it stops sending the poison.
        poisoned2 = Context(hostile).append([1, 2, 3])
        await poisoned2.flush()
        assert poisoned2.seq_len == 3
        engine.store.check_invariants()


async def test_seeded_sampling_is_unchanged_by_a_failed_step(tiny_folder):
    """The bisection re-runs steps: seeded draws must not be consumed twice."""
    sampler = Sampler.top_p(0.9, 0.95, seed=11)
    async with sdk_owners(tiny_folder, "local", 2) as ((a, hostile), engine):
        solo = await Context(a).user("a poem").generate(sampler, max_tokens=16,
                                                        ignore_eos=True).tokens()
        engine.executor.runner = _FaultyRunner(engine.executor.runner)

        async def attack() -> None:
            for _ in range(4):
                with pytest.raises(PieError):
                    await Context(hostile).append([POISON, 1]).flush()

        got, _ = await gather(Context(a).user("a poem").generate(
            sampler, max_tokens=16, ignore_eos=True).tokens(), attack())
        assert got == solo
        assert engine.stats().num_isolated_failures == 4
