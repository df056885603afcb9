"""Agents of ``benchmarks/agents.py`` as OpenAI clients (systems b, c, d and e).

    python benchmarks/agent_client.py --url http://127.0.0.1:PORT/v1 \\
        --workload react|codeact|swarm --agent I [--smoke] [--tools-as schema] \\
        [--api chat|responses|mcp]

The program an agent framework is: it keeps each agent's message list and sends all of it
with every request, runs the tools itself, and reads each answer whole. One process per
agent (ReAct, CodeAct), or per ring (Swarm: its agents pass messages in memory). Prints
``READY``, waits for a line on stdin, works, prints one ``RESULT`` line per agent.

The same program talks to ``pie-ctx serve --http`` (b) and to llama.cpp's ``llama-server``
(c); ``ignore_eos`` is an extension both accept. A call is asked for with ``tools=`` and
``tool_choice="required"``; llama-server's tool support does not cover SmolLM2's template
(it answers prose), so for it ``--tools-as grammar`` sends the call's grammar (GBNF, the
language our engine's constraint allows) or ``--tools-as schema`` its JSON Schema as
``response_format`` (llama.cpp's converter then allows free whitespace: longer calls).

``--api responses`` (d) is the same agents as clients of ``/v1/responses``: each request
sends only the agent's new items (a tool's output, an incoming message) with
``previous_response_id``, as the OpenAI Agents SDK does; the server continues the stored
context. ``--api mcp`` (e) is ReAct with its tools on the server (``serve --mcp react=
"python benchmarks/agent_mcp.py"``): one request per agent, ``max_tool_calls`` = the
rounds, then the answer; ``ignore_eos`` and ``max_output_tokens`` = the rounds' call
budget plus the answer's make its generated tokens the other systems' (the answer takes
what the calls left).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import agent_workloads as W
import anyio


class Agent:
    """One agent's conversation and counters."""

    def __init__(self, client: Any, model: str, index: int, args: argparse.Namespace) -> None:
        self.client, self.model, self.index, self.args = client, model, index, args
        self.messages: list[dict[str, Any]] = []
        self.generated = self.call_tokens = self.sent = self.computed = 0
        self.previous: str | None = None  # --api responses: the last response's id
        self.context = 0  # ... and how many tokens its stored context holds
        self.rounds = 0  # requests sent
        self.followup_sent = 0  # prompt tokens sent by the requests after the first

    async def respond(self, step: int, max_tokens: int, items: list[dict[str, Any]], *,
                      fixed: bool = False, **extra: Any) -> Any:
        """One ``/v1/responses`` request continuing this agent's last response."""
        body: dict[str, Any] = {"seed": W.seed(self.index, step)}
        if fixed:
            body["ignore_eos"] = True
        r = await self.client.responses.create(
            model=self.model, input=items, previous_response_id=self.previous,
            max_output_tokens=max_tokens, temperature=W.TEMPERATURE, top_p=W.TOP_P,
            extra_body=body, **extra)
        usage = r.usage
        self.generated += usage.output_tokens
        self.sent += usage.input_tokens - self.context  # what this request added
        if self.previous is not None:
            self.followup_sent += usage.input_tokens - self.context
        self.computed += usage.input_tokens - usage.input_tokens_details.cached_tokens
        self.context = usage.input_tokens + usage.output_tokens
        self.previous, self.rounds = r.id, self.rounds + 1
        return r

    async def complete(self, step: int, max_tokens: int, *, fixed: bool = False,
                       grammar: str | None = None, **extra: Any) -> Any:
        body: dict[str, Any] = {}
        if fixed:
            body["ignore_eos"] = True
        if grammar is not None:  # llama-server's own extension
            body["grammar"] = grammar
        response = await self.client.chat.completions.create(
            model=self.model, messages=self.messages, max_tokens=max_tokens,
            temperature=W.TEMPERATURE, top_p=W.TOP_P, seed=W.seed(self.index, step),
            extra_body=body, **extra)
        usage = response.usage
        self.generated += usage.completion_tokens
        self.sent += usage.prompt_tokens
        cached = 0
        details = getattr(usage, "prompt_tokens_details", None)
        if details is not None and getattr(details, "cached_tokens", None) is not None:
            cached = details.cached_tokens
        timings = (response.model_extra or {}).get("timings")
        if isinstance(timings, dict) and "prompt_n" in timings:  # llama-server
            cached = usage.prompt_tokens - timings["prompt_n"]
        self.computed += usage.prompt_tokens - cached
        return response


