"""Programs vs prompts: three agent workloads as inferlets and as OpenAI clients, side by side.

    .venv/bin/python benchmarks/agents.py [--concurrency 1,8,32] [--weights gguf,int8,fp32]
        [--workloads react,codeact,swarm] [--systems a1,a2,a3,b,c,d,e]
        [--llama-server PATH] [--threads 2] [--repeats N] [--smoke] [--model M]

Workloads (fixed structure, benchmarks/agent_workloads.py): ReAct (an ~800-token system
prompt with two tools, 8 rounds of a ~48-token tool call, a 20 ms tool and a ~100-token
observation, then a 64-token answer), CodeAct (8 rounds of a 64-token code block run as a
real Python subprocess, then a 60-token summary) and Swarm (rings of 4 agents exchanging
32 messages of 32 tokens, each appended to the next agent's context).

Systems, each agent its own process, released together once all are ready:

* a1: plain inferlets on ``pie-ctx serve`` (benchmarks/agent_inferlet.py, over its socket);
* a2: the same inferlets with what only a program can do (prompt lookup, tools started
  the moment their call is complete);
* a3: the a2 inferlets hosted: launched inside ``pie-ctx serve --inferlets benchmarks``
  (``pie-ctx launch agent_inferlet``, one launcher process per agent that only prints what
  its agent sends), so their tokens never cross the socket (docs/inferlets.md);
* b:  an OpenAI client program against ``pie-ctx serve --http`` that re-sends the whole
  message list every round (benchmarks/agent_client.py);
* c:  the same client program against llama.cpp's ``llama-server`` on the same GGUF and
  thread count, ``-np`` = the concurrency (skipped without ``--llama-server``; building
  it: docs/agents.md);
* d:  ReAct and Swarm as clients of ``/v1/responses`` that send only their new items with
  ``previous_response_id`` (the server continues each agent's stored context);
* e:  ReAct with its tools as server-side MCP tools (``serve --mcp react=...``,
  benchmarks/agent_mcp.py): one ``/v1/responses`` request per agent.

Our server runs with ``--weights gguf`` by default: the default model's own Q4_1 blocks,
what ``pie-ctx serve`` picks for a GGUF on CPU and what llama-server computes on
(``--weights`` takes a comma list: gguf, int8, fp32). Each (workload, concurrency, system)
run gets a fresh session prefix in its prompts and warms it first, so no run reuses
another's pages. Swarm runs at 4, 8 and 32 agents (a ring needs 4) where the others run
at 1, 8 and 32.

Reports per run: per-agent latency p50/p99, agents per minute, generated tokens/s,
prompt tokens sent and computed; the last line is one JSON object with the ratios at 8
agents (``*_tput_vs_llamaserver``, ``react_p50_vs_llamaserver``, ``*_tput_vs_http``,
``react_plain_tput_vs_http``, ``tool_call_steps_per_token``, ``react_hosted_tput_vs_http``,
``react_hosted_tput_vs_socket``: a3 against b and a2, ``react_responses_tput_vs_http``,
``react_responses_tput_vs_program``: d against b and a2, ``react_mcp_tput_vs_program``: e
against a2, ``responses_prompt_tokens_sent_per_round``: prompt tokens a d client sends per
ReAct request after its first) and the raw figures, and
``socket_hop_us_per_token``: one greedy generation read token by token, best of 5, over the
socket minus hosted, per token (the hop measured directly, on the first server), and
``decode_p99_itl_under_prefill_vs_idle``: a streamed generation's p99 time between tokens
while an 8,000-token prompt is prefilled beside it, over the same alone (on the first
server; with ``decode_p99_itl_idle_ms``, ``decode_p99_itl_under_prefill_ms`` and the long
prompt's own ``long_prompt_beside_decode_s``; ``--decode-share S`` sets serve's).

``--pool-fraction F`` runs the many-agents regime (docs/agents.md): each ReAct or Swarm
run of our a2 programs runs twice, first on a server whose pool holds everyone (its peak
of live pages is read from ``/metrics`` as it runs), then on a server whose page pool is F
of that peak, where idle agents' contexts are suspended to the disk tier and come back
without recompute (docs/pages.md, "Suspend and resume"). The JSON line then has, per
workload and concurrency N (``react64_...``): ``tput_vs_unlimited_pool``,
``recomputed_suspended_tokens`` (tokens the small pool computed beyond the unlimited run's:
any recompute, preemption's included), ``tput_vs_llamaserver``, the pools' pages, the
peak, the suspends and resumes, the pages back from disk, and each server's resident
memory (ours and llama-server's, read from /proc as they run).

``--repeats N`` runs all of it N times in rounds (our servers, then llama-server's, then
the next round), so that a slow minute on a shared machine falls on one round and not on
one system: each figure of the JSON line is then the median of the rounds' (``rounds``
lists each round's figures; ``runs`` every run, with its ``round``). Back-to-back runs of
the same code spread ~±10% on a 2-core VM, on both sides (docs/performance.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import agent_workloads as W
import numpy as np
from common import emit, table

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
READY = re.compile(r"serving HTTP on (http://\S+)")
NUM_PAGES = 8192  # ~6 GB of fp32 KV for SmolLM2: 32 ReAct agents need ~3.2 GB


@dataclass
class Run:
    """One (weights, workload, concurrency, system) run."""

    weights: str
    workload: str
    agents: int
    system: str
    wall: float = 0.0
    results: list[dict[str, Any]] = field(default_factory=list)
    pool: str = ""  # with --pool-fraction: "unlimited" or "fraction" (our side)
    server: dict[str, Any] = field(default_factory=dict)  # its server's figures (ServerWatch)

    def latencies(self) -> list[float]:
        return sorted(r["latency"] for r in self.results)

    @property
    def p50(self) -> float:
        return statistics.median(self.latencies())

    @property
    def p99(self) -> float:
        lat = self.latencies()
        return lat[min(len(lat) - 1, round(0.99 * (len(lat) - 1)))]

    @property
    def agents_per_min(self) -> float:
        return 60 * len(self.results) / self.wall

    def total(self, key: str) -> int:
        return sum(r.get(key, 0) for r in self.results)

    @property
    def tokens_per_s(self) -> float:
        return self.total("generated") / self.wall

    def row(self) -> dict[str, Any]:
        return {"weights": self.weights, "workload": self.workload, "agents": self.agents,
                "system": self.system, "wall_s": self.wall, "p50_s": self.p50,
                "p99_s": self.p99, "agents_per_min": self.agents_per_min,
                "gen_tok_per_s": self.tokens_per_s, "generated": self.total("generated"),
                "prompt_sent": self.total("prompt_sent"),
                "prompt_computed": self.total("prompt_computed"),
                "call_tokens": self.total("call_tokens"), "call_steps": self.total("call_steps"),
                **({"pool": self.pool} if self.pool else {}), **self.server}


# ------------------------------------------------------------------------------ servers


class PieServer:
    """``pie-ctx serve`` with a socket and the HTTP API, in a subprocess."""

    def __init__(self, weights: str, model: str | None, tmp: str, smoke: bool = False,
                 num_pages: int = NUM_PAGES, snapshot_dir: str | None = None,
                 extra: tuple[str, ...] = ()) -> None:
        """``snapshot_dir``: snapshots and the disk tier of evicted cache pages there (as
        ``serve`` keeps them by default); None: ``--memory-snapshots``, no disk tier."""
        self.socket = os.path.join(tmp, f"engine-{weights}.sock")
        tools = f"{sys.executable} {HERE / 'agent_mcp.py'}" + (" --smoke" if smoke else "")
        snapshots = ["--memory-snapshots"] if snapshot_dir is None else [
            "--snapshot-dir", snapshot_dir]
        cmd = [sys.executable, "-m", "runtime.server", "serve", "--socket", self.socket,
               "--http", "127.0.0.1:0", *snapshots, "--weights", weights,
               "--client-share", "1", "--inferlets", str(HERE), "--mcp", f"react={tools}",
               "--no-access-log"]  # stderr is read only until the server is ready
        cmd += extra
        if num_pages:  # (0: serve's default pool)
            cmd += ["--num-pages", str(num_pages)]
        if model:
            cmd += ["--model", model]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stderr=subprocess.PIPE, text=True)
        for line in self.proc.stderr:  # type: ignore[union-attr]
            m = READY.search(line)
            if m:
                self.url = m.group(1) + "/v1"
                break
        else:
            raise RuntimeError(f"pie-ctx serve --weights {weights} did not start")
        # keep reading stderr so the server never blocks on a full pipe
        self._drain = asyncio.get_event_loop().run_in_executor(None, self._read_rest)

    def _read_rest(self) -> None:
        for _ in self.proc.stderr:  # type: ignore[union-attr]
            pass

    def stop(self) -> None:
        _stop(self.proc, 60)


class LlamaServer:
    """llama.cpp's ``llama-server`` on the same GGUF, ``-np`` slots, in a subprocess."""

    def __init__(self, binary: str, gguf: str, slots: int, threads: int, log: str,
                 slot_tokens: int = 4096) -> None:
        port = _free_port()
        self.url = f"http://127.0.0.1:{port}/v1"
        ctx = slot_tokens * slots  # every slot holds a whole agent (ReAct: ~2.3k tokens)
        self.proc = subprocess.Popen(
            [binary, "-m", gguf, "--host", "127.0.0.1", "--port", str(port),
             "-np", str(slots), "-c", str(ctx), "-t", str(threads), "-tb", str(threads),
             "--jinja", "--cache-prompt", "-fa", "off", "--no-webui"],
            stdout=subprocess.DEVNULL, stderr=open(log, "w"))  # noqa: SIM115
        deadline = time.time() + 120
        import urllib.request

        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.proc.returncode}")
            try:
                with urllib.request.urlopen(self.url[:-3] + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.5)
        raise RuntimeError("llama-server did not become healthy in 120 s")

    def stop(self) -> None:
        _stop(self.proc, 30)


