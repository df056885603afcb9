"""Context lifetimes: garbage collection, inferlet exit, trio, and a torch-free SDK."""

from __future__ import annotations

import gc
import subprocess
import sys

import anyio

from pie_ctx import Context, Runtime, Sampler
from runtime.cli import main as cli_main
from tests.sdk.harness import sdk_runtime, tiny_engine


async def test_collected_context_is_released(tiny_folder, transport):
    async with sdk_runtime(tiny_folder, transport) as (rt, engine):
        ctx = Context(rt).append(list(range(1, 12)))
        await ctx.flush()
        assert (await rt.stats()).num_contexts == 1
        del ctx
        gc.collect()
        for _ in range(50):
            await anyio.sleep(0.01)
            if (await rt.stats()).num_contexts == 0:
                break
        assert (await rt.stats()).num_contexts == 0
        engine.store.check_invariants()


async def test_inferlet_exit_releases_everything_but_snapshots(tiny_folder, transport):
    async with sdk_runtime(tiny_folder, transport) as (rt, engine):
        async with Runtime.local(engine=engine) as inner_rt:
            keep = Context(inner_rt).system("saved")
            await keep.save("kept")
            left_open = [keep.fork() for _ in range(3)]
            await left_open[0].flush()
            gen = left_open[1].generate(Sampler.greedy(), max_tokens=4)
            for ctx in left_open:
                await ctx.refresh()
            assert (await inner_rt.stats()).num_contexts >= 4
        stats = engine.store.stats()
        assert stats.num_contexts == 0 and stats.num_snapshots == 1
        assert stats.num_pages_working == 0 or stats.num_pages_working == 1  # the snapshot's tail
        engine.store.check_invariants()
        del gen


def test_same_inferlet_under_trio(tiny_folder):
    async def inferlet(rt):
        base = Context(rt).user("hi").cue()
        await base.flush()
        a, b = base.fork(), base.fork()
        async with anyio.create_task_group() as tg:
            out = {}

            async def run(name, ctx):
                out[name] = await ctx.generate(Sampler.greedy(), max_tokens=5).tokens()
            tg.start_soon(run, "a", a)
            tg.start_soon(run, "b", b)
        return out["a"], out["b"]

    async def go():
        async with tiny_engine(tiny_folder) as engine, Runtime.local(engine=engine) as rt:
            return await inferlet(rt)

    a_trio, b_trio = anyio.run(go, backend="trio")
    a_aio, b_aio = anyio.run(go, backend="asyncio")
    assert a_trio == b_trio == a_aio == b_aio


def test_sdk_imports_no_torch():
    code = ("import sys, pie_ctx, pie_ctx.loading, runtime.cli, pie_ctx.socket_transport, pie_ctx.proto.tokenizer;"
            "bad = [m for m in sys.modules if m == 'torch' or m.startswith('torch.')];"
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_cli_run_and_help(tiny_folder, capsys):
    assert cli_main(["run", "examples/hello.py", "--model", str(tiny_folder), "--page-size", "4",
                     "--dtype", tiny_folder.dtype, "--", "hi", "--max-tokens", "4"]) == 0
    assert cli_main(["run", "examples/missing.py", "--model", str(tiny_folder)]) == 1
    assert "does not exist" in capsys.readouterr().err


def test_cli_reports_inferlet_errors_cleanly(tiny_folder, tmp_path, capsys):
    bad = tmp_path / "bad.py"
    bad.write_text("from pie_ctx import Context\n\n"
                   "async def main(rt, args):\n"
                   "    await Context.open(rt, 'no-such-snapshot')\n")
    assert cli_main(["run", str(bad), "--model", str(tiny_folder), "--dtype", tiny_folder.dtype]) == 1
    err = capsys.readouterr().err
    assert "pie-ctx: error:" in err and "no-such-snapshot" in err and "Traceback" not in err
