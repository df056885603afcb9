"""The three agent workloads of ``benchmarks/agents.py``, as plain data and pure functions.

Every system (inferlets, OpenAI clients of our HTTP API, clients of llama-server) does the
same work: the prompts, the tools and every tool result are deterministic functions of
(agent, round), never of the generated text, and the lengths of free text come from
``max_tokens`` with ``ignore_eos``. Only a tool call's length is the model's (it ends
when its JSON does); its string argument is bounded so that a call is ~48 tokens.

Imports nothing but the standard library: the inferlets, the client program and the
orchestrator all read it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass

# Every prompt of one run starts with its session, so no run finds another's pages in a
# cache; the orchestrator warms the session's system prompt before the clock starts.
SESSION = os.environ.get("AGENT_SESSION", "")


def _session(text: str) -> str:
    return f"Session {SESSION}. {text}" if SESSION else text

# ---------------------------------------------------------------------------- sampler

TEMPERATURE, TOP_P = 0.7, 0.9


def seed(agent: int, step: int) -> int:
    """The sampler's seed of one generation: every system samples with the same seeds."""
    return 1000 * agent + step


# ----------------------------------------------------------------------------- shapes


@dataclass(frozen=True)
class Shape:
    """How much work one agent does (the benchmark's defaults, or ``--smoke``'s)."""

    rounds: int = 8  # ReAct and CodeAct rounds
    code_tokens: int = 64  # CodeAct: tokens of each code block
    answer_tokens: int = 64  # the final answer (ReAct), output summary (CodeAct: 60)
    output_tokens: int = 60
    ring: int = 4  # Swarm: agents per ring
    messages: int = 32  # Swarm: messages per ring
    message_tokens: int = 32
    tool_latency: float = 0.020  # ReAct: the web API's latency, seconds


SMOKE = Shape(rounds=2, code_tokens=8, answer_tokens=8, output_tokens=8, messages=8,
              message_tokens=6)


# ------------------------------------------------------------------------------ ReAct

SITES = ["docs.python.org", "developer.mozilla.org", "en.wikipedia.org", "arxiv.org",
         "github.com", "stackoverflow.com", "pypi.org", "news.ycombinator.com"]

