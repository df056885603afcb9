"""The fleet, live: a local Ray instance, 2 engine replicas of the tiny model on one shared
snapshot folder, the official ``openai`` client against the front's HTTP port.

Covers: chat (streamed too) and /metrics per replica; a session's turns on one replica
(``x-session-id``, Responses' ``previous_response_id``); a prompt sent where its prefix's
pages are (KV events); channels whose parties meet through the front; a snapshot saved on
one replica opened on the other with every page read from the folder and none computed;
SIGKILL of a replica mid-generation (the stream fails with a clear error, the session
answers again from the other replica, nothing saved is recomputed, Serve brings the
replica back and it takes traffic); SIGKILL of a replica's engine mid-stream (one
OpenAI-shaped error, read by the ``openai`` client and by raw ``httpx``; the next call
answered by the other replica; the engine's temporary folder gone). No replica's
temporary folder is left when the fleet stops.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from runtime.fleet.app import build_app, start_fleet, stop_fleet  # noqa: E402
from runtime.fleet.replica import TEMP_PREFIX  # noqa: E402
from tests.sdk.harness import tiny_model_folder  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
MODEL = "tiny-llama"


class Fleet:
    """The running fleet: its URL and a few helpers."""

    def __init__(self, url: str, folder: Path) -> None:
        self.url, self.folder = url, folder

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0,
                             timeout=300, **kw)

    def replicas(self) -> dict[str, dict]:
        got = httpx.get(self.url + "/fleet/replicas", timeout=30).json()["replicas"]
        return {r["replica"]: r for r in got}

    def wait_replicas(self, n: int, timeout: float = 240, without: str | None = None) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            reps = self.replicas()
            if len(reps) == n and without not in reps:
                return reps
            time.sleep(0.5)
        raise AssertionError(f"the fleet did not get to {n} replicas: {self.replicas()}")

    def chat(self, text: str, session: str | None = None, **kw):
        headers = {"x-session-id": session} if session else {}
        raw = self.client().chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=4,
            temperature=0, extra_headers=headers, **kw)
        return raw.headers["x-pie-replica"], raw.parse()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory) -> Iterator[Fleet]:
    model = tiny_model_folder(tmp_path_factory.mktemp("model"))
    snaps = tmp_path_factory.mktemp("shared")
    # The replicas' temporary folders go here (short: a Unix socket's path is limited).
    temp_root = Path(tempfile.mkdtemp(prefix="pcf-"))
    ray.init(num_cpus=2, object_store_memory=80 * 2**20, include_dashboard=False,
             log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT), "TMPDIR": str(temp_root),
                                       "XDG_DATA_HOME": str(tmp_path_factory.mktemp("d"))}})
    port = _free_port()
    try:
        start_fleet(build_app(["--model", str(model), "--page-size", "4", "--num-pages", "512"],
                              snaps, replicas=2, max_ongoing_requests=8), "127.0.0.1", port)
        f = Fleet(f"http://127.0.0.1:{port}", snaps)
        f.wait_replicas(2, timeout=60)
        yield f
    finally:
        stop_fleet(own_ray=True)
        left = [p.name for p in temp_root.iterdir() if p.name.startswith(TEMP_PREFIX)]
        shutil.rmtree(temp_root, ignore_errors=True)
    assert left == [], f"replica temporary folders left after the fleet stopped: {left}"


def test_the_openai_client_streams_through_the_front_and_metrics_name_replicas(fleet) -> None:
    client = fleet.client()
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hi."}], max_tokens=5,
        temperature=0)
    assert reply.choices[0].finish_reason in ("length", "stop")
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hi."}], max_tokens=5,
        temperature=0, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == reply.choices[0].message.content  # the same engine code, greedy
    metrics = httpx.get(fleet.url + "/metrics", timeout=30).text
    for rid in fleet.replicas():
        assert f'replica="{rid}"' in metrics


def test_a_sessions_turns_land_on_one_replica(fleet) -> None:
    for session in ("alice", "bob", "carol"):
        landed = {fleet.chat(f"turn {i} of {session}", session=session)[0] for i in range(3)}
        assert len(landed) == 1, (session, landed)
    client = fleet.client()
    first = client.responses.with_raw_response.create(model=MODEL, input="Hello, first turn.",
                                                      max_output_tokens=3, temperature=0)
    rid, where = first.parse().id, first.headers["x-pie-replica"]
    for i in range(3):
        nxt = client.responses.with_raw_response.create(
            model=MODEL, input=f"turn {i}", previous_response_id=rid, max_output_tokens=3,
            temperature=0)
        assert nxt.headers["x-pie-replica"] == where
        rid = nxt.parse().id


def test_a_prompt_goes_where_its_prefix_is(fleet) -> None:
    system = "You are a careful assistant who answers in one word. " * 3
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": "first"}]
    raw = fleet.client().chat.completions.with_raw_response.create(
        model=MODEL, messages=msgs, max_tokens=2, temperature=0)
    holder = raw.headers["x-pie-replica"]
    time.sleep(1.5)  # the holder's KV events reach the router
    for q in ("second", "third", "fourth", "fifth"):
        raw = fleet.client().chat.completions.with_raw_response.create(
            model=MODEL, messages=[msgs[0], {"role": "user", "content": q}], max_tokens=2,
            temperature=0)
        assert raw.headers["x-pie-replica"] == holder


def test_channel_parties_meet_through_the_front(fleet) -> None:
    for i in range(4):  # names spread over both replicas; each pair meets
        name = f"jobs-{i}"
        sent = httpx.post(f"{fleet.url}/v1/pie/channels/{name}", content=f"job {i}",
                          headers={"content-type": "text/plain"}, timeout=30)
        assert sent.status_code == 200, sent.text
        got = httpx.get(f"{fleet.url}/v1/pie/channels/{name}?timeout=5", timeout=30)
        assert got.status_code == 200 and got.json()["data"] == f"job {i}"


async def test_a_snapshot_saved_on_one_replica_opens_on_the_other_from_the_folder(fleet):
    from pie_ctx import Context, Runtime

    a, b = list(fleet.replicas().values())[:2]
    async with Runtime.connect(f"unix:{a['socket']}") as rt_a:
        ctx = Context(rt_a).append(list(range(3, 3 + 4 * 6 + 2)))  # 6 pages + 2 tokens
        await ctx.flush()
        await ctx.save("moved-session")
        await ctx.release()
    async with Runtime.connect(f"unix:{b['socket']}") as rt_b:
        opened = await Context.open(rt_b, "moved-session")
        report = opened.open_report
        assert report.pages_from_disk == 7 and report.pages_from_memory == 0
        assert report.pages_computed == 0 and report.tokens_computed == 0
        assert opened.seq_len == 26
        await opened.release()


def test_sigkill_of_a_replica_mid_generation(fleet) -> None:
    client = fleet.client()
    # A stored conversation on some replica: its snapshot is in the shared folder.
    first = client.responses.with_raw_response.create(
        model=MODEL, input="Remember this: the sky is green. " * 4, max_output_tokens=3,
        temperature=0)
    rid, victim = first.parse().id, first.headers["x-pie-replica"]
    pid, engine_pid = fleet.replicas()[victim]["pid"], fleet.replicas()[victim]["engine_pid"]
    # A long generation on the victim (the same session), killed while it streams.
    stream = client.responses.create(model=MODEL, input="count", previous_response_id=rid,
                                     max_output_tokens=400, temperature=0, stream=True)
    events = iter(stream)
    next(events)  # it started
    killed = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    with pytest.raises((openai.APIError, httpx.HTTPError)):
        for _ in events:
            pass
    # The session answers again, from the other replica, from its saved snapshot.
    deadline = time.monotonic() + 60
    while True:
        try:
            again = client.responses.with_raw_response.create(
                model=MODEL, input="and now?", previous_response_id=rid, max_output_tokens=2,
                temperature=0)
            break
        except openai.APIError:
            assert time.monotonic() < deadline, "the session never answered again"
            time.sleep(0.5)
    failover_s = time.monotonic() - killed
    assert again.headers["x-pie-replica"] != victim
    usage = again.parse().usage
    # every page of the saved conversation came from the folder, none was computed again
    cached = usage.input_tokens_details.cached_tokens
    assert cached >= first.parse().usage.input_tokens, usage
    print(f"failover {failover_s:.1f} s, cached {cached} of {usage.input_tokens}")
    # Ray Serve replaces the replica; the new one takes traffic.
    fleet.wait_replicas(2, timeout=240, without=victim)
    with pytest.raises(ProcessLookupError):  # its engine went with it
        for _ in range(50):
            os.kill(engine_pid, 0)
            time.sleep(0.2)
    landed = set()
    for i in range(12):
        landed.add(fleet.chat(f"spread {i}", session=f"after-{i}")[0])
    assert len(landed) == 2, landed  # both replicas serve, the new one included


def _assert_one_clean_error(error: dict, pids: list[int]) -> None:
    """One OpenAI-shaped error: a code, one sentence, nothing of Ray's traceback."""
    assert set(error) == {"message", "type", "code"}, error
    assert error["code"] == "replica_unavailable" and error["type"] == "server_error"
    message = error["message"]
    assert message.endswith(".") and ". " not in message and "\n" not in message, message
    for leak in ("\x1b", "Traceback", "ray::", "pid=", "127.0.0.1", "/", *map(str, pids)):
        assert leak not in message, (leak, message)