def _call_schema() -> dict[str, Any]:
    """One call of any ReAct tool, as a JSON Schema (for ``--tools-as schema``)."""
    return {"anyOf": [{"type": "object", "properties": {
        "name": {"const": t["function"]["name"]}, "arguments": t["function"]["parameters"]},
        "required": ["name", "arguments"], "additionalProperties": False}
        for t in W.REACT_TOOLS]}


async def react(agent: Agent, shape: W.Shape) -> None:
    args = agent.args
    agent.messages = [{"role": "system", "content": W.REACT_SYSTEM},
                      {"role": "user", "content": W.react_question(agent.index)}]
    for rnd in range(shape.rounds):
        if args.tools_as in ("schema", "grammar"):
            if args.tools_as == "schema":
                r = await agent.complete(rnd, 96, response_format={
                    "type": "json_schema", "json_schema": {"name": "call",
                                                           "schema": _call_schema()}})
            else:
                r = await agent.complete(rnd, 96, grammar=W.react_call_gbnf())
            message = r.choices[0].message
            agent.messages.append({"role": "assistant", "content": message.content})
            agent.messages.append({"role": "user", "content":
                                   W.react_observation(agent.index, rnd)})
        else:
            r = await agent.complete(rnd, 96, tools=W.REACT_TOOLS, tool_choice="required",
                                     parallel_tool_calls=False)
            message = r.choices[0].message
            calls = message.tool_calls or []
            agent.messages.append({"role": "assistant", "content": message.content,
                                   "tool_calls": [c.model_dump() for c in calls]})
            if calls:
                agent.messages.append({"role": "tool", "tool_call_id": calls[0].id,
                                       "content": W.react_observation(agent.index, rnd)})
            else:
                agent.messages.append({"role": "user", "content":
                                       W.react_observation(agent.index, rnd)})
        agent.call_tokens += r.usage.completion_tokens
        await anyio.sleep(shape.tool_latency)  # the web API
    agent.messages.append({"role": "user", "content": W.REACT_FINAL})
    extra = {} if args.tools_as != "tools" else {"tools": W.REACT_TOOLS,
                                                 "tool_choice": "none"}
    await agent.complete(99, shape.answer_tokens, fixed=True, **extra)


RESPONSES_TOOLS = [{"type": "function", **t["function"]} for t in W.REACT_TOOLS]
CALL_BUDGET = 48  # tokens of a ReAct call (agent_workloads: ~48)


async def react_responses(agent: Agent, shape: W.Shape) -> None:
    """ReAct over ``/v1/responses``: only new items, after ``previous_response_id``."""
    items: list[dict[str, Any]] = [{"role": "user", "content": W.react_question(agent.index)}]
    for rnd in range(shape.rounds):
        r = await agent.respond(rnd, 96, items, instructions=W.REACT_SYSTEM,
                                tools=RESPONSES_TOOLS, tool_choice="required",
                                parallel_tool_calls=False)
        calls = [o for o in r.output if o.type == "function_call"]
        observation = W.react_observation(agent.index, rnd)
        items = ([{"type": "function_call_output", "call_id": calls[0].call_id,
                   "output": observation}] if calls
                 else [{"role": "user", "content": observation}])
        agent.call_tokens += r.usage.output_tokens
        await anyio.sleep(shape.tool_latency)  # the web API
    items.append({"role": "user", "content": W.REACT_FINAL})
    await agent.respond(99, shape.answer_tokens, items, fixed=True,
                        instructions=W.REACT_SYSTEM, tools=RESPONSES_TOOLS,
                        tool_choice="none")


async def react_mcp(agent: Agent, shape: W.Shape) -> None:
    """ReAct with its tools in the server: one request runs every round and the answer."""
    await agent.respond(0, shape.rounds * CALL_BUDGET + shape.answer_tokens,
                        [{"role": "user", "content": W.react_question(agent.index)}],
                        fixed=True, instructions=W.REACT_SYSTEM,
                        tools=[{"type": "mcp", "server_label": "react",
                                "require_approval": "never"}],
                        tool_choice="required", parallel_tool_calls=False,
                        max_tool_calls=shape.rounds)


