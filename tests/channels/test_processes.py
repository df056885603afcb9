"""Inferlets in separate processes talking through one real ``pie-ctx serve`` (Unix
socket and HTTP), and what happens when a receiver is killed with SIGKILL."""

from __future__ import annotations

import queue
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from runtime.cli import fetch_stats
from runtime.engine.channels import MESSAGE_OVERHEAD
from tests.sdk.harness import tiny_model_folder
from tests.server.helpers import REPO, ServeProcess, serve_env

# The two inferlets of docs/messages.md: a boss hands out questions and collects answers,
# a worker answers with the model until told to stop.
BOSS = '''
async def main(rt, args):
    questions = ["Name a colour.", "Name a fruit.", "Name a bird."]
    for q in questions:
        await rt.send("jobs", q)
    answers = [await rt.receive("answers") for _ in questions]
    await rt.send("jobs", "stop")
    return "\\n".join(sorted(answers))
'''
WORKER = '''
from pie_ctx import Context, Sampler

async def main(rt, args):
    async for job in rt.receive("jobs"):
        if job == "stop":
            return "worker done"
        ctx = Context(rt).user(job).cue()
        answer = await ctx.generate(Sampler.greedy(), max_tokens=4).text()
        await rt.send("answers", f"{job} -> {len(answer)} chars")
'''
RECEIVER = '''
"""Print the messages of a channel as they come (COUNT of them; -1: forever)."""

def add_arguments(parser):
    parser.add_argument("channel")
    parser.add_argument("count", type=int)

async def main(rt, args):
    left = args.count
    async for m in rt.receive(args.channel):
        print(m, flush=True)
        left -= 1
        if left == 0:
            return
'''
SENDER = '''
def add_arguments(parser):
    parser.add_argument("channel")
    parser.add_argument("prefix")
    parser.add_argument("count", type=int)

async def main(rt, args):
    for i in range(args.count):
        await rt.send(args.channel, f"{args.prefix}{i}")
    return f"sent {args.count}"
'''


class Inferlet:
    """``pie-ctx run FILE --connect ADDRESS -- ARGS`` in its own process; stdout lines kept."""

    def __init__(self, tmp: Path, address: str, source: str, *args: str) -> None:
        file = tmp / f"inferlet_{abs(hash(source))}.py"
        file.write_text(textwrap.dedent(source))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "runtime", "run", str(file), "--connect", address,
             "--", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=serve_env(tmp), cwd=REPO)
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:  # type: ignore[union-attr]
            self.lines.put(line.rstrip("\n"))

    def read(self, n: int, timeout: float = 30.0) -> list[str]:
        end, out = time.monotonic() + timeout, []
        while len(out) < n:
            try:
                out.append(self.lines.get(timeout=max(0.0, end - time.monotonic())))
            except queue.Empty:
                raise AssertionError(f"got {out} then nothing ({self.stderr_tail()})") from None
        return out

    def finish(self, timeout: float = 60.0) -> list[str]:
        assert self.proc.wait(timeout) == 0, self.stderr_tail()
        time.sleep(0.05)  # the pump thread has read the last lines
        return [self.lines.get_nowait() for _ in range(self.lines.qsize())]

    def stderr_tail(self) -> str:
        if self.proc.poll() is None:
            return "still running"
        return (self.proc.stderr.read() or "")[-2000:]  # type: ignore[union-attr]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, str, str]]:
    """One ``serve --http`` for the module: (folder, socket address, HTTP URL)."""
    tmp = tmp_path_factory.mktemp("channels-serve")
    srv = ServeProcess(tmp, "--socket", str(tmp / "s.sock"), "--http", "127.0.0.1:0",
                       "--page-size", "4", model=tiny_model_folder(tmp))
    try:
        url = srv.wait_for(r"serving HTTP on (http://\S+)").group(1)
        address = srv.wait_for(r"serving .* on (unix:\S+)").group(1)
        yield tmp, address, url
    finally:
        srv.stop()


def stats(address: str) -> dict[str, Any]:
    return anyio.run(fetch_stats, address, None)


def wait_for_stats(address: str, timeout: float = 30.0, **expected: int) -> dict[str, Any]:
    end = time.monotonic() + timeout
    while True:
        now = stats(address)
        if all(now[k] == v for k, v in expected.items()):
            return now
        if time.monotonic() > end:
            raise AssertionError(f"stats never reached {expected}: {now}")
        time.sleep(0.05)


def test_two_inferlet_processes_talk_through_the_server(server) -> None:
    tmp, address, _ = server
    worker = Inferlet(tmp, address, WORKER)
    try:
        boss = Inferlet(tmp, address, BOSS)
        answers = boss.finish()
        assert [a.split(" -> ")[0] for a in answers] == ["Name a bird.", "Name a colour.",
                                                          "Name a fruit."]
        assert all(a.endswith(" chars") for a in answers)
        assert worker.finish() == ["worker done"]
    finally:
        worker.kill()
    wait_for_stats(address, num_channels=0, num_channel_messages=0, num_contexts=0)


def test_a_killed_receivers_queue_stays_bounded_and_a_new_receiver_gets_it(server) -> None:
    tmp, address, _ = server
    bound = stats(address)
    receiver = Inferlet(tmp, address, RECEIVER, "work", "-1")
    try:
        assert Inferlet(tmp, address, SENDER, "work", "a", "3").finish() == ["sent 3"]
        assert receiver.read(3) == ["a0", "a1", "a2"]
        receiver.kill()  # SIGKILL while it waits in a receive
        wait_for_stats(address, num_channels=0)  # the server ended its receive
        sender = Inferlet(tmp, address, SENDER, "work", "b", "100")
        try:
            limit = 64  # the default max_queue_messages
            wait_for_stats(address, num_channel_messages=limit)
            time.sleep(0.3)
            assert sender.proc.poll() is None  # still waiting for room: back-pressure
            held = stats(address)
            assert held["channel_bytes"] == sum(len(f"b{i}") + MESSAGE_OVERHEAD
                                                for i in range(limit))
            second = Inferlet(tmp, address, RECEIVER, "work", "100")
            assert second.finish() == [f"b{i}" for i in range(100)]  # in order, none lost
            assert sender.finish() == ["sent 100"]
        finally:
            sender.kill()
    finally:
        receiver.kill()
    after = wait_for_stats(address, num_channels=0, num_channel_messages=0, channel_bytes=0)
    assert after["num_subscriptions"] == bound["num_subscriptions"]


def test_an_http_post_reaches_an_inferlet_process(server) -> None:
    tmp, address, url = server
    receiver = Inferlet(tmp, address, RECEIVER, "inbox", "2")
    try:
        wait_for_stats(address, num_channels=1)  # it is waiting in its receive
        for body in ("hello from outside", "second"):
            r = httpx.post(f"{url}/v1/pie/channels/inbox", content=body, timeout=30)
            assert r.status_code == 200, r.text
        assert receiver.finish() == ["hello from outside", "second"]
    finally:
        receiver.kill()
