"""The store's own invariants (``runtime.engine.inferlet_store``): namespaces, bounds, concurrent
sets of one key, and what a crash can leave on disk."""

from __future__ import annotations

import os

import anyio
import pytest

from pie_ctx.errors import InvalidArgument, StoreFull, ValueTooLarge
from runtime.engine.inferlet_store import InferletStore, StoreLimits


@pytest.mark.parametrize("on_disk", [True, False])
async def test_namespaces_and_bounds(tmp_path, on_disk) -> None:
    store = InferletStore(tmp_path / "store" if on_disk else None,
                          StoreLimits(max_value_bytes=8, max_keys=3, max_bytes=20))
    await store.set("a", "k1", b"12345678", text=False)  # costs key + value: 10 bytes
    assert store.get("a", "k1") == (b"12345678", False) and store.get("b", "k1") is None
    with pytest.raises(ValueTooLarge, match="8-byte limit"):
        await store.set("a", "k1", b"123456789", text=False)
    await store.set("a", "k2", b"abcdefgh", text=True)  # 20 bytes: full
    with pytest.raises(StoreFull, match="max_store_bytes"):
        await store.set("a", "k3", b"", text=True)
    await store.set("b", "k3", b"", text=True)  # another namespace has its own bound
    assert await store.delete("a", "k2") and not await store.delete("a", "k2")
    await store.set("a", "k3", b"1", text=True)
    await store.set("a", "k4", b"1", text=True)
    with pytest.raises(StoreFull, match="max_store_keys"):
        await store.set("a", "k5", b"", text=True)
    assert store.get("a", "k1") == (b"12345678", False)  # refused writes changed nothing
    assert store.keys("a") == ["k1", "k3", "k4"] and store.keys("a", "k3") == ["k3"]
    assert store.keys("b") == ["k3"]
    if on_disk:  # and all of it is what a restart finds
        again = InferletStore(tmp_path / "store")
        assert again.keys("a") == ["k1", "k3", "k4"] and again.get("a", "k3") == (b"1", True)
    for bad in ("", "bad\nkey", "x" * 129):
        with pytest.raises(InvalidArgument, match="store key"):
            store.get("a", bad)


async def test_concurrent_sets_of_one_key_leave_one_whole_value(tmp_path) -> None:
    root = tmp_path / "store"
    store = InferletStore(root)
    values = [bytes([i]) * 4096 for i in range(32)]
    async with anyio.create_task_group() as tg:
        for v in values:
            tg.start_soon(store.set, "ns", "key", v, False)
    final = store.get("ns", "key")
    assert final is not None and final[0] in values
    reopened = InferletStore(root)  # what is on disk is that same whole value
    assert reopened.get("ns", "key") == final
    assert [f for f in (root / os.listdir(root)[0]).iterdir() if f.name.startswith(".")] == []


async def test_a_crash_leaves_old_or_new_never_torn(tmp_path) -> None:
    root = tmp_path / "store"
    store = InferletStore(root)
    await store.set("ns", "a", b"old", text=False)
    await store.set("ns", "b", b"fine", text=True)
    folder = next(root.iterdir())
    # what a SIGKILL in the middle of a set leaves: a temporary file, never renamed
    (folder / ".YQ.123.tmp").write_bytes(b"PCS1\x00garbage")
    # and a file damaged on disk is skipped, not served
    damaged = folder / "Yg"  # the file of key "b" (its name is the key in base64)
    damaged.write_bytes(damaged.read_bytes()[:-1] + b"X")
    reopened = InferletStore(root)
    assert reopened.get("ns", "a") == (b"old", False)
    assert reopened.get("ns", "b") is None


async def test_a_shared_store_sees_what_another_engine_set_and_deleted(tmp_path) -> None:
    # Two engines on one shared snapshot folder (a fleet): each reads the files.
    root = tmp_path / "store"
    a, b = InferletStore(root, shared=True), InferletStore(root, shared=True)
    assert b.get("ns", "k") is None and b.keys("ns") == []  # b loads the namespace first
    await a.set("ns", "k", b"one", False)
    await a.set("ns", "other", b"x", True)
    assert b.get("ns", "k") == (b"one", False)
    assert b.keys("ns") == ["k", "other"]
    await b.set("ns", "k", b"two", False)  # the last writer's value, whole
    assert a.get("ns", "k") == (b"two", False)
    assert await a.delete("ns", "other")
    assert b.get("ns", "other") is None and b.keys("ns") == ["k"]
    alone = InferletStore(root)  # an unshared store keeps its own index (as before)
    await a.set("ns", "late", b"z", True)
    assert alone.keys("ns") == ["k", "late"]  # (it loaded the namespace after the set)
