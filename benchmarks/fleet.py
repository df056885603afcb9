"""What the fleet's routing decides: prompt tokens computed, router latency, failover.

    python benchmarks/fleet.py [--conversations 16] [--turns 6] [--model REF] [--smoke]

On 2 CPU cores a second replica adds no throughput, so this measures what routing
decides, on a local Ray instance with 2 engine replicas (``runtime.fleet``):

1. **Computed prompt tokens.** ``--conversations`` multi-turn chats (each turn re-sends
   the whole history, as a stateless chat client does) are played three ways, each with
   its own prompts so no way reuses another's pages: through the fleet's front with a
   session header per conversation (session routing), round-robin over the two replicas
   directly (turn t of conversation c to replica (c + t) mod 2: each conversation's turns
   alternate, as they do under a router that knows nothing of sessions), and all on one
   replica (one engine alone). Tokens computed = ``prompt_tokens - cached_tokens`` of
   every reply. A fourth way, the front without a session header, shows prefix routing
   (the replicas' KV events) alone. ``fleet_computed_vs_round_robin`` (goal <= 0.5) and
   ``fleet_computed_vs_single`` (goal <= 1.05).
2. **Router latency.** The time ``FleetRouter.choose_replicas`` takes per call
   (``fleet_router_ms_p50``, goal <= 2, and ``_p99``), from the front's ``/fleet/stats``;
   also the front's own reading of a request (JSON, prompt tokens: ``fleet_front_ms_p50``)
   and a whole hop through Ray Serve against calling the replica directly
   (``fleet_hop_ms_p50``).
3. **Failover.** Responses conversations (stored: a snapshot per response in the shared
   folder); the replica holding the first is killed (SIGKILL); ``fleet_failover_s`` is the
   time from the kill until that conversation's next turn is answered (by the other
   replica), and ``fleet_failover_recomputed_saved_tokens`` the tokens of its saved context
   that were computed again (goal 0: every page comes from the folder).

4. **Start-up and replacement**, beside one ``pie-ctx serve`` in the same run:
   ``serve_start_s`` (one ``serve`` of the same engine options, from its start until it
   answers a 1-token request; ``serve_ready_s``: until it says it serves HTTP),
   ``fleet_start_s`` (as ``pie-ctx fleet`` starts: the engines first (``boot_early``),
   then ``ray.init`` while they boot, until every replica answers one), with its parts,
   each from the start: ``fleet_ray_init_s`` (the local Ray instance),
   ``fleet_replicas_up_s`` (the last replica's actor running its constructor: Serve's
   controller, proxy and the replicas' worker processes), ``fleet_engines_ready_s`` (the
   last engine serving), ``fleet_deployed_s`` (Serve says the app runs),
   ``fleet_listed_s`` (the front lists every replica) and ``fleet_start_s`` (each
   replica's first answer); ``fleet_adopted`` counts the replicas that adopted an early
   engine. ``fleet_start_vs_serve`` (goal <= 1.5), and ``fleet_replace_s``: an engine killed
   (SIGKILL) until its replacement answers (goal <= 10 s on a quiet machine).
   ``fleet_temp_folders_left`` counts the replicas' temporary folders left after the
   fleet stopped (goal 0); the benchmark's own folder is removed too.

The last line is a JSON object with these keys. Without Ray (``pip install
'pie-ctx[ray]'``) it prints ``{"skipped": ...}``.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import emit, parse_args, table

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _quantile(values: list[float], q: float) -> float:
    data = sorted(values)
    return data[min(len(data) - 1, int(len(data) * q))]


class Play:
    """Plays conversations against some HTTP endpoints; counts prompt tokens."""

    def __init__(self, model: str, turns: int, max_tokens: int) -> None:
        self.model, self.turns, self.max_tokens = model, turns, max_tokens
        self.ways: dict[str, int] = {}

    def run(self, way: str, n: int, url_for, headers_for) -> dict[str, int]:
        import httpx

        prompt = computed = 0
        # Each way's prompts differ (no way reuses another's pages) by one digit, so every
        # way's prompts have the same number of tokens.
        run = self.ways.setdefault(way, len(self.ways))
        histories = [[{"role": "system", "content": f"[run {run} chat {c}] You are assistant "
                       f"number {c}; answer briefly and stay on topic. " * 2}]
                     for c in range(n)]
        with httpx.Client(timeout=600) as client:
            for turn in range(self.turns):
                for c in range(n):
                    h = histories[c]
                    h.append({"role": "user", "content": f"Question {turn} of chat {c}: what "
                                                         f"comes after {turn * 7 + c}?"})
                    r = client.post(url_for(c, turn) + "/v1/chat/completions",
                                    headers=headers_for(c), json={
                                        "model": self.model, "messages": h, "temperature": 0,
                                        "max_tokens": self.max_tokens})
                    r.raise_for_status()
                    body = r.json()
                    usage = body["usage"]
                    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                    prompt += usage["prompt_tokens"]
                    computed += usage["prompt_tokens"] - cached
                    h.append({"role": "assistant",
                              "content": body["choices"][0]["message"]["content"]})
        return {"prompt": prompt, "computed": computed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--model", default=None, help="model reference (default: the default)")
    parser.add_argument("--hops", type=int, default=50, help="calls timed for the hop")
    args = parse_args(parser, conversations=3, turns=3, max_tokens=3, hops=5)
    try:
        import httpx
        import ray
        import ray.serve  # noqa: F401
    except ImportError as e:
        emit({"skipped": f"needs Ray Serve (pip install 'pie-ctx[ray]'): {e}"})
        return
    sys.path.insert(0, str(ROOT))

    engine_args = ["--num-pages", "4096"] + (["--model", args.model] if args.model else [])
    folder = Path(tempfile.mkdtemp(prefix="pie-ctx-fleet-bench-"))
    # the replicas' temporary folders go in a folder of this run's, to count what is left
    temp_root = folder / "tmp"
    temp_root.mkdir()
    try:
        serve_ready_s, serve_s = _serve_start(httpx, engine_args, folder)
        result = _fleet(args, httpx, ray, engine_args, folder, temp_root)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    result = {**result, "serve_start_s": serve_s, "serve_ready_s": serve_ready_s,
              "fleet_start_vs_serve": result["fleet_start_s"] / serve_s}
    table([(k, f"{v:.4g}" if isinstance(v, float) else str(v)) for k, v in result.items()])
    emit(result)


def _fleet(args: argparse.Namespace, httpx, ray, engine_args: list[str], folder: Path,
           temp_root: Path) -> dict:
    """Start the fleet, play the ways, fail a replica, time a replacement, stop it."""
    from runtime.fleet.app import (
        RAY_ENV,
        RAY_SYSTEM_CONFIG,
        boot_early,
        build_app,
        start_fleet,
        stop_fleet,
    )
    from runtime.fleet.replica import TEMP_PREFIX

    port = _free_port()
    front = f"http://127.0.0.1:{port}"
    env = {"PYTHONPATH": str(ROOT), "XDG_DATA_HOME": str(folder / "data"),
           "TMPDIR": str(temp_root), **RAY_ENV}
    t0, wall0 = time.monotonic(), time.time()
    early = boot_early(engine_args, folder, replicas=2, temp_dir=str(temp_root),
                       env={**os.environ, **env})
    try:
        ray.init(num_cpus=2, object_store_memory=100 * 2**20, include_dashboard=False,
                 log_to_driver=False, runtime_env={"env_vars": env},
                 _system_config=RAY_SYSTEM_CONFIG)
        t_ray = time.monotonic()
        start_fleet(build_app(engine_args, folder, replicas=2, early=early), "127.0.0.1",
                    port, early=early)
        t_deployed = time.monotonic()
        reps = _replicas(httpx, front, 2)
        t_listed = time.monotonic()
        urls = [r["url"] for r in reps.values()]
        model = httpx.get(urls[0] + "/v1/models", timeout=60).json()["data"][0]["id"]
        for u in urls:  # every replica answers (and is warm: first requests pay one-time costs)
            _answer(httpx, u, model)
        t_serving = time.monotonic()
        timings = {"fleet_start_s": t_serving - t0, "fleet_ray_init_s": t_ray - t0,
                   "fleet_replicas_up_s": max(r["started_at"] for r in reps.values()) - wall0,
                   "fleet_engines_ready_s": max(r["ready_at"] for r in reps.values()) - wall0,
                   "fleet_deployed_s": t_deployed - t0, "fleet_listed_s": t_listed - t0,
                   "fleet_adopted": sum(bool(r["adopted"]) for r in reps.values())}
        play = Play(model, args.turns, args.max_tokens)
        n = args.conversations
        session = play.run("session", n, lambda c, t: front,
                           lambda c: {"x-session-id": f"conv-{c}"})
        # (c + t): each turn of a conversation on the other replica, each turn's load even
        round_robin = play.run("round-robin", n, lambda c, t: urls[(c + t) % 2], lambda c: {})
        single = play.run("single", n, lambda c, t: urls[0], lambda c: {})
        time.sleep(1.0)  # the replicas' KV events reach the router
        prefix = play.run("prefix", n, lambda c, t: front, lambda c: {})
        stats = httpx.get(front + "/fleet/stats", timeout=60).json()
        hop = _hop(httpx, front, urls[0], model, args.hops)
        failover = _failover(httpx, front, model, max(2, n // 4))
        replace_s = _replace(httpx, front, model)
    finally:
        stop_fleet(own_ray=True, early=early)
    left = [p.name for p in temp_root.iterdir() if p.name.startswith(TEMP_PREFIX)]
    return {
        "fleet_computed_vs_round_robin": session["computed"] / max(1, round_robin["computed"]),
        "fleet_computed_vs_single": session["computed"] / max(1, single["computed"]),
        "fleet_prefix_computed_vs_round_robin": prefix["computed"] / max(1, round_robin["computed"]),
        "fleet_router_ms_p50": stats["routing_ms"]["p50"],
        "fleet_router_ms_p99": stats["routing_ms"]["p99"],
        "fleet_front_ms_p50": stats["front_ms"]["p50"],
        "fleet_hop_ms_p50": hop,
        **failover, **timings, "fleet_replace_s": replace_s,
        "fleet_temp_folders_left": len(left),
        "prompt_tokens": session["prompt"], "prompt_tokens_round_robin": round_robin["prompt"],
        "computed_session": session["computed"], "computed_round_robin": round_robin["computed"],
        "computed_single": single["computed"], "computed_prefix": prefix["computed"],
        "conversations": n, "turns": args.turns,
    }


def _answer(httpx, url: str, model: str, timeout: float = 600) -> None:
    """One 1-token chat request to ``url``; raises unless it is answered."""
    httpx.post(url + "/v1/chat/completions", timeout=timeout, json={
        "model": model, "messages": [{"role": "user", "content": "warm up"}],
        "max_tokens": 1}).raise_for_status()


def _serve_start(httpx, engine_args: list[str], folder: Path) -> tuple[float, float]:
    """Seconds from starting one ``pie-ctx serve`` of ``engine_args`` until it says it
    serves HTTP, and until it answers a 1-token request (then it is stopped)."""
    snaps = folder / "serve-snapshots"
    snaps.mkdir()
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "runtime", "serve", *engine_args,
                             "--snapshot-dir", str(snaps), "--http", "127.0.0.1:0",
                             "--socket", str(folder / "serve.sock")],
                            stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT),
                                           "XDG_DATA_HOME": str(folder / "serve-data")})
    try:
        url, lines = None, []
        for line in proc.stderr:  # type: ignore[union-attr]
            lines.append(line)
            if m := re.search(r"serving HTTP on (http://\S+)", line):
                url = m.group(1)
                break
        if url is None:
            raise RuntimeError("pie-ctx serve did not start:\n" + "".join(lines[-20:]))
        ready = time.monotonic() - t0
        model = httpx.get(url + "/v1/models", timeout=60).json()["data"][0]["id"]
        _answer(httpx, url, model)
        return ready, time.monotonic() - t0
    finally:
        proc.terminate()
        try:
            proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()


def _replace(httpx, front: str, model: str) -> float:
    """Kill one replica's engine (SIGKILL); seconds until its replacement answers."""
    reps = _replicas(httpx, front, 2)
    victim, info = sorted(reps.items())[0]
    killed = time.monotonic()
    os.kill(info["engine_pid"], signal.SIGKILL)
    new = _replicas(httpx, front, 2, without=victim, poll_s=0.05)
    (fresh,) = [r for rid, r in new.items() if rid not in reps]
    _answer(httpx, fresh["url"], model)
    return time.monotonic() - killed