def _stop(proc: subprocess.Popen, timeout: float) -> None:
    """Terminate a server, and kill it if it has not exited within ``timeout`` seconds."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rss_bytes(pid: int) -> int:
    """A process's resident memory now (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


_METRICS = {"pages_used": 'pie_ctx_pages{state="used"}', "tokens_computed":
            "pie_ctx_tokens_computed_total", "auto_suspends": 'pie_ctx_suspends_total{how="pressure"}',
            "resumes": "pie_ctx_resumes_total", "pages_resumed_from_disk":
            'pie_ctx_pages_resumed_total{source="disk"}', "pages_resumed_from_memory":
            'pie_ctx_pages_resumed_total{source="memory"}', "pool_pages": "pie_ctx_pages_total"}


def _read_metrics(base: str) -> dict[str, float]:
    """The series of ``_METRICS`` from a pie-ctx server's ``/metrics`` (base: its URL)."""
    import urllib.request

    with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
        text = r.read().decode()
    values = {}
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        values[name] = value
    return {key: float(values.get(series, "nan")) for key, series in _METRICS.items()}


class ServerWatch:
    """A server's figures over one run: peak resident memory (from /proc, both kinds of
    server) and, for ours, the peak of live pages and the counters' increase (/metrics)."""

    def __init__(self, pid: int, metrics_base: str | None) -> None:
        self.pid, self.base = pid, metrics_base
        self.peak_rss = _rss_bytes(pid)
        self.peak_pages = 0.0
        self.before = None if metrics_base is None else _read_metrics(metrics_base)
        self._stop = asyncio.Event()
        self._task = asyncio.create_task(self._poll())

    async def _poll(self) -> None:
        while not self._stop.is_set():
            self.peak_rss = max(self.peak_rss, _rss_bytes(self.pid))
            if self.base is not None:
                now = await asyncio.to_thread(_read_metrics, self.base)
                self.peak_pages = max(self.peak_pages, now["pages_used"])
            try:
                await asyncio.wait_for(self._stop.wait(), 0.25)
            except TimeoutError:
                pass

    async def finish(self) -> dict[str, Any]:
        self._stop.set()
        await self._task
        out: dict[str, Any] = {"server_peak_rss_gb": self.peak_rss / 2**30}
        if self.base is not None and self.before is not None:
            after = _read_metrics(self.base)
            out.update({"peak_pages_used": int(self.peak_pages),
                        "pool_pages": int(after["pool_pages"])})
            for key in ("tokens_computed", "auto_suspends", "resumes",
                        "pages_resumed_from_disk", "pages_resumed_from_memory"):
                out[key] = int(after[key] - self.before[key])
        return out


