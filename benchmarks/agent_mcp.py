"""The ReAct tools of ``benchmarks/agents.py`` as an MCP server (system e).

    python benchmarks/agent_mcp.py [--smoke]       # stdio; pie-ctx serve --mcp react=...

The same two tools as ``agent_workloads.REACT_TOOLS`` (names, descriptions, bounded
arguments), served over stdio with the official ``mcp`` package, so that ``pie-ctx serve
--mcp react="python benchmarks/agent_mcp.py"`` runs them inside a ``/v1/responses``
request. Each call waits the workload's tool latency (the web API), then returns an
observation of the workload's shape. The server cannot tell which agent called (the
request carries no such thing), so the n-th call gets ``react_observation(n % 97,
n % rounds)``: the same length and structure as the other systems' observations.
"""

from __future__ import annotations

import itertools
import sys
from typing import Annotated, Literal

if __name__ == "__main__" and {"-h", "--help"} & set(sys.argv):
    print(__doc__)
    sys.exit(0)

import agent_workloads as W  # noqa: E402
import anyio  # noqa: E402
from mcp.server.mcpserver import MCPServer  # noqa: E402
from pydantic import Field  # noqa: E402

SHAPE = W.SMOKE if "--smoke" in sys.argv else W.Shape()
_search, _page = (t["function"] for t in W.REACT_TOOLS)
_calls = itertools.count()

app = MCPServer("react-tools", log_level="WARNING")


async def _observe() -> str:
    n = next(_calls)
    await anyio.sleep(SHAPE.tool_latency)
    return W.react_observation(n % 97, n % SHAPE.rounds)


@app.tool(name="web_search", description=_search["description"])
async def web_search(
        query: Annotated[str, Field(max_length=40, description="what to search for, a few "
                                                              "precise words")],
        site: Annotated[Literal[tuple(W.SITES)],  # type: ignore[valid-type]
                        Field(description="restrict the search to this site")],
        max_results: Annotated[int, Field(ge=1, le=9, description="how many results to "
                                                                   "return")],
        lang: Annotated[Literal["en", "fr", "de"],
                        Field(description="language of the results")]) -> str:
    return await _observe()


@app.tool(name="open_page", description=_page["description"])
async def open_page(
        url: Annotated[str, Field(max_length=48, description="the page's URL, as web_search "
                                                            "returned it")],
        section: Annotated[Literal["Summary", "Changes", "Usage", "Examples"],
                           Field(description="which section of the page to read")]) -> str:
    return await _observe()


if __name__ == "__main__":
    app.run()