async def codeact(agent: Agent, shape: W.Shape) -> None:
    agent.messages = [{"role": "system", "content": W.CODEACT_SYSTEM},
                      {"role": "user", "content": W.codeact_task(agent.index)}]
    for rnd in range(shape.rounds):
        r = await agent.complete(rnd, shape.code_tokens, fixed=True)
        agent.messages.append({"role": "assistant", "content": r.choices[0].message.content})
        output = await anyio.to_thread.run_sync(W.run_snippet, agent.index, rnd)
        agent.messages.append({"role": "user", "content": f"Output:\n{output}"})
    agent.messages.append({"role": "user", "content": W.CODEACT_FINAL})
    await agent.complete(99, shape.output_tokens, fixed=True)


async def swarm(agents: list[Agent], shape: W.Shape) -> list[float]:
    """A ring of agents passing messages in memory; returns each agent's latency."""
    ring = len(agents)
    send, receive = zip(*[anyio.create_memory_object_stream[str](1) for _ in agents],
                        strict=True)
    latencies = [0.0] * ring
    t0 = time.perf_counter()

    async def run(me: Agent) -> None:
        i = me.index % ring  # its place in the ring; me.index names it everywhere else
        responses = me.args.api == "responses"
        me.messages = [{"role": "system", "content": W.swarm_system(me.index, ring)},
                       {"role": "user", "content": W.swarm_opening(me.index)}]
        items: list[dict[str, Any]] = [me.messages[1]]
        for k in range(W.messages_per_agent(shape)):
            if responses:  # only the new message, after the stored context
                r = await me.respond(k, shape.message_tokens, items, fixed=True,
                                     instructions=me.messages[0]["content"])
                text = r.output_text
            else:
                r = await me.complete(k, shape.message_tokens, fixed=True)
                text = r.choices[0].message.content or ""
                me.messages.append({"role": "assistant", "content": text})
            await send[(i + 1) % ring].send(text)
            incoming = await receive[i].receive()
            sender = me.index - i + (i - 1) % ring
            items = [{"role": "user", "content": W.swarm_incoming(sender, incoming)}]
            me.messages.extend(items)
        latencies[i] = time.perf_counter() - t0

    async with anyio.create_task_group() as tg:
        for a in agents:
            tg.start_soon(run, a)
    return latencies


async def amain(args: argparse.Namespace) -> None:
    import openai

    shape = W.SMOKE if args.smoke else W.Shape()
    async with openai.AsyncOpenAI(base_url=args.url, api_key=args.api_key, max_retries=0,
                                  timeout=3600) as client:
        model = (await client.models.list()).data[0].id
        count = shape.ring if args.workload == "swarm" else 1
        agents = [Agent(client, model, args.agent * count + i, args) for i in range(count)]
        print("READY", flush=True)
        await anyio.to_thread.run_sync(sys.stdin.readline)
        t0 = time.perf_counter()
        if args.workload == "swarm":
            latencies = await swarm(agents, shape)
        else:
            work = {"chat": react, "responses": react_responses, "mcp": react_mcp}[args.api] \
                if args.workload == "react" else codeact
            await work(agents[0], shape)
            latencies = [time.perf_counter() - t0]
    for agent, latency in zip(agents, latencies, strict=True):
        print(W.result_json(latency=latency, generated=agent.generated,
                            call_tokens=agent.call_tokens, call_steps=0,
                            prompt_sent=agent.sent, prompt_computed=agent.computed,
                            requests=agent.rounds, followup_sent=agent.followup_sent),
              flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--api-key", default="none")
    ap.add_argument("--workload", choices=("react", "codeact", "swarm"), required=True)
    ap.add_argument("--agent", type=int, required=True,
                    help="the agent's index (Swarm: the ring's)")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--tools-as", choices=("tools", "schema", "grammar"), default="tools")
    ap.add_argument("--api", choices=("chat", "responses", "mcp"), default="chat",
                    help="chat: /v1/chat/completions, the whole history each round (b, c); "
                         "responses: /v1/responses, only new items (d); mcp: ReAct's tools "
                         "as server-side MCP tools, one request (e)")
    anyio.run(amain, ap.parse_args())


if __name__ == "__main__":
    main()