# ------------------------------------------------------------------------------- agents


def _agent_commands(run: Run, target: str, session: str, smoke: bool, tools_as: str,
                    first: int = 0) -> list[list[str]]:
    """One command per agent process (Swarm clients: one per ring), agents ``first`` on."""
    extra = ["--smoke"] if smoke else []
    ring = (W.SMOKE if smoke else W.Shape()).ring
    if run.system in ("a1", "a2"):
        pie = [sys.executable, "-m", "runtime", "run", str(HERE / "agent_inferlet.py"),
               "--connect", target, "--"]
        return [pie + ["--workload", run.workload, "--agent", str(first + i), "--mode",
                       run.system, "--run", session] + extra for i in range(run.agents)]
    if run.system == "a3":
        pie = [sys.executable, "-m", "runtime", "launch", "agent_inferlet", "--connect",
               target, "--"]
        return [pie + ["--workload", run.workload, "--agent", str(first + i), "--mode", "a2",
                       "--run", session, "--hosted", "--session", session] + extra
                for i in range(run.agents)]
    count = run.agents // ring if run.workload == "swarm" else run.agents
    first = first // ring if run.workload == "swarm" else first
    api = {"d": "responses", "e": "mcp"}.get(run.system, "chat")
    return [[sys.executable, str(HERE / "agent_client.py"), "--url", target, "--workload",
             run.workload, "--agent", str(first + i), "--tools-as", tools_as, "--api", api]
            + extra for i in range(count)]