REACT_TOOLS = [
    {"type": "function", "function": {
        "name": "web_search",
        "description": "Search the web and return the five best results, each with a "
                       "title, a URL and a short summary. Use it to find pages about a "
                       "topic before opening them; prefer precise queries of a few words.",
        "parameters": {"type": "object", "properties": {
            "query": {"type": "string", "maxLength": 40,
                      "description": "what to search for, a few precise words"},
            "site": {"enum": SITES, "description": "restrict the search to this site"},
            "max_results": {"type": "integer", "minimum": 1, "maximum": 9,
                            "description": "how many results to return"},
            "lang": {"enum": ["en", "fr", "de"], "description": "language of the results"},
        }, "required": ["query", "site", "max_results", "lang"],
            "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "open_page",
        "description": "Open a web page found by web_search and return the text of one of "
                       "its sections. Pages are long: name the section you need, for "
                       "example 'Changes', 'Usage' or 'Examples'.",
        "parameters": {"type": "object", "properties": {
            "url": {"type": "string", "maxLength": 48,
                    "description": "the page's URL, as web_search returned it"},
            "section": {"enum": ["Summary", "Changes", "Usage", "Examples"],
                        "description": "which section of the page to read"},
        }, "required": ["url", "section"], "additionalProperties": False}}},
]

REACT_SYSTEM = _session(
    "You are a research agent. You answer a question by working in rounds: in each round "
    "you call exactly one tool, read its result, and decide what to do next. You may call "
    "web_search to find pages and open_page to read a section of a page that a search "
    "returned. Work carefully: search with precise queries, open the most relevant page, "
    "and read the section that answers the question. Never invent a URL: only open URLs "
    "that a search returned. When you have done all your rounds, write a short, factual "
    "answer that cites the pages you read by their URL, and say what is still uncertain. "
    "The tools are slow and cost money, so do not repeat a call with the same arguments. "
    "Keep track of what each result told you; results are numbered by round. If a result "
    "is not useful, change the query rather than repeating it. Prefer official "
    "documentation and release notes over forum posts, and recent pages over old ones. "
    "Your final answer is read by an engineer who wants the facts and the sources, "
    "nothing else.")


def react_question(agent: int) -> str:
    topics = ["the parser module", "the HTTP client", "the async runtime", "the test runner",
              "the packaging tool", "the JSON library", "the image codec", "the SQL driver"]
    return (f"Agent {agent}: what changed in the latest release of "
            f"{topics[agent % len(topics)]}, and is it safe to upgrade?")


def react_observation(agent: int, rnd: int) -> str:
    """The tool's result in round ``rnd`` (~100 tokens), whatever the call said."""
    version = f"{3 + agent % 4}.{rnd}.{(agent * 7 + rnd) % 10}"
    return (f"Result {rnd + 1} of 5 for agent {agent}, round {rnd}: release notes of "
            f"version {version} ({2020 + rnd}-0{1 + agent % 9}-1{rnd}). Fixed: a crash when "
            f"the input ends inside a string; faster handling of long numbers; a new option "
            f"strict_keys. URL: https://docs.example.org/a{agent}/r{rnd}/notes.html. "
            f"Next: open the page and read the section 'Changes'.")


REACT_FINAL = "Now write your final answer, citing the URLs you read."


# ---------------------------------------------------------------------------- CodeAct

CODEACT_SYSTEM = _session(
    "You are a coding agent. You solve a data task by writing Python code in rounds: in "
    "each round you write one short code block, it is executed, and you read its output "
    "before the next round. Write plain Python 3 that prints its results; keep each block "
    "under ten lines. When you are done, summarise the results in a few sentences.")


def codeact_task(agent: int) -> str:
    return (f"Agent {agent}: load the table of daily sales for store {agent}, find the "
            f"three best days, and compute the weekly totals.")


def codeact_snippet(agent: int, rnd: int) -> str:
    """The code that runs in round ``rnd`` (a 135M model's own code would not run)."""
    return (f"import statistics\n"
            f"sales = [(d * {agent + 3} + {rnd} * 17) % 97 + 10 for d in range(28)]\n"
            f"weeks = [sum(sales[i:i + 7]) for i in range(0, 28, 7)]\n"
            f"best = sorted(range(28), key=sales.__getitem__)[-3:]\n"
            f"print('round', {rnd}, 'agent', {agent})\n"
            f"print('weekly totals:', weeks)\n"
            f"print('best days:', best, 'values:', [sales[d] for d in best])\n"
            f"print('mean:', round(statistics.mean(sales), 2))\n")


def run_snippet(agent: int, rnd: int) -> str:
    """Run round ``rnd``'s code in a real Python subprocess; its output (~60 tokens)."""
    out = subprocess.run([sys.executable, "-I", "-c", codeact_snippet(agent, rnd)],
                         capture_output=True, text=True, timeout=60)
    return (out.stdout + out.stderr).strip()


CODEACT_FINAL = "Summarise the results of your code."

# ------------------------------------------------------------------------------ Swarm


def swarm_system(agent: int, ring: int) -> str:
    roles = ["planner", "critic", "researcher", "writer"]
    return _session(
        f"You are agent {agent} of a team of {ring}, the {roles[agent % 4]}. Your team "
        f"designs a small web service for a library. You receive messages from the agent "
        f"before you and write short messages to the agent after you: add one new idea or "
        f"one objection each time, in one or two sentences, and refer to what the last "
        f"message said.")


def swarm_opening(agent: int) -> str:
    return f"Start the discussion: propose the first feature (you are agent {agent})."


def swarm_incoming(sender: int, text: str) -> str:
    """How a received message enters the receiver's context (a user turn)."""
    return f"Message from agent {sender}: {text}"


def messages_per_agent(shape: Shape) -> int:
    return shape.messages // shape.ring


# ------------------------------------------------------------------------------ tools


def react_call_gbnf() -> str:
    """A GBNF grammar of one ReAct call, written as our engine writes it (one line,
    ``", "`` and ``": "``): what llama-server is given, so that its calls are the same
    language as ours (its JSON Schema converter allows free whitespace, and its tool-call
    support does not cover SmolLM2's template). Covers the schemas above: objects of
    required properties in order, bounded strings, enums, small integers."""
    def lit(text: str) -> str:
        return json.dumps(text)

    def value(schema: dict) -> str:
        if "enum" in schema:
            return " | ".join(lit(json.dumps(v)) for v in schema["enum"])
        if schema.get("type") == "integer":
            lo, hi = schema.get("minimum", 0), schema.get("maximum", 9)
            if not 0 <= lo <= hi <= 9:
                raise ValueError("only one-digit integers are covered")
            return f"[{lo}-{hi}]"
        if schema.get("type") == "string":
            return f'"\\"" char{{0,{schema.get("maxLength", 64)}}} "\\""'
        raise ValueError(f"no grammar for {schema}")

    calls = []
    for tool in REACT_TOOLS:
        f = tool["function"]
        props = f["parameters"]["properties"]
        parts = [lit('{"name": ' + json.dumps(f["name"]) + ', "arguments": {')]
        for i, (key, schema) in enumerate(props.items()):
            parts.append(lit((", " if i else "") + json.dumps(key) + ": "))
            parts.append(f"({value(schema)})")
        parts.append(lit("}}"))
        calls.append(" ".join(parts))
    return ("root ::= " + " | ".join(f"({c})" for c in calls) + "\n"
            'char ::= [^"\\\\\\x7F\\x00-\\x1F] | "\\\\" (["\\\\/bfnrt] | "u" '
            "[0-9a-fA-F]{4})\n")


def tool_schema_of(name: str) -> dict:
    return next(t["function"]["parameters"] for t in REACT_TOOLS
                if t["function"]["name"] == name)


def result_json(**fields: object) -> str:
    """One line of an agent's result (the orchestrator reads it from stdout)."""
    return "RESULT " + json.dumps(fields)
