from __future__ import annotations

from pie_ctx import Context, Sampler
from tests.sdk.harness import tiny_runtime


async def test_chat_flush_fork_generate(tiny_folder):
    async with tiny_runtime(tiny_folder) as rt:
        base = Context(rt).system("You are terse.").user("hello").cue()
        report = await base.flush()
        assert report.tokens_written == base.seq_len > 0
        forks = [base.fork() for _ in range(3)]
        texts = [await f.generate(Sampler.greedy(), max_tokens=8).text() for f in forks]
        assert texts[0] == texts[1] == texts[2]
        solo = Context(rt).system("You are terse.").user("hello").cue()
        assert await solo.generate(Sampler.greedy(), max_tokens=8).text() == texts[0]