async def _spawn(cmd: list[str], env: dict[str, str]) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        *cmd, cwd=ROOT, env=env, stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)


async def _until(proc: asyncio.subprocess.Process, prefix: str) -> str:
    """The first line of stdout that starts with ``prefix``."""
    while True:
        raw = await proc.stdout.readline()  # type: ignore[union-attr]
        if not raw:
            err = (await proc.stderr.read()).decode()[-3000:]  # type: ignore[union-attr]
            raise RuntimeError(f"an agent exited before {prefix!r}: {err}")
        line = raw.decode().rstrip("\n")
        if line.startswith(prefix):
            return line


async def run_agents(run: Run, target: str, session: str, *, smoke: bool, tools_as: str,
                     first: int = 0, http: str | None = None) -> None:
    """Start every agent, release them together once all are ready, collect results
    (hosted agents, a3, are released by one broadcast through ``http``, the server's API)."""
    env = dict(os.environ, AGENT_SESSION=session, PYTHONPATH=str(ROOT))
    cmds = _agent_commands(run, target, session, smoke, tools_as, first)
    procs = [await _spawn(cmd, env) for cmd in cmds]
    per_process = run.agents // len(procs)  # Swarm clients: a ring each
    try:
        await asyncio.gather(*(_until(p, "READY") for p in procs))
        t0 = time.perf_counter()
        if run.system == "a3":
            await asyncio.to_thread(_release_hosted, http, session, len(procs))
        else:
            for p in procs:
                p.stdin.write(b"go\n")  # type: ignore[union-attr]
            await asyncio.gather(*(p.stdin.drain() for p in procs))  # type: ignore[union-attr]

        async def results(p: asyncio.subprocess.Process) -> list[dict[str, Any]]:
            return [json.loads((await _until(p, "RESULT "))[len("RESULT "):])
                    for _ in range(per_process)]

        for found in await asyncio.gather(*(results(p) for p in procs)):
            run.results.extend(found)
        run.wall = time.perf_counter() - t0
        await asyncio.gather(*(p.wait() for p in procs))
    finally:
        for p in procs:
            if p.returncode is None:
                p.kill()


def _release_hosted(http: str | None, session: str, expected: int) -> None:
    """Broadcast ``go`` to the hosted agents of ``session`` (each subscribed before READY)."""
    import httpx

    if http is None:
        raise RuntimeError("hosted agents need the server's HTTP API to be released")
    reply = httpx.post(f"{http}/pie/topics/go-{session}", content="go", timeout=30)
    reply.raise_for_status()
    if reply.json()["subscribers"] != expected:
        raise RuntimeError(f"{reply.json()['subscribers']} hosted agents heard go, "
                           f"not {expected}")


async def socket_hop_us(server: PieServer, smoke: bool) -> float:
    """The socket hop per token: the hop probe over the socket minus hosted (best of 5
    each, in separate processes like the agents)."""
    extra = ["--smoke"] if smoke else []
    probe = ["--", "--workload", "hop", "--agent", "0", "--no-wait", *extra]
    socket_cmd = [sys.executable, "-m", "runtime", "run", str(HERE / "agent_inferlet.py"),
                  "--connect", f"unix:{server.socket}", *probe]
    hosted_cmd = [sys.executable, "-m", "runtime", "launch", "agent_inferlet",
                  "--connect", f"unix:{server.socket}", *probe]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    best: dict[str, dict[str, Any]] = {}
    for name, cmd in (("socket", socket_cmd), ("hosted", hosted_cmd)) * 2:
        proc = await _spawn(cmd, env)
        found = json.loads((await _until(proc, "RESULT "))[len("RESULT "):])
        await proc.wait()
        if name not in best or found["latency"] < best[name]["latency"]:
            best[name] = found
    tokens = best["socket"]["generated"]
    hop = (best["socket"]["latency"] - best["hosted"]["latency"]) / tokens * 1e6
    print(f"socket hop: {tokens} tokens in {best['socket']['latency'] * 1e3:.1f} ms over the "
          f"socket, {best['hosted']['latency'] * 1e3:.1f} ms hosted: {hop:.0f} us per token",
          flush=True)
    return hop


