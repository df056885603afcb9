"""Durable snapshots through the SDK, in-process and over the socket: a restart reopens a
snapshot with no prefill and the same greedy continuation, the pool no longer bounds how
many snapshots there are, every page is accounted as from memory, from disk or computed,
and every bad condition is a typed error that leaves the engine serving."""

from __future__ import annotations

import errno
from pathlib import Path

import anyio
import pytest

from pie_ctx import Context, Runtime, Sampler
from pie_ctx.errors import (
    SnapshotCorrupt,
    SnapshotExists,
    SnapshotIncompatible,
    StorageError,
)
from tests.kv.disk_helpers import FailingOps
from tests.sdk.harness import sdk_owners, sdk_runtime

GREEDY = Sampler.greedy()
N_TOKENS = 12


async def _continuation(ctx: Context) -> list[int]:
    """Greedy tokens after ``ctx``, generated on a fork (``ctx`` is unchanged)."""
    fork = ctx.fork()
    try:
        return await fork.generate(GREEDY, max_tokens=N_TOKENS, ignore_eos=True).tokens()
    finally:
        await fork.release()


async def _reopened(rt: Runtime, name: str) -> tuple[list[int], Context]:
    ctx = await Context.open(rt, name)
    try:
        return await ctx.generate(GREEDY, max_tokens=N_TOKENS, ignore_eos=True).tokens(), ctx
    finally:
        await ctx.release()


async def test_a_restart_reopens_from_disk_with_the_same_greedy_tokens(
        tiny_folder, transport, tmp_path: Path) -> None:
    async with sdk_runtime(tiny_folder, transport, snapshot_dir=tmp_path) as (rt, engine):
        assert rt.info.snapshot_dir.startswith(str(tmp_path))
        ctx = Context(rt).system("You are terse.").user("Name three colours of the sea.").cue()
        await ctx.save("chat")
        before = await _continuation(ctx)
        await ctx.release()
        assert await rt.snapshots() == ["chat"]
        probe = await Context.open(rt, "chat")  # how the conversation goes on from there
        next_turn = probe.assistant("Blue.").user("And of the sky?").pending_tokens
        await probe.release()
        stats = await rt.stats()
        assert stats.num_disk_pages > 0 and stats.disk_pages_written >= stats.num_disk_pages
    async with sdk_runtime(tiny_folder, transport, snapshot_dir=tmp_path) as (rt, engine):
        assert await rt.snapshots() == ["chat"]
        opened = await Context.open(rt, "chat")
        report = opened.open_report
        assert report is not None and report.pages_computed == 0
        assert report.pages_from_disk == report.pages_reused > 0
        assert report.pages_from_memory == 0
        after = await opened.generate(GREEDY, max_tokens=N_TOKENS, ignore_eos=True).tokens()
        assert after == before
        again = await Context.open(rt, "chat")  # resident now: from memory
        assert again.open_report.pages_from_disk == 0 < again.open_report.pages_from_memory
        stats = await rt.stats()
        assert stats.disk_pages_loaded == report.pages_from_disk
        assert stats.tokens_computed == N_TOKENS - 1  # the first token came from saved logits
        # the conversation (the SDK's meta) survives too
        assert again.assistant("Blue.").user("And of the sky?").pending_tokens == next_turn


@pytest.mark.fp32_only("pool sizes and page counts only; dtypes are covered above")
async def test_snapshots_twice_the_pool_all_reopen_identically(tiny_folder, tmp_path: Path) -> None:
    expected: dict[str, list[int]] = {}
    kw = {"snapshot_dir": tmp_path, "num_pages": 48, "page_size": 4}
    async with sdk_runtime(tiny_folder, "local", **kw) as (rt, engine):
        for i in range(24):  # 24 snapshots x 4+ pages: more than twice the 48-page pool
            ctx = Context(rt).append([(i * 7 + t) % 200 + 3 for t in range(17)])
            await ctx.save(f"s{i}")
            expected[f"s{i}"] = await _continuation(ctx)
            await ctx.release()
        stats = await rt.stats()
        assert stats.num_snapshots == 24 and stats.num_snapshots_spilled > 0
        assert stats.num_snapshots_resident < 24
        for name, tokens in expected.items():
            assert (await _reopened(rt, name))[0] == tokens, name
        engine.store.check_invariants()
    async with sdk_runtime(tiny_folder, "local", **kw) as (rt, engine):
        for name, tokens in reversed(expected.items()):
            assert (await _reopened(rt, name))[0] == tokens, name
        engine.store.check_invariants()


