"""A production trace replayed through the OpenAI API: prefix-cache hit rate against the
trace's ceiling, prompt tokens computed, time to first token and throughput.

    python benchmarks/trace_replay.py [--requests 600] [--concurrency 8] [--speedup X]
        [--block-tokens 16] [--output-scale 0.05] [--max-output 32] [--pool-pages N]
        [--llama-server PATH] [--gguf FILE] [--fleet] [--systems a,b,c,d]
        [--memory-snapshots] [--decode-share S] [--smoke]

The trace is Mooncake's conversation trace (``--trace``; /work/shared/traces/README.md):
each request is a list of 512-token blocks named by prefix hashes. Each hash id becomes a
fixed pseudo-random block of ``--block-tokens`` token ids (the same id, the same tokens),
a request's prompt is its blocks in order, and its output is ``output_length`` scaled by
``--output-scale`` (at least 1, at most ``--max-output``). The first ``--requests`` are
sent in trace order, ``--concurrency`` in flight (or, with ``--speedup X``, each at its
timestamp divided by X, still at most ``--concurrency`` in flight), as streamed
``/v1/completions`` calls with the token ids as the prompt, through the official
``openai`` client, greedy, to:

* a: one engine (``pie-ctx serve`` as it runs by default: its own pool, or ``--pool-pages``
  pages, and a snapshot folder, whose disk tier keeps evicted cache pages for prefix
  matching, ``--disk-cache-gb`` 4; ``--memory-snapshots``: the pool alone);
* b: llama.cpp's ``llama-server`` on the same GGUF (``--llama-server PATH``; ``-np`` slots
  = the concurrency, ``cache_prompt``), the engine then loading that GGUF too;
* c: a fleet of 3 replicas (``runtime.fleet``, Ray Serve) behind its front, which routes
  each prompt to the replica holding its longest prefix (``--fleet``);
* d: the same fleet's replicas called round robin, request i to replica i mod 3 (what a
  router that knows nothing of prefixes does), with other token blocks so c's pages
  serve none of d's prompts.

Per system: the hit rate (``cached_tokens / prompt_tokens``, from each reply's
``usage.prompt_tokens_details.cached_tokens``; llama-server's ``timings.cache_n`` where it
has no details) against the trace's ceiling for the window (the share of its blocks that
repeat an earlier block: what an unbounded prefix cache could skip), prompt tokens
computed (prompt - cached), TTFT p50/p99 (to the first streamed choice), and throughput
(requests and generated tokens per second of wall time). The last line is a JSON object:
``trace_hit_rate_vs_ceiling`` (a), ``trace_ttft_p50_vs_llamaserver`` (a over b),
``trace_tput_vs_llamaserver`` (a over b, requests/s), ``fleet_trace_hit_rate_vs_single``
(c over a), ``fleet_trace_computed_vs_round_robin`` (c over d), each None when a system it
needs did not run, and ``systems``: every system's raw figures. Goals: >= 0.95, <= 0.5,
>= 2, >= 0.9, <= 0.6. Timings on a busy 2-core machine are noise; the hit rates and
computed tokens are not.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from agents import LlamaServer, PieServer, _default_gguf
from common import emit, parse_args, table

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
TRACE = Path("/work/shared/traces/mooncake_conversation_trace.jsonl")
FLEET_REPLICAS = 3


@dataclass(slots=True)
class Request:
    """One trace line made concrete: when it is sent, its prompt and its output length."""

    at_s: float  # trace time, seconds from the first request
    blocks: list[int]  # hash ids
    prompt: list[int]
    max_tokens: int


@dataclass(slots=True)
class Reply:
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    ttft_s: float


def load_trace(path: Path, n: int) -> list[dict[str, Any]]:
    """The first ``n`` requests of the trace."""
    out = []
    with path.open() as f:
        for line in f:
            if len(out) == n:
                break
            out.append(json.loads(line))
    return out


def make_requests(lines: list[dict[str, Any]], block_tokens: int, token_range: tuple[int, int],
                  output_scale: float, max_output: int, max_blocks: int = 0,
                  salt: int = 0) -> list[Request]:
    """Each hash id -> ``block_tokens`` fixed pseudo-random ids in ``token_range`` (seeded
    by the id and ``salt``: another salt gives the same trace over other tokens); a prompt
    keeps its first ``max_blocks`` blocks (0: all)."""
    lo, hi = token_range
    blocks: dict[int, list[int]] = {}

    def block(h: int) -> list[int]:
        if h not in blocks:
            rng = np.random.default_rng([h, salt])
            blocks[h] = rng.integers(lo, hi, block_tokens).tolist()
        return blocks[h]

    t0 = lines[0]["timestamp"] if lines else 0
    cut = max_blocks or None
    return [Request(at_s=(r["timestamp"] - t0) / 1000, blocks=list(r["hash_ids"][:cut]),
                    prompt=[t for h in r["hash_ids"][:cut] for t in block(h)],
                    max_tokens=max(1, min(max_output, round(r["output_length"] * output_scale))))
            for r in lines]


def ceiling(requests: list[Request]) -> float:
    """The share of the window's blocks that repeat an earlier block (an equal hash id is
    an equal prefix): the hit rate of an unbounded prefix cache."""
    seen: set[int] = set()
    total = repeated = 0
    for r in requests:
        for h in r.blocks:
            total += 1
            repeated += h in seen
            seen.add(h)
    return repeated / total if total else 0.0


# ------------------------------------------------------------------------------ clients


async def complete(client: Any, model: str, req: Request, extra: dict[str, Any]) -> Reply:
    """One streamed completion: the usage of its last chunk and the time to its first."""
    t0 = time.perf_counter()
    ttft = None
    usage = timings = None
    stream = await client.completions.create(
        model=model, prompt=req.prompt, max_tokens=req.max_tokens, temperature=0.0,
        stream=True, stream_options={"include_usage": True}, extra_body=extra)
    async for chunk in stream:
        if ttft is None and chunk.choices:
            ttft = time.perf_counter() - t0
        if chunk.usage is not None:
            usage = chunk.usage
        timings = (chunk.model_extra or {}).get("timings") or timings
    if usage is None:
        raise RuntimeError("the server sent no usage (stream_options.include_usage)")
    details = usage.prompt_tokens_details
    if details is not None and details.cached_tokens is not None:
        cached = details.cached_tokens
    else:  # llama-server without prompt_tokens_details: the tokens it did not evaluate
        cached = int((timings or {}).get("cache_n", 0))
    return Reply(usage.prompt_tokens, cached, usage.completion_tokens,
                 ttft if ttft is not None else time.perf_counter() - t0)


async def replay(requests: list[Request], urls: list[str], concurrency: int, speedup: float,
                 extra: dict[str, Any]) -> dict[str, Any]:
    """Send every request (request i to ``urls[i % len(urls)]``) and sum the replies."""
    import openai

    clients = [openai.AsyncOpenAI(base_url=u, api_key="none", max_retries=0, timeout=3600)
               for u in urls]
    model = (await clients[0].models.list()).data[0].id
    gate = asyncio.Semaphore(concurrency)
    start = time.perf_counter()

    async def one(i: int, req: Request) -> Reply:
        if speedup > 0:
            await asyncio.sleep(max(0.0, start + req.at_s / speedup - time.perf_counter()))
        async with gate:
            return await complete(clients[i % len(clients)], model, req, extra)

    # in trace order: the gate lets waiters in first come, first served
    replies = await asyncio.gather(*(one(i, r) for i, r in enumerate(requests)))
    wall = time.perf_counter() - start
    for c in clients:
        await c.close()
    prompt = sum(r.prompt_tokens for r in replies)
    cached = sum(r.cached_tokens for r in replies)
    ttfts = sorted(r.ttft_s for r in replies)
    generated = sum(r.completion_tokens for r in replies)
    return {"requests": len(replies), "prompt_tokens": prompt, "cached_tokens": cached,
            "computed_tokens": prompt - cached, "hit_rate": cached / prompt if prompt else 0.0,
            "ttft_p50_s": float(np.percentile(ttfts, 50)),
            "ttft_p99_s": float(np.percentile(ttfts, 99)), "wall_s": wall,
            "requests_per_s": len(replies) / wall, "generated_tokens": generated,
            "generated_per_s": generated / wall}


# ------------------------------------------------------------------------------ systems


async def run_single(args: argparse.Namespace, requests: list[Request], model: str | None,
                     tmp: str, weights: str) -> dict[str, Any]:
    snapshots = None
    if not args.memory_snapshots:  # serve's default: a snapshot folder, so its disk tier
        snapshots = os.path.join(tmp, "snapshots")
        os.mkdir(snapshots)
    extra = () if args.decode_share is None else ("--decode-share", str(args.decode_share))
    server = PieServer(weights, model, tmp, args.smoke, num_pages=args.pool_pages,
                       snapshot_dir=snapshots, extra=extra)
    try:
        return await replay(requests, [server.url], args.concurrency, args.speedup, {})
    finally:
        server.stop()


async def run_llama(args: argparse.Namespace, requests: list[Request], binary: str, gguf: str,
                    tmp: str) -> dict[str, Any]:
    longest = max(len(r.prompt) + r.max_tokens for r in requests)
    server = LlamaServer(binary, gguf, args.concurrency, args.threads,
                         os.path.join(tmp, "llama-server.log"), slot_tokens=longest + 64)
    try:
        return await replay(requests, [server.url], args.concurrency, args.speedup,
                            {"cache_prompt": True})
    finally:
        server.stop()


def run_fleet(args: argparse.Namespace, routed: list[Request], spread: list[Request],
              model: str | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """c (the front, prefix routing) and d (round robin over the replicas) on one fleet."""
    import httpx
    import ray
    from fleet import _free_port, _replicas

    from runtime.fleet.app import build_app, start_fleet, stop_fleet

    engine_args = (["--num-pages", str(args.pool_pages)] if args.pool_pages else []) + (
        ["--model", model] if model else [])
    folder = Path(tempfile.mkdtemp(prefix="pie-ctx-fleet-bench-"))
    port = _free_port()
    front = f"http://127.0.0.1:{port}"
    ray.init(num_cpus=2, object_store_memory=100 * 2**20, include_dashboard=False,
             log_to_driver=False, runtime_env={"env_vars": {
                 "PYTHONPATH": str(ROOT), "XDG_DATA_HOME": str(folder / "data")}})
    try:
        start_fleet(build_app(engine_args, folder, replicas=FLEET_REPLICAS), "127.0.0.1", port)
        urls = [r["url"] + "/v1" for r in _replicas(httpx, front, FLEET_REPLICAS).values()]
        time.sleep(1.0)  # the replicas' KV event streams reach the router
        prefix = asyncio.run(replay(routed, [front + "/v1"], args.concurrency, args.speedup, {}))
        round_robin = asyncio.run(replay(spread, urls, args.concurrency, args.speedup, {}))
    finally:
        stop_fleet(own_ray=True)
        shutil.rmtree(folder, ignore_errors=True)
    return prefix, round_robin


def token_range(model: str | None) -> tuple[int, int]:
    """Token ids the blocks are drawn from: clear of the special tokens at either end of
    the vocabulary (a model folder's ``config.json`` says its size)."""
    config = Path(model or "") / "config.json"
    if model and config.is_file():
        vocab = json.loads(config.read_text())["vocab_size"]
        return (min(16, vocab // 4), vocab - min(64, vocab // 4))
    return (1000, 30000)  # every model pie-ctx ships has a vocabulary over 32k


def summarize(systems: dict[str, dict[str, Any]], ceiling_: float) -> dict[str, Any]:
    def ratio(a: str, b: str, key: str) -> float | None:
        if a not in systems or b not in systems or not systems[b][key]:
            return None
        return systems[a][key] / systems[b][key]

    single = systems.get("a")
    return {
        "trace_hit_rate_vs_ceiling": single["hit_rate"] / ceiling_ if single and ceiling_
        else None,
        "trace_ttft_p50_vs_llamaserver": ratio("a", "b", "ttft_p50_s"),
        "trace_tput_vs_llamaserver": ratio("a", "b", "requests_per_s"),
        "fleet_trace_hit_rate_vs_single": ratio("c", "a", "hit_rate"),
        "fleet_trace_computed_vs_round_robin": ratio("c", "d", "computed_tokens"),
        "trace_ceiling": ceiling_,
        "systems": systems,
    }


async def amain(args: argparse.Namespace) -> dict[str, Any]:
    systems = [s for s in args.systems.split(",") if s]
    lines = load_trace(Path(args.trace), args.requests)
    llama = args.llama_server if args.llama_server and os.access(args.llama_server, os.X_OK) \
        else None
    if "b" in systems and not llama:
        print("# llama-server: not given or not executable (--llama-server PATH); skipping b")
        systems.remove("b")
    if not args.fleet:
        systems = [s for s in systems if s not in ("c", "d")]
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model, weights = args.model, args.weights
        if llama:
            model = model or args.gguf or _default_gguf()  # both on the same GGUF
        if args.smoke and model is None:  # the tiny test model: seconds, not minutes
            sys.path.insert(0, str(ROOT))
            from tests.sdk.harness import tiny_model_folder

            model = str(tiny_model_folder(Path(tmp)))
        tokens = token_range(model)
        ways = {s: make_requests(lines, args.block_tokens, tokens, args.output_scale,
                                 args.max_output, args.max_blocks, salt=i)
                for i, s in enumerate("abcd")}
        if "a" in systems:
            results["a"] = await run_single(args, ways["a"], model, tmp, weights)
        if "b" in systems and llama:
            results["b"] = await run_llama(args, ways["a"], llama, model, tmp)
        if "c" in systems or "d" in systems:
            loop = asyncio.get_running_loop()
            c, d = await loop.run_in_executor(None, run_fleet, args, ways["c"], ways["d"], model)
            results["c"], results["d"] = c, d
    return summarize(results, ceiling(ways["a"]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", default=str(TRACE), help="the trace (JSON lines)")
    ap.add_argument("--requests", type=int, default=600, help="the window: the first N")
    ap.add_argument("--concurrency", type=int, default=8, help="requests in flight at most")
    ap.add_argument("--speedup", type=float, default=0.0,
                    help="send at the trace's timestamps divided by this (0: back to back)")
    ap.add_argument("--block-tokens", type=int, default=16, help="tokens per trace block")
    ap.add_argument("--output-scale", type=float, default=0.05, help="output length factor")
    ap.add_argument("--max-output", type=int, default=32, help="output tokens at most")
    ap.add_argument("--max-blocks", type=int, default=0,
                    help="blocks of a prompt kept at most, from its start (0: all)")
    ap.add_argument("--pool-pages", type=int, default=0,
                    help="KV pages of each engine (0: serve's default; a smaller pool "
                         "shows what it keeps)")
    ap.add_argument("--memory-snapshots", action="store_true",
                    help="a without a snapshot folder, so without the disk tier that keeps "
                         "evicted cache pages (shows what the pool alone keeps)")
    ap.add_argument("--decode-share", type=float, default=None,
                    help="a's serve --decode-share (default: serve's)")
    ap.add_argument("--systems", default="a,b,c,d", help="which of a,b,c,d to run")
    ap.add_argument("--fleet", action="store_true", help="run c and d (starts Ray)")
    ap.add_argument("--llama-server", default=None, help="path of llama.cpp's llama-server")
    ap.add_argument("--gguf", default=None, help="GGUF for b (default: ours)")
    ap.add_argument("--model", default=None, help="model reference (default: the default)")
    ap.add_argument("--weights", default="auto", help="pie-ctx serve --weights")
    ap.add_argument("--threads", type=int, default=2, help="llama-server threads")
    args = parse_args(ap, requests=40, concurrency=4, max_output=2, systems="a",
                      max_blocks=8, pool_pages=512)  # the tiny model: 256 positions
    if not Path(args.trace).is_file():
        emit({"skipped": f"no trace at {args.trace} (--trace PATH)"})
        return
    result = asyncio.run(amain(args))
    rows = [(f"{s}.{k}", f"{v:.4g}" if isinstance(v, float) else str(v))
            for s, figures in result["systems"].items() for k, v in figures.items()]
    rows += [(k, f"{v:.4g}" if isinstance(v, float) else str(v))
             for k, v in result.items() if k != "systems"]
    table(rows)
    emit(result)


if __name__ == "__main__":
    main()