async def itl_under_prefill(server: PieServer, smoke: bool) -> dict[str, float]:
    """A greedy generation's p99 time between tokens while a long prompt (8,000 tokens) is
    prefilled beside it, against the same generation alone: each a streamed
    ``/v1/completions`` read chunk by chunk with the official client, random token ids (no
    cache hits). The long prompt starts after the generation's 16th token; the gaps counted
    are those its run overlaps. Also its own latency (what the decodes' share costs it)."""
    from openai import AsyncOpenAI

    rng = np.random.default_rng(7)
    client = AsyncOpenAI(base_url=server.url, api_key="none", max_retries=0)
    low, high = (20, 200) if smoke else (1000, 30000)  # clear of either end's special ids
    long_len, idle_tokens = (160, 24) if smoke else (8000, 200)
    model = (await client.models.list()).data[0].id

    def prompt(n: int) -> list[int]:
        return rng.integers(low, high, n).tolist()

    async def gaps(max_tokens: int, beside: int | None) -> tuple[list[float], float]:
        stream = await client.completions.create(
            model=model, prompt=prompt(16), max_tokens=max_tokens, temperature=0,
            stream=True, extra_body={"ignore_eos": True})
        times: list[float] = []
        window = [0.0, float("inf")]
        task: asyncio.Task | None = None
        async for _chunk in stream:
            times.append(time.perf_counter())
            if beside is not None and len(times) == 16:
                window[0] = times[-1]
                task = asyncio.create_task(client.completions.create(
                    model=model, prompt=prompt(beside), max_tokens=1, temperature=0))
            if task is not None and task.done():
                window[1] = time.perf_counter()
                break
        await stream.close()
        if task is not None:
            await task
            window[1] = min(window[1], time.perf_counter())
        between = [b - a for a, b in zip(times, times[1:], strict=False)
                   if b > window[0] and a < window[1]]  # the gaps the prompt overlaps
        return between, window[1] - window[0]

    idle, _ = await gaps(idle_tokens, None)
    loaded, long_s = await gaps(4 * idle_tokens if smoke else 4000, long_len)
    idle_p99, loaded_p99 = (float(np.percentile(x, 99)) for x in (idle, loaded))
    print(f"decode beside an {long_len}-token prompt: p99 between tokens "
          f"{loaded_p99 * 1e3:.1f} ms over {len(loaded)} gaps, alone {idle_p99 * 1e3:.1f} ms; "
          f"the prompt took {long_s:.2f} s", flush=True)
    return {"decode_p99_itl_under_prefill_vs_idle": loaded_p99 / idle_p99,
            "decode_p99_itl_idle_ms": idle_p99 * 1e3,
            "decode_p99_itl_under_prefill_ms": loaded_p99 * 1e3,
            "long_prompt_beside_decode_s": long_s}


async def measure(weights: str, workload: str, agents: int, system: str, target: str,
                  args: argparse.Namespace, tools_as: str = "tools",
                  http: str | None = None, watch: tuple[int, str | None] | None = None,
                  pool: str = "") -> Run:
    """One run, after a warm-up with the same session (so its system prompt is in every
    cache: once in ours, in every slot of llama-server) but other agents (so nothing
    else of the timed agents is). ``watch``: the server's pid and metrics URL (None for
    llama-server's), to record its figures over the timed run (``ServerWatch``)."""
    session = secrets.token_hex(4)
    slots = agents if system == "c" else min(agents, 8)
    if not args.smoke:  # (the smoke measures nothing)
        await run_agents(Run(weights, workload, slots, system), target, session, smoke=True,
                         tools_as=tools_as, first=WARM_AGENTS, http=http)
    run = Run(weights, workload, agents, system, pool=pool)
    watcher = None if watch is None else ServerWatch(*watch)
    await run_agents(run, target, session, smoke=args.smoke, tools_as=tools_as, http=http)
    if watcher is not None:
        run.server = await watcher.finish()
    _print_run(run)
    return run


