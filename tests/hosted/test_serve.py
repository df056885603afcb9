"""Hosted inferlets against a real ``pie-ctx serve --inferlets DIR`` subprocess: ``pie-ctx
launch`` over the socket, ``POST /v1/pie/inferlets/{name}`` over HTTP (with the API key
rules), the store across a SIGKILL, and a CPU-bound inferlet beside another client's
generation."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import anyio
import httpx
import pytest

from pie_ctx import Context, Runtime, Sampler
from tests.hosted.harness import INFERLETS
from tests.server.helpers import REPO, ServeProcess, serve_env


def _serve(tmp_path, *args: str) -> tuple[ServeProcess, str]:
    sock = str(tmp_path / "s.sock")
    (tmp_path / "snaps").mkdir(exist_ok=True)
    server = ServeProcess(tmp_path, "--socket", sock, "--inferlets", str(INFERLETS),
                          "--snapshot-dir", str(tmp_path / "snaps"), *args)
    if "--http" in args:
        server.url = server.wait_for(r"serving HTTP on (\S+)").group(1)
    server.wait_for(r"inferlets: \d+ in")
    return server, f"unix:{sock}"


def _launch(tmp_path, address: str, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "runtime", "launch", *argv[:1],
                           "--connect", address, *argv[1:]], capture_output=True, text=True,
                          env=serve_env(tmp_path), cwd=REPO, timeout=120)


def test_launch_over_the_socket(tmp_path) -> None:
    server, address = _serve(tmp_path)
    try:
        done = _launch(tmp_path, address, "echo", "--", "a", "b")
        assert done.returncode == 0, done.stderr
        assert done.stdout == "a\nb\na b\n"
        done = _launch(tmp_path, address, "parent", "--", "x")
        assert done.stdout == "child: x\nparent got x\n"
        done = _launch(tmp_path, address, "boom")
        assert done.returncode == 1
        assert "InferletFailed" not in done.stdout and "ValueError: boom" in done.stderr
        done = _launch(tmp_path, address, "../etc/passwd")
        assert done.returncode == 1 and "is refused" in done.stderr
    finally:
        server.stop()


def test_a_hung_launch_ends_with_its_launcher(tmp_path) -> None:
    """``pie-ctx launch hang`` holds a context; killing the launcher cancels the launch and
    releases it, while another client goes on."""
    server, address = _serve(tmp_path)
    launcher = subprocess.Popen([sys.executable, "-m", "runtime", "launch", "hang",
                                 "--connect", address], stdout=subprocess.PIPE, text=True,
                                env=serve_env(tmp_path), cwd=REPO)

    async def contexts() -> int:
        async with Runtime.connect(address) as rt:
            return (await rt.stats()).num_contexts

    try:
        assert launcher.stdout.readline() == "holding\n"
        assert anyio.run(contexts) == 1
        launcher.kill()
        launcher.wait(10)
        end = time.monotonic() + 20
        while anyio.run(contexts) and time.monotonic() < end:
            time.sleep(0.1)
        assert anyio.run(contexts) == 0
        assert _launch(tmp_path, address, "echo", "--", "ok").stdout == "ok\nok\n"
    finally:
        launcher.kill()
        server.stop()


def test_run_with_an_inferlet_folder_spawns_in_process(tmp_path) -> None:
    from tests.model.loader_fixtures import hf_reference_weights, write_tiny_hf_folder

    model = write_tiny_hf_folder(tmp_path / "model", hf_reference_weights())
    done = subprocess.run([sys.executable, "-m", "runtime", "run", str(INFERLETS /
                           "parent.py"), "--model", str(model), "--num-pages", "64",
                           "--inferlets", str(INFERLETS), "--", "x"], capture_output=True,
                          text=True, env=serve_env(tmp_path), cwd=REPO, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "child: x\nparent got x\n"  # its session is our stdout


def test_launch_over_http_with_the_api_key(tmp_path) -> None:
    key_file = tmp_path / "key"
    server, address = _serve(tmp_path, "--http", "0", "--api-key-file", str(key_file))
    try:
        url = server.url
        key = key_file.read_text().strip()
        auth = {"Authorization": f"Bearer {key}"}
        with httpx.Client(base_url=url, timeout=60) as http:
            assert http.post("/v1/pie/inferlets/echo", json={"args": ["a"]}).status_code == 401
            r = http.post("/v1/pie/inferlets/echo", json={"args": ["a", "b"]}, headers=auth)
            assert r.status_code == 200, r.text
            assert r.json() == {"object": "pie.inferlet.result", "name": "echo",
                                "output": "a\nb\n", "result": "a b"}
            with http.stream("POST", "/v1/pie/inferlets/generate", headers=auth,
                             json={"args": ["Hi", "--tokens", "3"], "stream": True}) as r:
                events = [line.removeprefix("data: ") for line in r.iter_lines()
                          if line.startswith("data: ")]
            assert events[-1] == "[DONE]"
            texts = [json.loads(e)["text"] for e in events[:-2]]
            assert json.loads(events[-2])["result"] == "".join(texts)
            r = http.post("/v1/pie/inferlets/boom", headers=auth)
            assert r.status_code == 500 and r.json()["error"]["code"] == "inferlet_failed"
            r = http.post("/v1/pie/inferlets/..%2Fx", headers=auth)
            assert r.status_code == 404 and r.json()["error"]["code"] == "inferlet_not_found"
            r = http.post("/v1/pie/inferlets/echo", headers=auth, json={"args": "a"})
            assert r.status_code == 400 and "list of str" in r.json()["error"]["message"]
            r = http.post("/v1/pie/inferlets/generate", headers=auth,
                          json={"args": ["Hi", "--tokens", "many"]})
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["code"] == "invalid_inferlet_arguments"
            assert "usage:" in error["message"] and "--tokens" in error["message"]
    finally:
        server.stop()


def test_the_store_survives_sigkill(tmp_path) -> None:
    server, address = _serve(tmp_path)
    try:
        assert _launch(tmp_path, address, "store_counter", "--", "3").stdout == "3\n"
    finally:
        server.proc.kill()  # SIGKILL: no shutdown of any kind
        server.proc.wait(10)
    server, address = _serve(tmp_path)
    try:
        assert _launch(tmp_path, address, "store_counter", "--", "1").stdout == "4\n"

        async def other_namespace() -> object:
            async with Runtime.connect(address, namespace="team") as rt:
                return await rt.store.get("counter")

        assert anyio.run(other_namespace) is None  # namespaced like snapshots
    finally:
        server.stop()


def test_concurrent_sets_through_the_server(tmp_path) -> None:
    server, address = _serve(tmp_path)
    values = [str(i) * 1000 for i in range(8)]

    async def writers() -> object:
        async with anyio.create_task_group() as tg:
            for v in values:
                async def put(v: str = v) -> None:
                    async with Runtime.connect(address) as rt:
                        await rt.store.set("shared", v)
                tg.start_soon(put)
        async with Runtime.connect(address) as rt:
            return await rt.store.get("shared")

    try:
        assert anyio.run(writers) in values
    finally:
        server.proc.kill()
        server.proc.wait(10)
    server, address = _serve(tmp_path)

    async def read() -> object:
        async with Runtime.connect(address) as rt:
            return await rt.store.get("shared")

    try:
        assert anyio.run(read) in values  # whole after a SIGKILL too
    finally:
        server.stop()


def test_a_cpu_bound_inferlet_does_not_stall_other_clients(tmp_path) -> None:
    """A hosted inferlet that computes for 4 s without awaiting runs on its own thread: a
    socket client's generation beside it finishes long before it does."""
    server, address = _serve(tmp_path)

    async def generate(rt: Runtime) -> float:
        t0 = time.perf_counter()
        ctx = Context(rt).user("Count to ten.").cue()
        await ctx.generate(Sampler.greedy(), max_tokens=24, ignore_eos=True).text()
        return time.perf_counter() - t0

    async def scenario() -> tuple[float, float, bool]:
        async with Runtime.connect(address) as rt, Runtime.connect(address) as other:
            alone = min([await generate(other) for _ in range(3)])
            busy = await rt.spawn("busy", ["--seconds", "4"])
            async for _ in busy.output():  # it has started its loop
                break
            beside = await generate(other)
            still_busy = not busy.done
            assert int(await busy) > 0
            return alone, beside, still_busy

    try:
        alone, beside, still_busy = anyio.run(scenario)
        print(f"24 tokens alone {alone * 1e3:.0f} ms, beside a CPU-bound inferlet "
              f"{beside * 1e3:.0f} ms")
        assert still_busy and beside < 3.0, (alone, beside)
    finally:
        server.stop()


@pytest.mark.skipif(os.environ.get("CI_NO_SUBPROCESS") == "1", reason="no subprocesses")
def test_serve_refuses_a_missing_folder(tmp_path) -> None:
    done = subprocess.run([sys.executable, "-m", "runtime.server", "serve", "--inferlets",
                           str(tmp_path / "nope"), "--memory-snapshots"], capture_output=True,
                          text=True, env=serve_env(tmp_path), cwd=REPO, timeout=60)
    assert done.returncode == 2 and "not a folder" in done.stderr
