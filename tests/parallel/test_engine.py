"""The SDK against a TP=2 engine (fork, durable snapshot through the disk tier, generate),
and a worker killed mid-generation: a clean failure, no hang."""

from __future__ import annotations

import os
import signal

import anyio
import pytest
import torch.distributed as dist

from pie_ctx import Context, Runtime, Sampler
from pie_ctx.errors import ModelError
from runtime.boot import boot_engine
from tests.parallel.tiny import tp_model_folder

GREEDY = Sampler.greedy()
PROMPT = "hello world, twelve 12 hello"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tp_model_folder(tmp_path_factory.mktemp("tp-engine"))


async def _session(folder, snapshot_dir, tp: int) -> dict:
    """Generate, fork, save (durably), reopen, and collect what came out."""
    engine = boot_engine(str(folder), page_size=4, num_pages=256, progress=False, tp=tp,
                         snapshot_dir=snapshot_dir)
    out = {}
    with anyio.fail_after(120):
        async with engine, Runtime.local(engine=engine) as rt:
            base = Context(rt).user(PROMPT)
            await base.flush()
            forks = [base.fork() for _ in range(3)]
            texts = [await f.generate(Sampler.temperature(1.0, seed=s), max_tokens=10,
                                      ignore_eos=True).tokens() for s, f in enumerate(forks)]
            out["forks"] = texts
            out["greedy"] = await base.generate(GREEDY, max_tokens=12, ignore_eos=True).tokens()
            await base.save("snap")
            await base.truncate(1)
            out["after_truncate"] = await base.generate(GREEDY, max_tokens=5,
                                                        ignore_eos=True).tokens()
            opened = await Context.open(rt, "snap")
            out["reopened"] = await opened.generate(GREEDY, max_tokens=6,
                                                    ignore_eos=True).tokens()
    return out


async def test_sdk_session_matches_single_device(folder, tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    one = await _session(folder, tmp_path / "a", 1)
    two = await _session(folder, tmp_path / "b", 2)
    assert not dist.is_initialized()  # the engine's exit stopped the ranks
    assert two == one
    assert len({tuple(t) for t in two["forks"]}) > 1  # the seeds did differ
    # the shards' kernel choices are kept beside the snapshots, as a single device's are
    assert list((tmp_path / "b").glob("*/kernels.json"))
    # a snapshot saved by the TP=2 engine's disk tier reopens in a fresh TP=2 engine, and in
    # a single-device one: page files hold whole pages whatever the sharding
    for tp in (2, 1):
        engine = boot_engine(str(folder), page_size=4, num_pages=256, progress=False, tp=tp,
                             snapshot_dir=tmp_path / "b")
        with anyio.fail_after(120):
            async with engine, Runtime.local(engine=engine) as rt:
                ctx = await Context.open(rt, "snap")
                report = ctx.open_report
                assert report is not None and report.pages_from_disk > 0
                got = await ctx.generate(GREEDY, max_tokens=6, ignore_eos=True).tokens()
        assert got == one["reopened"]


async def test_killed_worker_fails_pending_requests_cleanly(folder):
    engine = boot_engine(str(folder), page_size=4, num_pages=256, progress=False, tp=2,
                         stall_timeout=2.0)
    [worker] = engine.executor.runner.comm.processes
    with anyio.fail_after(90):
        with pytest.raises(ModelError):
            async with engine, Runtime.local(engine=engine) as rt:
                ctx = Context(rt).user(PROMPT)
                got = []
                with pytest.raises(ModelError, match="tensor-parallel rank was lost"):
                    async for token in ctx.generate(GREEDY, max_tokens=600, ignore_eos=True):
                        got.append(token)
                        if len(got) == 3:
                            os.kill(worker.pid, signal.SIGKILL)
                assert 3 <= len(got) < 600
                assert engine.lost is not None
                # later requests fail the same way, at once
                with pytest.raises(ModelError):
                    await Context(rt).user("again").generate(GREEDY, max_tokens=2).text()
                raise engine.lost
    assert worker.poll() is not None
    assert not dist.is_initialized()


async def test_compaction_and_scores_are_refused_and_change_nothing(folder):
    """A TP engine's pool does not copy single token slots and its ranks do not return
    attention weights: both refusals are typed, and the context is untouched."""
    from pie_ctx.errors import InvalidArgument

    engine = boot_engine(str(folder), page_size=4, num_pages=256, progress=False, tp=2)
    with anyio.fail_after(120):
        async with engine, Runtime.local(engine=engine) as rt:
            ctx = Context(rt).user(PROMPT)
            await ctx.flush()
            before = (ctx.seq_len, await ctx.positions())
            with pytest.raises(InvalidArgument, match="tensor parallel"):
                await ctx.compact(range(0, ctx.seq_len, 2))
            with pytest.raises(InvalidArgument, match="attention scores"):
                await ctx.forward().input([5]).attention_scores([0]).execute()
            assert (ctx.seq_len, await ctx.positions()) == before
