"""``pie-ctx serve --snapshot-dir`` killed with SIGKILL at random moments while a client
saves (and deletes) snapshots; afterwards every listed snapshot opens, with the greedy
continuation recorded before its save, and the folder holds no orphan file."""

from __future__ import annotations

import random
import signal
import threading
from pathlib import Path

import anyio

from pie_ctx import Context, Runtime, Sampler
from pie_ctx.errors import SnapshotExists, SnapshotNotFound
from tests.sdk.harness import tiny_engine, tiny_model_folder
from tests.server.helpers import ServeProcess

GREEDY = Sampler.greedy()
N_SAVES = 50
N_TOKENS = 8
SHARED = list(range(40, 52))  # 3 pages every prompt starts with: files shared on disk


def _prompt(i: int) -> list[int]:
    return SHARED + [(i * 13 + t) % 180 + 60 for t in range(5 + i % 11)]


class Log:
    """What the client knows: the continuation recorded before each save, the saves and
    deletes the server acknowledged."""

    def __init__(self) -> None:
        self.expected: dict[str, list[int]] = {}
        self.saved: set[str] = set()
        self.deleted: set[str] = set()
        self.next = 0


async def _work_until_killed(address: str, log: Log) -> None:
    """Save snapshots s{next}, s{next+1}... (deleting one now and then) until every save
    is done or the server dies under us."""
    async with Runtime.connect(address) as rt:
        while log.next < N_SAVES:
            i = log.next
            name = f"s{i}"
            ctx = Context(rt).append(_prompt(i))
            await ctx.flush()
            fork = ctx.fork()
            log.expected[name] = await fork.generate(GREEDY, max_tokens=N_TOKENS,
                                                     ignore_eos=True).tokens()
            await fork.release()
            try:
                await ctx.save(name)
            except SnapshotExists:  # saved before a kill took the reply away
                pass
            log.saved.add(name)
            await ctx.release()
            if i % 7 == 6:
                victim = f"s{i - 3}"
                try:
                    await Context.delete(rt, victim)
                except SnapshotNotFound:  # deleted before a kill took the reply away
                    pass
                log.deleted.add(victim)
            log.next = i + 1


def _run_client(address: str, log: Log) -> bool:
    """True when all saves are done; False when the server was killed under the client."""
    try:
        anyio.run(_work_until_killed, address, log)
    except AssertionError:
        raise
    except BaseException:  # the connection died with the server (any of several errors)
        return False
    return True


async def _verify(model: Path, folder: Path, log: Log) -> list[str]:
    async with tiny_engine(model, snapshot_dir=folder, page_size=4, num_pages=64) as engine, \
            Runtime.local(engine=engine) as rt:
        engine.store.check_invariants()  # includes: no orphan page file after the boot sweep
        listed = await rt.snapshots()
        assert set(listed) <= set(log.expected), "a snapshot nobody saved is listed"
        assert log.saved - log.deleted <= set(listed), "an acknowledged save was lost"
        assert not set(listed) & log.deleted, "an acknowledged delete came back"
        for name in listed:
            ctx = await Context.open(rt, name)
            assert ctx.open_report.pages_computed == 0
            got = await ctx.generate(GREEDY, max_tokens=N_TOKENS, ignore_eos=True).tokens()
            assert got == log.expected[name], name
            await ctx.release()
        engine.store.check_invariants()
        assert not list((engine.store.tier.files.folder / "tmp").iterdir())
        return listed


def test_saves_survive_sigkill_at_random_moments(tmp_path: Path) -> None:
    model = tiny_model_folder(tmp_path)
    folder = tmp_path / "snapshots"
    folder.mkdir()
    sock = tmp_path / "serve.sock"
    rng = random.Random(20261124)
    log = Log()
    kills = 0
    while True:
        srv = ServeProcess(tmp_path, "--socket", str(sock), "--snapshot-dir", str(folder),
                           "--page-size", "4", model=model)
        try:
            srv.wait_for(r"serving .* on ")
            killer = threading.Timer(rng.uniform(0.02, 0.3), srv.proc.send_signal,
                                     (signal.SIGKILL,))
            killer.start()
            done = _run_client(f"unix:{sock}", log)
            killer.cancel()
        finally:
            srv.stop()
        if done:
            break
        kills += 1
        assert kills < 200, "the client made no progress"
    assert kills >= 3, f"only {kills} kills: the test did not test crashes"
    listed = anyio.run(_verify, model, folder, log)
    assert len(listed) >= N_SAVES - len(log.deleted)