def test_an_engine_killed_mid_stream_gives_one_openai_error(fleet) -> None:
    client = fleet.client()
    victim, _ = fleet.chat("who serves me?", session="doomed")
    info = fleet.replicas()[victim]
    folder = Path(info["socket"]).parent
    assert folder.is_dir()
    # Answers that no end-of-turn token cuts short (ignore_eos): both streams are still
    # generating when the engine dies, however fast the machine (the two fit its pool).
    body = {"model": MODEL, "messages": [{"role": "user", "content": "count"}],
            "max_tokens": 800, "temperature": 0, "stream": True, "ignore_eos": True}
    # the session is the key's: the raw stream names the openai client's key too
    headers = {"x-session-id": "doomed", "authorization": "Bearer none"}
    # Two streams on the victim: one through the openai client, one raw.
    stream = client.chat.completions.create(
        model=MODEL, messages=body["messages"], max_tokens=800, temperature=0, stream=True,
        extra_headers=headers, extra_body={"ignore_eos": True})
    chunks = iter(stream)
    next(chunks)
    with httpx.Client(timeout=120) as raw:
        with raw.stream("POST", fleet.url + "/v1/chat/completions", json=body,
                        headers=headers) as reply:
            assert reply.headers["x-pie-replica"] == victim
            lines = reply.iter_lines()
            assert next(lines).startswith("data: ")
            os.kill(info["engine_pid"], signal.SIGKILL)
            rest = list(lines)
    with pytest.raises(openai.APIError) as caught:
        for _ in chunks:
            pass
    pids = [info["pid"], info["engine_pid"]]
    _assert_one_clean_error(caught.value.body, pids)
    assert caught.value.code == "replica_unavailable"
    events = [ln for ln in rest if ln]
    assert events[-2] == "event: error", events[-3:]
    _assert_one_clean_error(json.loads(events[-1][len("data: "):])["error"], pids)
    # The session's next call is answered by the other replica (retried there if it
    # reached the victim first), and the engine's temporary folder is gone.
    where, reply = fleet.chat("and now?", session="doomed")
    assert where != victim and reply.choices[0].finish_reason in ("length", "stop")
    deadline = time.monotonic() + 10
    while folder.exists():
        assert time.monotonic() < deadline, f"{folder} outlived its engine"
        time.sleep(0.1)
    fleet.wait_replicas(2, timeout=240, without=victim)
