"""One agent of ``benchmarks/agents.py`` as an inferlet (systems a1 and a2).

    pie-ctx run benchmarks/agent_inferlet.py --connect ADDR -- \\
        --workload react|codeact|swarm --agent I --mode a1|a2 [--smoke] [--ring-id R]
    pie-ctx launch agent_inferlet --connect ADDR -- ... --hosted --session S   (system a3)

It prints ``READY``, waits for a line on stdin (the orchestrator releases every agent at
once), does its agent's work on one context kept across rounds, and prints one ``RESULT``
line of JSON (latency, tokens, steps). Hosted (``--hosted``: launched inside ``pie-ctx serve
--inferlets benchmarks``), it has no stdin: it sends ``READY`` to its session and waits for
a broadcast on the topic ``go-RUN``; its lines reach the orchestrator through
``pie-ctx launch``'s stdout.

* ``a1``, plain: the steps a client makes, as a new user writes them. Tool calls go through
  ``generate(tool_choice="required")`` (the engine's constraint and jump-forward, which
  the HTTP API applies too); the tool runs when the generation has ended.
* ``a2``, what only a program can do, on top: prompt-lookup drafts (calls and answers copy
  URLs and figures from the observations) and the tool starts the moment its call is
  complete (read from the stream).

Swarm agents are separate inferlet processes talking through ``rt.send``/``rt.receive``.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import anyio

# `pie-ctx run` loads this file by path: its folder is not on sys.path
sys.path.insert(0, str(Path(__file__).resolve().parent))

import agent_workloads as W  # noqa: E402

from pie_ctx import Context, Sampler  # noqa: E402
from pie_ctx.tools import Tool  # noqa: E402


def add_arguments(parser: Any) -> None:
    parser.add_argument("--workload", choices=("react", "codeact", "swarm", "hop"),
                        required=True, help="hop: the socket-hop probe (agents.py)")
    parser.add_argument("--agent", type=int, required=True)
    parser.add_argument("--mode", choices=("a1", "a2"), default="a1")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--run", default="0", help="names this run's Swarm channels")
    parser.add_argument("--no-wait", action="store_true", help="start at once (tests)")
    parser.add_argument("--hosted", action="store_true",
                        help="launched inside the server: wait for the topic go-RUN")
    parser.add_argument("--session", default=None,
                        help="the prompts' session tag (default: $AGENT_SESSION; a hosted "
                             "agent has the server's environment, so it is passed here)")


class Tally:
    """What one agent did: generated tokens, tool-call tokens and the steps they took,
    prompt tokens sent and computed."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.generated = self.call_tokens = self.call_steps = 0
        self.sent = self.computed = 0
        self.best: float | None = None  # the hop probe's best time

    def add(self, gen: Any, call: bool = False) -> None:
        r = gen.report
        n = len(gen.tokens_out)
        self.generated += n
        if call:
            self.call_tokens += n
            self.call_steps += r.num_steps
        # tokens_written: the prompt (attached pages + computed); the attached part is
        # full pages found in the cache
        self.sent += r.tokens_written
        self.computed += r.tokens_written - r.pages_reused * self.page_size


def _sampler(agent: int, step: int) -> Any:
    return Sampler.top_p(W.TEMPERATURE, W.TOP_P, seed=W.seed(agent, step))


async def _generate(gen: Any, on_call: Any = None) -> None:
    """Run a generation; with ``on_call``, start each call's tool as its delta arrives."""
    if on_call is None:
        await gen.text()
        return
    async for delta in gen:
        for call in delta.tool_calls:
            on_call(call)


async def react(rt: Any, args: Any, shape: W.Shape, tally: Tally) -> None:
    a2 = args.mode == "a2"
    spec = "prompt_lookup" if a2 else None
    tools = [Tool.from_openai(t) for t in W.REACT_TOOLS]
    ctx = Context(rt).system(W.REACT_SYSTEM, tools=tools).user(W.react_question(args.agent))
    for rnd in range(shape.rounds):
        gen = ctx.generate(_sampler(args.agent, rnd), max_tokens=96, tool_choice="required",
                           parallel_tool_calls=False, speculator=spec)
        if a2:  # the tool starts the moment its call is complete
            async with anyio.create_task_group() as tg:
                await _generate(gen, lambda call: tg.start_soon(anyio.sleep,
                                                                 shape.tool_latency))
        else:
            await _generate(gen)
            await anyio.sleep(shape.tool_latency)
        tally.add(gen, call=True)
        observation = W.react_observation(args.agent, rnd)
        if gen.tool_calls:
            ctx.tool_result(gen.tool_calls[0].id, observation)
        else:  # cut by max_tokens: the observation still arrives
            ctx.user(observation)
    ctx.user(W.REACT_FINAL)
    gen = ctx.generate(_sampler(args.agent, 99), max_tokens=shape.answer_tokens,
                       ignore_eos=True, tool_choice="none", speculator=spec)
    await gen.text()
    tally.add(gen)


