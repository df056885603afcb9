"""The live server the Responses tests share (tests/http/test_responses.py and
tests/http/test_frameworks.py): one ``pie-ctx serve --http`` for the session, with an MCP
server written here (``--mcp count=COMMAND``, stdio) and tests/tools/mcp_server.py over
streamable HTTP (``--mcp web=URL``) configured, so the two modules pay one boot."""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.http.test_openai import LiveServer
from tests.sdk.harness import tiny_model_folder
from tests.tools.test_mcp import _start_http, _stop

MCP_SERVER = textwrap.dedent('''
    """A stdio MCP server for test_responses.py: counts its calls."""
    from typing import Annotated, Literal
    from pydantic import Field
    from mcp.server.mcpserver import MCPServer

    app = MCPServer("count", log_level="WARNING")
    calls = []

    @app.tool()
    def tally(code: Literal["ab", "cd"]) -> str:
        """Count a code; returns how many calls so far."""
        calls.append(code)
        return f"tally {len(calls)}: {code}"

    @app.tool()
    def note(text: Annotated[str, Field(max_length=6)]) -> str:
        """Note some text."""
        return "noted"

    if __name__ == "__main__":
        app.run()
''')


class Served:
    def __init__(self, folder: Path, tmp: Path) -> None:
        self.folder, self.tmp = folder, tmp
        # tests/tools/mcp_server.py over streamable HTTP: the --mcp NAME=URL kind
        self.web, self.web_url = _start_http()
        self.server = self.start()

    def stop(self) -> None:
        self.server.stop()
        _stop(self.web)

    def start(self) -> LiveServer:
        script = self.tmp / "count_server.py"
        script.write_text(MCP_SERVER)
        server = LiveServer(str(self.folder), str(self.tmp), "--mcp",
                            f"count={sys.executable} {script}", "--mcp",
                            f"web={self.web_url}")
        # The engine's first request warms it up (minutes on a loaded machine): pay it
        # here, so no test's own timeout does.
        server.client(timeout=900).responses.create(model="tiny-llama", input="Hi.",
                                                    max_output_tokens=2, store=False)
        return server

    def client(self, key: str = "none") -> openai.OpenAI:
        return self.server.client(key)

    def create(self, key: str = "none", **kw):
        kw.setdefault("temperature", 0)
        kw.setdefault("max_output_tokens", 8)
        return self.client(key).responses.create(model="tiny-llama", **kw)


@pytest.fixture(scope="session")
def served(tmp_path_factory) -> Iterator[Served]:
    folder = tiny_model_folder(tmp_path_factory.mktemp("model"))
    s = Served(folder, tmp_path_factory.mktemp("srv"))
    yield s
    s.stop()
    assert s.server.proc.returncode == 0