@pytest.mark.fp32_only("a pass report's page counts; dtypes are covered above")
async def test_prefix_matching_loads_evicted_pages_from_disk(tiny_folder, tmp_path: Path) -> None:
    prompt = list(range(3, 43))  # 10 full pages at page size 4
    async with sdk_runtime(tiny_folder, "local", snapshot_dir=tmp_path, num_pages=24,
                           page_size=4) as (rt, engine):
        first = Context(rt).append(prompt)
        report = await first.flush()
        assert report.pages_computed == 10 and report.pages_from_disk == 0
        before = await _continuation(first)
        await first.release()
        for i in range(3):  # other prompts push the cached pages out of the pool
            other = Context(rt).append([250 - i] + prompt[1:])
            await other.flush()
            await other.release()
        assert engine.store.stats().disk_pages_written >= 10
        again = Context(rt).append(prompt)
        report = await again.flush()
        # the last page is computed: a flush computes its last token for the logits
        assert report.pages_reused == report.pages_from_disk == 9
        assert report.pages_computed == 1 and report.tokens_computed == 4
        assert await _continuation(again) == before
        stats = await rt.stats()
        assert stats.pages_from_disk == report.pages_from_disk
        engine.store.check_invariants()


@pytest.mark.fp32_only("error paths; the dtype does not matter")
async def test_disk_full_during_save_is_a_typed_error_and_nothing_is_listed(
        tiny_folder, transport, tmp_path: Path) -> None:
    async with sdk_runtime(tiny_folder, transport, snapshot_dir=tmp_path) as (rt, engine):
        ops = FailingOps()
        engine.store.tier.files.ops = ops
        ctx = Context(rt).user("a prompt long enough for a few pages of four tokens")
        await ctx.flush()
        ops.fail_after(2, errno.ENOSPC)
        with pytest.raises(StorageError, match="disk is full"):
            await ctx.save("full")
        assert await rt.snapshots() == []
        engine.store.check_invariants()
        ops.heal()
        await ctx.save("full")  # the engine kept serving; the same name is free
        assert await rt.snapshots() == ["full"]
        assert len(await ctx.generate(GREEDY, max_tokens=3, ignore_eos=True).tokens()) == 3
        engine.store.check_invariants()


@pytest.mark.fp32_only("error paths; the dtype does not matter")
async def test_a_corrupt_page_file_fails_only_its_snapshot(tiny_folder, transport,
                                                           tmp_path: Path) -> None:
    async with sdk_runtime(tiny_folder, transport, snapshot_dir=tmp_path) as (rt, engine):
        await Context(rt).append(list(range(3, 23))).save("broken")
        await Context(rt).append(list(range(100, 120))).save("fine")
        folder = engine.store.tier.files.folder
    broken = engine.store.snapshot("broken").head.pages[-1]
    path = folder / "pages" / f"{broken:016x}.page"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte
    path.write_bytes(bytes(data))
    async with sdk_runtime(tiny_folder, transport, snapshot_dir=tmp_path) as (rt, engine):
        assert await rt.snapshots() == ["broken", "fine"]
        with pytest.raises(SnapshotCorrupt, match="'broken'") as err:
            await Context.open(rt, "broken")
        assert path.name in str(err.value)
        fine = await Context.open(rt, "fine")
        assert fine.seq_len == 20
        await Context.delete(rt, "broken")  # and it can be deleted and saved again
        await fine.save("broken")
        engine.store.check_invariants()


@pytest.mark.fp32_only("error paths; the dtype does not matter")
async def test_another_page_size_refuses_the_folders_snapshots(tiny_folder, transport,
                                                              tmp_path: Path) -> None:
    async with sdk_runtime(tiny_folder, transport, snapshot_dir=tmp_path, page_size=4) as (rt, _):
        await Context(rt).append(list(range(3, 23))).save("four")
    async with sdk_runtime(tiny_folder, transport, snapshot_dir=tmp_path, page_size=8) as (rt, _):
        assert await rt.snapshots() == []
        with pytest.raises(SnapshotIncompatible, match="page size 4"):
            await Context.open(rt, "four")
        await Context(rt).append([5, 6, 7]).save("eight")
        assert await rt.snapshots() == ["eight"]


@pytest.mark.fp32_only("error paths; the dtype does not matter")
async def test_two_clients_saving_one_name_at_once_one_wins(tiny_folder, transport,
                                                           tmp_path: Path) -> None:
    async with sdk_owners(tiny_folder, transport, 2, snapshot_dir=tmp_path) as (rts, engine):
        contexts = [Context(rt).append(list(range(3 + i, 40 + i))) for i, rt in enumerate(rts)]
        for ctx in contexts:
            await ctx.flush()
        outcomes: list[BaseException | None] = []

        async def save(ctx: Context) -> None:
            try:
                await ctx.save("same")
                outcomes.append(None)
            except SnapshotExists as err:
                outcomes.append(err)

        async with anyio.create_task_group() as tg:
            for ctx in contexts:
                tg.start_soon(save, ctx)
        assert outcomes.count(None) == 1 and len(outcomes) == 2
        engine.store.check_invariants()


async def test_a_missing_snapshot_dir_fails_at_boot(tiny_folder, tmp_path: Path) -> None:
    with pytest.raises(StorageError, match="does not exist"):
        async with Runtime.local(str(tiny_folder), snapshot_dir=tmp_path / "nope", progress=False):
            pass
