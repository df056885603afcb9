"""``rt.spawn``, ``rt.session`` and ``rt.store`` through the SDK, in-process and over the
socket (the ``transport`` fixture), on a tiny engine that hosts tests/hosted/inferlets."""

from __future__ import annotations

import anyio
import pytest

from pie_ctx import Context, Sampler
from pie_ctx.errors import (
    InferletCancelled,
    InferletFailed,
    InferletNotFound,
    InvalidArgument,
    ValueTooLarge,
)
from tests.hosted.harness import hosting, new_runtime, settled
from tests.sdk.harness import sdk_runtime


async def test_spawn_await_and_output(tiny_folder_path, transport) -> None:
    async with hosting(tiny_folder_path, transport) as ([rt], engine):
        assert rt.info.inferlet_folder.endswith("inferlets")
        child = await rt.spawn("echo", ["a", "b"])
        assert [t async for t in child.output()] == ["a\n", "b\n"]
        assert await child == "a b" and child.done
        assert await child == "a b"  # the result stays with the handle
        # a child that generates with the model, streaming its deltas
        gen = await rt.spawn("generate", ["Hi", "--tokens", "3"])
        streamed = "".join([t async for t in gen.output()])
        assert streamed == await gen
        await settled(engine)


async def test_spawn_from_a_spawned_inferlet(tiny_folder_path, transport) -> None:
    async with hosting(tiny_folder_path, transport) as ([rt], engine):
        parent = await rt.spawn("parent", ["x", "y"])
        assert [t async for t in parent.output()] == ["child: x\n", "child: y\n"]
        assert await parent == "parent got x y"
        parent = await rt.spawn("parent", ["cancel"])  # it cancels its hung child
        assert await parent == "InferletCancelled"
        await settled(engine)


async def test_cancel_a_hung_inferlet_releases_its_contexts(tiny_folder_path, transport) -> None:
    async with hosting(tiny_folder_path, transport) as ([rt], engine):
        hung = await rt.spawn("hang")
        async for text in hung.output():
            assert text == "holding\n"
            break
        assert engine.stats().num_contexts == 1
        await hung.cancel()
        await settled(engine)  # released at the cancel
        with pytest.raises(InferletCancelled):
            await hung
        await hung.cancel()  # idempotent


async def test_a_raising_inferlet_ends_alone(tiny_folder_path, transport) -> None:
    async with hosting(tiny_folder_path, transport) as ([rt], engine):
        ctx = Context(rt).user("mine")
        await ctx.flush()
        boom = await rt.spawn("boom")
        with pytest.raises(InferletFailed, match="ValueError: boom"):
            await boom
        bad = await rt.spawn("bad_args", ["--n", "x"])
        with pytest.raises(InvalidArgument, match="invalid int value"):
            await bad
        with anyio.fail_after(10):  # our own context never noticed
            while engine.stats().num_contexts > 1:
                await anyio.sleep(0.01)
        assert await ctx.generate(Sampler.greedy(), max_tokens=2).text() is not None


async def test_a_closing_runtime_cancels_what_it_spawned(tiny_folder_path, transport) -> None:
    async with hosting(tiny_folder_path, transport) as ([other], engine):
        async with new_runtime(engine, transport) as mine:
            hung = await mine.spawn("hang")
            async for _ in hung.output():
                break
            assert engine.host.num_running == 1
        await settled(engine)
        with anyio.fail_after(10):
            while engine.host.num_running:
                await anyio.sleep(0.01)
        assert await (await other.spawn("echo", ["ok"])) == "ok"


async def test_refused_names(tiny_folder_path, transport, tmp_path) -> None:
    folder = tmp_path / "inferlets"
    folder.mkdir()
    (folder / "ok.py").write_text("async def main(rt, args):\n    return 'ok'\n")
    outside = tmp_path / "outside.py"
    outside.write_text("async def main(rt, args):\n    return 'escaped'\n")
    (folder / "link.py").symlink_to(outside)
    (folder / "sub").symlink_to(tmp_path)
    async with hosting(tiny_folder_path, transport, inferlets=folder) as ([rt], engine):
        assert await (await rt.spawn("ok")) == "ok"
        for bad in ("../outside", "/etc/passwd", "sub/outside", "link", "..", ".hidden",
                    "ok/../../outside", "nope", ""):
            with pytest.raises(InferletNotFound):
                await rt.spawn(bad)
        with pytest.raises(InvalidArgument, match="list of str"):
            await rt.spawn("ok", [1, 2])


async def test_no_folder_no_launch(tiny_folder_path, transport) -> None:
    async with sdk_runtime(tiny_folder_path, transport) as (rt, engine):
        assert rt.info.inferlet_folder == ""
        with pytest.raises(InferletNotFound, match="--inferlets DIR"):
            await rt.spawn("echo")


async def test_store_basics(tiny_folder_path, transport) -> None:
    async with sdk_runtime(tiny_folder_path, transport) as (rt, engine):
        assert await rt.store.get("k") is None and await rt.store.get("k", "d") == "d"
        await rt.store.set("k", "text")
        await rt.store.set("b", b"\x00bytes")
        assert await rt.store.get("k") == "text" and await rt.store.get("b") == b"\x00bytes"
        assert await rt.store.keys() == ["b", "k"] and await rt.store.keys("k") == ["k"]
        assert await rt.store.delete("k") and not await rt.store.delete("k")
        with pytest.raises(ValueTooLarge, match="max_store_value_bytes"):
            await rt.store.set("big", "x" * (rt.info.max_store_value_bytes + 1))
        assert await rt.store.get("big") is None
        with pytest.raises(InvalidArgument, match="str or bytes"):
            await rt.store.set("k", 3)
        with pytest.raises(InvalidArgument, match="UTF-8 bytes"):
            await rt.store.set("x" * 200, "v")


async def test_session_send_under_run_prints(tiny_folder_path, transport, capsys) -> None:
    async with sdk_runtime(tiny_folder_path, transport) as (rt, engine):
        await rt.session.send("hello ")
        await rt.session.send("world\n")
        with pytest.raises(InvalidArgument, match="str"):
            await rt.session.send(b"bytes")
    assert capsys.readouterr().out == "hello world\n"