async def codeact(rt: Any, args: Any, shape: W.Shape, tally: Tally) -> None:
    spec = "prompt_lookup" if args.mode == "a2" else None
    ctx = Context(rt).system(W.CODEACT_SYSTEM).user(W.codeact_task(args.agent))
    for rnd in range(shape.rounds):
        gen = ctx.generate(_sampler(args.agent, rnd), max_tokens=shape.code_tokens,
                           ignore_eos=True, speculator=spec)
        await gen.text()
        tally.add(gen)
        output = await anyio.to_thread.run_sync(W.run_snippet, args.agent, rnd)
        ctx.user(f"Output:\n{output}")
    ctx.user(W.CODEACT_FINAL)
    gen = ctx.generate(_sampler(args.agent, 99), max_tokens=shape.output_tokens,
                       ignore_eos=True, speculator=spec)
    await gen.text()
    tally.add(gen)


async def swarm(rt: Any, args: Any, shape: W.Shape, tally: Tally) -> None:
    spec = "prompt_lookup" if args.mode == "a2" else None
    me, ring = args.agent, shape.ring  # agents me - pos ... form this agent's ring
    pos = me % ring
    inbox = f"swarm-{args.run}-{me}"
    outbox = f"swarm-{args.run}-{me - pos + (pos + 1) % ring}"
    sender = me - pos + (pos - 1) % ring
    ctx = Context(rt).system(W.swarm_system(me, ring)).user(W.swarm_opening(me))
    for k in range(W.messages_per_agent(shape)):
        gen = ctx.generate(_sampler(me, k), max_tokens=shape.message_tokens, ignore_eos=True,
                           speculator=spec)
        text = await gen.text()
        tally.add(gen)
        await rt.send(outbox, text)
        ctx.user(W.swarm_incoming(sender, await rt.receive(inbox)))
    await ctx.flush()  # the last message is part of the agent's work too


async def hop(rt: Any, args: Any, shape: W.Shape, tally: Tally) -> None:
    """Not an agent: one greedy generation read token by token, best of 5 (its latency is
    that best). Run over the socket and hosted, the difference per token is what the socket
    hop costs (agents.py: ``socket_hop_us_per_token``)."""
    n = 8 if args.smoke else 64
    best = float("inf")
    for _ in range(5):
        ctx = Context(rt).user(W.react_question(args.agent)).cue()
        await ctx.flush()  # the prompt is not what is measured
        t0 = time.perf_counter()
        gen = ctx.generate(Sampler.greedy(), max_tokens=n, ignore_eos=True)
        async for _ in gen:
            pass
        best = min(best, time.perf_counter() - t0)
        tally.generated = len(gen.tokens_out)
        await ctx.release()
    tally.best = best


async def main(rt: Any, args: Any) -> None:
    shape = W.SMOKE if args.smoke else W.Shape()
    tally = Tally(rt.page_size)
    work = {"react": react, "codeact": codeact, "swarm": swarm, "hop": hop}[args.workload]
    rt.tokenizer  # built before the clock starts  # noqa: B018
    if args.session is not None:
        W.SESSION = args.session  # one run at a time per server: the tag of that run
    if args.hosted and not args.no_wait:
        async with rt.subscribe(f"go-{args.run}") as go:
            await rt.session.send("READY\n")
            await go.receive()
    elif not args.no_wait:
        await rt.session.send("READY\n")
        await anyio.to_thread.run_sync(sys.stdin.readline)
    t0 = time.perf_counter()
    await work(rt, args, shape, tally)
    await rt.session.send(W.result_json(
        latency=tally.best if tally.best is not None else time.perf_counter() - t0, generated=tally.generated,
        call_tokens=tally.call_tokens, call_steps=tally.call_steps, prompt_sent=tally.sent,
        prompt_computed=tally.computed) + "\n")
