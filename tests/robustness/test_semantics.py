"""Nothing silently wrong or untyped: the SDK's rules, errors and documented behaviour."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from pie_ctx import Context, Sampler
from pie_ctx.errors import ContextClosed, InvalidArgument, SnapshotExists
from tests.sdk.harness import sdk_runtime

GREEDY = Sampler.greedy()
ROOT = Path(__file__).resolve().parents[2]


async def test_a_bare_stop_string_is_one_stop_string(tiny_folder, transport):
    async with sdk_runtime(tiny_folder, transport) as (rt, _):
        full = await Context(rt).user("x").generate(GREEDY, max_tokens=40,
                                                    ignore_eos=True).text()
        stop = full[5:8]
        one = Context(rt).user("x").generate(GREEDY, max_tokens=40, ignore_eos=True, stop=stop)
        listed = Context(rt).user("x").generate(GREEDY, max_tokens=40, ignore_eos=True,
                                                stop=[stop])
        assert await one.text() == await listed.text() == full[: full.index(stop)]
        assert one.finish_reason == "stop_string"
        none = Context(rt).user("x").generate(GREEDY, max_tokens=40, ignore_eos=True, stop=None)
        assert await none.text() == full


async def test_an_unawaited_failing_save_surfaces_on_the_next_operation(tiny_folder, transport):
    async with sdk_runtime(tiny_folder, transport) as (rt, _):
        ctx = Context(rt).append([1, 2, 3])
        await ctx.save("taken")
        ctx.save("taken")  # fire and forget: it will fail
        with pytest.raises(SnapshotExists):
            await ctx.refresh()
        assert (await ctx.refresh()).seq_len == 3  # reported once; the context is fine
        awaited = ctx.save("taken")
        with pytest.raises(SnapshotExists):
            await awaited  # whoever awaits it gets the error ...
        assert (await ctx.refresh()).seq_len == 3  # ... and the next operation does not


async def test_chat_fillers_follow_one_rule(tiny_folder, transport):
    async with sdk_runtime(tiny_folder, transport) as (rt, _):
        once = Context(rt).user("hi").cue()
        twice = Context(rt).user("hi").cue().cue()  # the turn is already open: no-op
        assert twice.pending_tokens == once.pending_tokens
        for filler in (lambda c: c.user("more"), lambda c: c.system("rules")):
            with pytest.raises(InvalidArgument, match="assistant turn is open"):
                filler(Context(rt).user("hi").cue())
        answered = Context(rt).user("hi").cue().assistant("hello").user("again")
        assert answered.pending_tokens[: len(once.pending_tokens)] == once.pending_tokens


async def test_a_released_context_refuses_every_use(tiny_folder, transport):
    async with sdk_runtime(tiny_folder, transport) as (rt, _):
        ctx = Context(rt).append([1, 2])
        await ctx.flush()
        raw = ctx.inner()
        await ctx.release()
        assert ctx.is_released
        for read in (lambda: ctx.seq_len, lambda: ctx.num_committed_pages,
                     lambda: ctx.pending_tokens, lambda: raw.seq_len, lambda: ctx.user("x"),
                     lambda: ctx.fork(), lambda: ctx.generate()):
            with pytest.raises(ContextClosed):
                read()
        await ctx.release()  # idempotent


async def test_text_with_a_lone_surrogate_is_a_typed_error(tiny_folder, transport):
    async with sdk_runtime(tiny_folder, transport) as (rt, _):
        for call in (lambda: Context(rt).user("a \udc80 b"), lambda: Context(rt).append("\ud800"),
                     lambda: rt.tokenizer.encode("x\udfff")):
            with pytest.raises(InvalidArgument, match="surrogate"):
                call()


async def test_generate_after_truncate_continues_from_the_new_last_token(tiny_folder, transport):
    async with sdk_runtime(tiny_folder, transport) as (rt, _):
        tokens = list(range(5, 40))
        ctx = Context(rt).append(tokens)
        await ctx.flush()
        await ctx.truncate(3)
        got = await ctx.generate(GREEDY, max_tokens=6, ignore_eos=True).tokens()
        fresh = Context(rt).append(tokens[:-3])
        assert got == await fresh.generate(GREEDY, max_tokens=6, ignore_eos=True).tokens()
        assert ctx.seq_len == fresh.seq_len == len(tokens) - 3 + 5  # last token still pending


def test_connecting_to_nothing_is_a_one_line_cli_error(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "runtime", "run", "examples/hello.py", "--connect",
         f"unix:{tmp_path / 'nobody.sock'}"],
        capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 1
    assert out.stderr.startswith("pie-ctx: error: cannot connect to unix:") and "Traceback" \
        not in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_examples_use_only_the_public_api():
    for path in sorted((ROOT / "examples").glob("*.py")):
        private = re.findall(r"\w\._[a-z]\w*", path.read_text())
        assert not private, (path.name, private)