def _one_agent_pages(run: Run) -> int:
    """The pages the largest agent of a run holds at its end (serve's pages of 16 tokens),
    plus a few for its next step: the least a pool must hold to run it at all."""
    return max(math.ceil((r["prompt_sent"] + r["generated"]) / 16) for r in run.results) + 4


def _base(url: str) -> str:
    return url.removesuffix("/v1")


async def pool_pair(weights: str, workload: str, agents: int, model: str | None, tmp: str,
                    args: argparse.Namespace, extra: tuple[str, ...]) -> list[Run]:
    """Our a2 programs twice: on a pool that holds everyone (its peak of live pages
    measured), then on a pool of ``--pool-fraction`` of that peak, a server each."""
    runs = []
    big = max(NUM_PAGES, NUM_PAGES * agents // 32)
    for pool in ("unlimited", "fraction"):
        pages = big if pool == "unlimited" else max(
            _one_agent_pages(runs[0]),
            math.ceil(args.pool_fraction * runs[0].server["peak_pages_used"]))
        folder = tempfile.mkdtemp(prefix=f"pool-{pool}-", dir=tmp)
        server = PieServer(weights, model, tmp, args.smoke, num_pages=pages,
                           snapshot_dir=folder, extra=extra)
        try:
            runs.append(await measure(
                weights, workload, agents, "a2", f"unix:{server.socket}", args,
                http=server.url, watch=(server.proc.pid, _base(server.url)), pool=pool))
        finally:
            server.stop()
    return runs


WARM_AGENTS = 10_000  # warm-up agents are numbered from here (other questions, seeds)
# d is ReAct and Swarm (the agents a framework writes); e is ReAct (its tools on the server)
SKIPPED = {("codeact", "d"), ("codeact", "e"), ("swarm", "e")}


# --------------------------------------------------------------------------------- main


def _levels(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


async def amain(args: argparse.Namespace) -> tuple[list[Run], dict[str, Any]]:
    # SIGTERM or SIGHUP (a timeout, a closed terminal) cancels the run, so the finally
    # blocks below stop the servers and run_agents kills the agents: none outlives it
    main_task = asyncio.current_task()
    for sig in (signal.SIGTERM, signal.SIGHUP):
        asyncio.get_running_loop().add_signal_handler(sig, main_task.cancel)  # type: ignore[union-attr]
    runs: list[Run] = []
    probes: dict[str, Any] = {}  # measured once, on the first server
    ring = (W.SMOKE if args.smoke else W.Shape()).ring
    systems = [s for s in args.systems.split(",") if s]
    workloads = [w for w in args.workloads.split(",") if w]
    llama = args.llama_server and shutil.which(args.llama_server) or (
        args.llama_server if args.llama_server and os.access(args.llama_server, os.X_OK)
        else None)
    if "c" in systems and not llama:
        print("# llama-server: not given or not executable (--llama-server PATH); "
              "skipping column c (docs/agents.md says how to build it)")
        systems.remove("c")
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if args.smoke and model is None:  # the tiny test model: seconds, not minutes
            from tests.sdk.harness import tiny_model_folder

            model = str(tiny_model_folder(Path(tmp)))
        for weights in args.weights.split(","):
            extra = () if args.decode_share is None else ("--decode-share",
                                                          str(args.decode_share))
            server = PieServer(weights, model, tmp, args.smoke, extra=extra)
            try:
                if not probes:
                    probes["socket_hop_us_per_token"] = await socket_hop_us(server, args.smoke)
                    probes.update(await itl_under_prefill(server, args.smoke))
                for workload in workloads:
                    for level in _levels(args.concurrency):
                        agents = max(ring, level - level % ring) if workload == "swarm" \
                            else level
                        for system in [s for s in systems if s != "c"
                                       and (workload, s) not in SKIPPED]:
                            target = f"unix:{server.socket}" \
                                if system in ("a1", "a2", "a3") else server.url
                            runs.append(await measure(weights, workload, agents, system,
                                                      target, args, http=server.url))
            finally:
                server.stop()
            if args.pool_fraction is not None:
                for workload in [w for w in workloads if w in ("react", "swarm")]:
                    for level in _levels(args.concurrency):
                        agents = max(ring, level - level % ring) if workload == "swarm" \
                            else level
                        runs += await pool_pair(weights, workload, agents, model, tmp, args,
                                                extra)
        if "c" in systems:
            gguf = args.gguf or _default_gguf()
            for workload in workloads:
                for level in _levels(args.concurrency):
                    agents = max(ring, level - level % ring) if workload == "swarm" else level
                    log = os.path.join(tmp, "llama-server.log")
                    if args.keep_logs:
                        log = os.path.join(args.keep_logs, f"llama-server-{workload}-{agents}.log")
                    server = LlamaServer(llama, gguf, agents, args.threads, log)
                    try:
                        runs.append(await measure("q4_1", workload, agents, "c", server.url,
                                                  args, args.llama_tools,
                                                  watch=(server.proc.pid, None)))
                    finally:
                        server.stop()
    return runs, probes


def _default_gguf() -> str:
    from runtime.model.loader.default import fetch_default_gguf

    return str(fetch_default_gguf(progress=False))


def _print_run(run: Run) -> None:
    r = run.row()
    print(f"{run.weights:5} {run.workload:8} {run.agents:3} agents  {run.system:3}  "
          f"wall {r['wall_s']:7.2f} s  p50 {r['p50_s']:7.2f} s  p99 {r['p99_s']:7.2f} s  "
          f"{r['agents_per_min']:7.2f} agents/min  {r['gen_tok_per_s']:7.1f} tok/s  "
          f"prompt computed/sent {r['prompt_computed']}/{r['prompt_sent']}", flush=True)


def summarize(runs: list[Run], at: int = 8, probes: dict[str, Any] | None = None
              ) -> dict[str, Any]:
    """The ratios at ``at`` agents (our side on gguf when it ran, else int8), the probes
    (the socket hop per token, decode beside a long prompt), and every run's raw figures."""
    def find(workload: str, system: str) -> Run | None:
        found = [r for r in runs if r.workload == workload and r.system == system and
                 r.agents == at and not r.pool]
        # our side on the file's own blocks (llama.cpp's Q4_1), then int8, else what ran
        found.sort(key=lambda r: {"gguf": 0, "int8": 1}.get(r.weights, 2))
        return found[0] if found else None

    def ratio(workload: str, a: str, b: str, what: str = "tput") -> float | None:
        x, y = find(workload, a), find(workload, b)
        if x is None or y is None:
            return None
        return x.agents_per_min / y.agents_per_min if what == "tput" else x.p50 / y.p50

    a2, d = find("react", "a2"), find("react", "d")
    out: dict[str, Any] = {
        "react_tput_vs_llamaserver": ratio("react", "a2", "c"),
        "codeact_tput_vs_llamaserver": ratio("codeact", "a2", "c"),
        "swarm_tput_vs_llamaserver": ratio("swarm", "a2", "c"),
        "react_p50_vs_llamaserver": ratio("react", "a2", "c", "p50"),
        "react_tput_vs_http": ratio("react", "a2", "b"),
        "swarm_tput_vs_http": ratio("swarm", "a2", "b"),
        "react_plain_tput_vs_http": ratio("react", "a1", "b"),
        "react_hosted_tput_vs_http": ratio("react", "a3", "b"),
        "react_hosted_tput_vs_socket": ratio("react", "a3", "a2"),
        "react_responses_tput_vs_http": ratio("react", "d", "b"),
        "react_responses_tput_vs_program": ratio("react", "d", "a2"),
        "react_mcp_tput_vs_program": ratio("react", "e", "a2"),
        # a round is a request after an agent's first (its tool's output, or the question
        # for the answer): what a d client sends once the conversation is stored
        "responses_prompt_tokens_sent_per_round":
            d.total("followup_sent") / (d.total("requests") - d.agents)
            if d is not None and d.total("requests") > d.agents else None,
        **(probes or {}),
        "tool_call_steps_per_token": (a2.total("call_steps") / a2.total("call_tokens"))
        if a2 is not None and a2.total("call_tokens") else None,
        **pool_figures(runs),
        "agents": at,
        "runs": [r.row() for r in runs],
    }
    return out


def pool_figures(runs: list[Run]) -> dict[str, Any]:
    """``--pool-fraction``'s keys, per workload and concurrency (``react64_...``)."""
    out: dict[str, Any] = {}
    for small in [r for r in runs if r.pool == "fraction"]:
        key = f"{small.workload}{small.agents}_"
        big = next(r for r in runs if r.pool == "unlimited" and r.workload == small.workload
                   and r.agents == small.agents and r.weights == small.weights)
        llama = next((r for r in runs if r.system == "c" and r.workload == small.workload
                      and r.agents == small.agents), None)
        s, b = small.server, big.server
        out.update({
            key + "tput_vs_unlimited_pool": small.agents_per_min / big.agents_per_min,
            key + "recomputed_suspended_tokens": max(0, s["tokens_computed"]
                                                     - b["tokens_computed"]),
            key + "tput_vs_llamaserver": None if llama is None
            else small.agents_per_min / llama.agents_per_min,
            key + "pool_pages": s["pool_pages"], key + "peak_pages_unlimited":
            b["peak_pages_used"], key + "auto_suspends": s["auto_suspends"],
            key + "resumes": s["resumes"],
            key + "pages_resumed_from_disk": s["pages_resumed_from_disk"],
            key + "pages_resumed_from_memory": s["pages_resumed_from_memory"],
            key + "rss_gb": s["server_peak_rss_gb"],
            key + "rss_gb_unlimited_pool": b["server_peak_rss_gb"],
            key + "llamaserver_rss_gb": None if llama is None
            else llama.server["server_peak_rss_gb"],
        })
    return out


def median_of_rounds(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One round's summary as it is; several: each figure the median of the rounds' (None
    where no round has it), each round's figures under ``rounds``, every run (marked with
    its round) under ``runs``."""
    if len(rounds) == 1:
        return rounds[0]
    out: dict[str, Any] = {}
    for key in rounds[0]:
        if key in ("agents", "runs"):
            continue
        values = [r[key] for r in rounds if r[key] is not None]
        out[key] = statistics.median(values) if values else None
    out["agents"] = rounds[0]["agents"]
    out["rounds"] = [{k: v for k, v in r.items() if k != "runs"} for r in rounds]
    out["runs"] = [dict(run, round=i) for i, r in enumerate(rounds) for run in r["runs"]]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--weights", default="gguf")
    ap.add_argument("--workloads", default="react,codeact,swarm")
    ap.add_argument("--systems", default="a1,a2,a3,b,c,d,e")
    ap.add_argument("--llama-server", default=None, help="path of llama.cpp's llama-server")
    ap.add_argument("--llama-tools", choices=("grammar", "schema", "tools"),
                    default="grammar",
                    help="how the llama-server client asks for a call: its GBNF grammar "
                         "(default), response_format, or tools= (docs/agents.md)")
    ap.add_argument("--gguf", default=None, help="GGUF for llama-server (default: ours)")
    ap.add_argument("--keep-logs", default=None, metavar="DIR",
                    help="write llama-server's logs there")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--model", default=None, help="pie-ctx's model (default: the default)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="rounds of every run, the systems in turn; each figure is the "
                         "median of the rounds'")
    ap.add_argument("--pool-fraction", type=float, default=None, metavar="F",
                    help="also run ReAct and Swarm (a2) on a pool of F times the agents' "
                         "peak of live pages, beside a pool that holds everyone")
    ap.add_argument("--decode-share", type=float, default=None,
                    help="our servers' --decode-share (default: serve's)")
    ap.add_argument("--smoke", action="store_true",
                    help="a few rounds, small shapes, fp32, 1-2 agents, no warm-up, no "
                         "llama-server, and the tiny test model unless --model is given")
    args = ap.parse_args()
    if args.smoke:
        args.concurrency, args.weights = "2", "fp32"
        args.systems = ",".join(s for s in args.systems.split(",") if s != "c")
    if args.pool_fraction is not None and not 0 < args.pool_fraction <= 1:
        ap.error(f"--pool-fraction must be in (0, 1], got {args.pool_fraction}")
    if args.smoke and args.pool_fraction is None:
        args.pool_fraction = 0.5
    if args.repeats < 1:
        ap.error(f"--repeats must be at least 1, got {args.repeats}")
    rounds = []
    for i in range(args.repeats):
        if args.repeats > 1:
            print(f"# round {i + 1} of {args.repeats}", flush=True)
        try:
            runs, probes = asyncio.run(amain(args))
        except asyncio.CancelledError:
            print("# stopped by a signal; its servers and agents were stopped", file=sys.stderr)
            sys.exit(143)
        rounds.append(summarize(runs, at=8 if not args.smoke else 2, probes=probes))
    table([("runs", str(sum(len(r["runs"]) for r in rounds))), ("rounds", str(len(rounds)))])
    emit(median_of_rounds(rounds))


if __name__ == "__main__":
    main()
