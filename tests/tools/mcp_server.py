"""A small MCP server for tests/tools/test_mcp.py, written with the ``mcp`` package.

Run ``python mcp_server.py`` to serve over stdio, or ``python mcp_server.py --http PORT``
to serve streamable HTTP at ``http://127.0.0.1:PORT/mcp``. Every string the model may
write is bounded (``maxLength``): the tiny random model writes random strings.
"""

from __future__ import annotations

import os
import sys
from typing import Annotated, Literal

import anyio
from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.types import CallToolResult
from pydantic import Field

app = MCPServer("pie-test", instructions="Tools for the pie-ctx tests.", log_level="WARNING")


@app.tool()
def echo(text: Annotated[str, Field(max_length=12, description="what to echo")]) -> str:
    """Echo the text back."""
    return f"echo:{text}"


@app.tool()
def lookup(code: Literal["ab", "cd", "ef"]) -> dict:
    """Look up a code."""
    return {"code": code, "value": len(code) * 7}


@app.tool(name="text.upper")
def upper(text: Annotated[str, Field(max_length=12)]) -> str:
    """Upper-case the text (a dotted MCP name, which a pie Tool cannot carry)."""
    return text.upper()


@app.tool()
def stats() -> CallToolResult:
    """Structured content only, no text block."""
    return CallToolResult(content=[], structured_content={"calls": 3, "ok": True})


@app.tool()
def fail(reason: Annotated[str, Field(max_length=12)]) -> str:
    """Always fails, with a message for the model."""
    raise ToolError(f"cannot do {reason}")


@app.tool()
async def nap(seconds: float) -> str:
    """Sleep, then answer."""
    await anyio.sleep(seconds)
    return "rested"


@app.tool()
def die() -> str:
    """Exit the server at once, mid-call."""
    os._exit(3)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--http"]:
        app.run("streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
    else:
        app.run()