def _replicas(httpx, front: str, n: int, without: str | None = None,
              timeout: float = 300, poll_s: float = 0.05) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = {r["replica"]: r for r in httpx.get(front + "/fleet/replicas", timeout=60)
               .json()["replicas"]}
        if len(got) == n and without not in got:
            return got
        time.sleep(poll_s)
    raise RuntimeError(f"the fleet did not reach {n} replicas")


def _hop(httpx, front: str, direct: str, model: str, n: int) -> float:
    """Median extra ms of a 1-token call through the front over the same call direct."""
    body = {"model": model, "messages": [{"role": "user", "content": "hop"}], "max_tokens": 1,
            "temperature": 0}
    times: dict[str, list[float]] = {"front": [], "direct": []}
    with httpx.Client(timeout=600) as client:
        for _ in range(n):
            for name, url in (("front", front), ("direct", direct)):
                headers = {"x-session-id": "hop"} if name == "front" else {}
                t = time.perf_counter()
                client.post(url + "/v1/chat/completions", json=body, headers=headers)
                times[name].append((time.perf_counter() - t) * 1000)
    return _quantile(times["front"], 0.5) - _quantile(times["direct"], 0.5)


def _failover(httpx, front: str, model: str, n: int) -> dict[str, float]:
    """Stored conversations; kill the first one's replica; time its next turn."""
    with httpx.Client(timeout=600) as client:
        def turn(text: str, prev: str | None) -> httpx.Response:
            r = client.post(front + "/v1/responses", json={
                "model": model, "input": text, "previous_response_id": prev,
                "max_output_tokens": 4, "temperature": 0})
            r.raise_for_status()
            return r

        last: list[dict] = []
        where: list[str] = []
        for c in range(n):
            prev = None
            for t in range(2):
                r = turn(f"Conversation {c}, turn {t}: remember the number {c * 10 + t}. " * 3,
                         prev)
                prev = r.json()["id"]
            last.append(r.json())
            where.append(r.headers["x-pie-replica"])
        # A healthy follow-up (not the victim's) shows what "nothing recomputed" reads as.
        healthy = _recomputed(turn, last[-1])
        victim = where[0]
        pid = next(r["pid"] for r in client.get(front + "/fleet/replicas").json()["replicas"]
                   if r["replica"] == victim)
        killed = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        while True:
            try:
                recomputed = _recomputed(turn, last[0])
                break
            except httpx.HTTPError:
                if time.monotonic() - killed > 120:
                    raise
                time.sleep(0.2)
        failover_s = time.monotonic() - killed
        _replicas(httpx, front, 2, without=victim)
        back_s = time.monotonic() - killed
    return {"fleet_failover_s": failover_s,
            "fleet_failover_recomputed_saved_tokens": recomputed,
            "fleet_healthy_recomputed_saved_tokens": healthy,
            "fleet_replica_replaced_s": back_s}


def _recomputed(turn, prev: dict) -> int:
    """Tokens of ``prev``'s saved context computed again by a follow-up: the context is
    its input and output less the last sampled token (written by the next pass)."""
    saved = prev["usage"]["input_tokens"] + prev["usage"]["output_tokens"] - 1
    r = turn("And the number was?", prev["id"])
    cached = r.json()["usage"]["input_tokens_details"]["cached_tokens"]
    return max(0, saved - cached)


if __name__ == "__main__":
    main()
