"""Tools from MCP servers (``pie_ctx.tools.mcp``), against a real server in a subprocess.

The server is tests/tools/mcp_server.py, written with the ``mcp`` package: the client
starts it over stdio, or a fixture starts it serving streamable HTTP on a free loopback
port. Every wait is bounded, so a regression fails instead of hanging.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import types
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from pie_ctx import Context, Sampler
from pie_ctx.errors import InvalidArgument, ProtocolError
from pie_ctx.tools import Tool
from pie_ctx.tools.mcp import ERROR_PREFIX, MCPClient
from tests.sdk.harness import sdk_runtime

SERVER = Path(__file__).with_name("mcp_server.py")
STDIO = [sys.executable, str(SERVER)]
LIMIT = 20.0  # seconds: no test waits longer for anything


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_http() -> tuple[subprocess.Popen, str]:
    """The server on a free loopback port, once it accepts connections."""
    port = _free_port()
    proc = subprocess.Popen([*STDIO, "--http", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + LIMIT
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc, f"http://127.0.0.1:{port}/mcp"
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"the MCP test server did not start on port {port}") \
                    from None
            time.sleep(0.05)


def _stop(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait(timeout=LIMIT)


@pytest.fixture(scope="module")
def http_url() -> Iterator[str]:
    proc, url = _start_http()
    yield url
    _stop(proc)


async def _served_tools() -> list:
    """The server's tools as the server itself lists them."""
    from tests.tools.mcp_server import app

    return await app.list_tools()


async def test_importing_the_sdk_does_not_import_mcp():
    code = ("import sys, pie_ctx, pie_ctx.tools, pie_ctx.tools.mcp\n"
            "print(sorted(m for m in ('mcp', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=LIMIT, cwd=Path(__file__).parents[2])
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


async def test_a_missing_or_old_mcp_package_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "mcp", None)  # `import mcp` now fails
    with pytest.raises(ImportError, match=r"pip install 'pie-ctx\[mcp\]'"):
        async with MCPClient.stdio(STDIO):
            pass
    monkeypatch.setitem(sys.modules, "mcp", types.ModuleType("mcp"))  # 1.x has no Client
    with pytest.raises(ImportError, match=r"mcp 2.0 or later.*pip install -U"):
        async with MCPClient.stdio(STDIO):
            pass


async def test_misuse_is_refused():
    for bad in (lambda: MCPClient.stdio("python server.py"), lambda: MCPClient.stdio([]),
                lambda: MCPClient.http("ftp://x/mcp"), lambda: MCPClient.http(STDIO[0]),
                lambda: MCPClient.stdio(STDIO, timeout=0)):
        with pytest.raises(InvalidArgument):
            bad()
    client = MCPClient.stdio(STDIO)
    with pytest.raises(InvalidArgument, match="not connected"):
        await client.tools()
    with pytest.raises(InvalidArgument, match="not connected"):
        await client.call("echo", {"text": "x"})
    with pytest.raises(InvalidArgument, match="timeout"):
        await client.call("echo", {"text": "x"}, timeout=-1)


async def test_stdio_lists_the_servers_tools_and_runs_them():
    served = await _served_tools()
    with anyio.fail_after(LIMIT):
        async with MCPClient.stdio(STDIO) as server:
            tools = await server.tools()
            assert server.instructions == "Tools for the pie-ctx tests."
            # the same tools, in the same order, with the server's descriptions and schemas
            # (a dotted name cannot be a Tool's: it is renamed, and mapped back on calls)
            assert [t.name for t in tools] == [s.name.replace(".", "_") for s in served]
            for tool, spec in zip(tools, served, strict=True):
                assert isinstance(tool, Tool)
                assert tool.description == spec.description
                assert tool.parameters == spec.input_schema
            by_name = {t.name: t for t in tools}
            assert by_name["echo"].parameters["properties"]["text"]["maxLength"] == 12

            assert await server.call("echo", {"text": "hi"}) == "echo:hi"
            assert json.loads(await server.call("lookup", {"code": "cd"})) == \
                {"code": "cd", "value": 14}
            # a Tool runs itself through the server; its renamed name maps back
            assert await by_name["text_upper"].run({"text": "shout"}) == "SHOUT"
            assert await server.call("text_upper", {"text": "ab"}) == "AB"
            assert await server.call("text.upper", {"text": "ab"}) == "AB"
            # no text block: the structured content, as JSON
            assert json.loads(await server.call("stats")) == {"calls": 3, "ok": True}
            # calls run concurrently on one connection
            many = [None] * 4

            async def one(i: int) -> None:
                many[i] = await server.call("echo", {"text": str(i)})

            async with anyio.create_task_group() as tg:
                for i in range(4):
                    tg.start_soon(one, i)
            assert many == [f"echo:{i}" for i in range(4)]


async def test_an_error_result_comes_back_as_marked_text():
    """A tool's failure is the model's to read (MCP's ``isError``), not an exception."""
    with anyio.fail_after(LIMIT):
        async with MCPClient.stdio(STDIO) as server:
            # (the mcp package's servers say "Error executing tool fail: " before it)
            failed = await server.call("fail", {"reason": "that"})
            assert failed.startswith(ERROR_PREFIX) and failed.endswith("cannot do that")
            tools = {t.name: t for t in await server.tools()}
            assert (await tools["fail"].run({"reason": "it"})).startswith(ERROR_PREFIX)
            too_long = await server.call("echo", {"text": "x" * 40})
            assert too_long.startswith(ERROR_PREFIX) and "at most 12 characters" in too_long
            unknown = await server.call("nope", {})
            assert unknown.startswith(ERROR_PREFIX) and "nope" in unknown
            # the connection is unharmed
            assert await server.call("echo", {"text": "ok"}) == "echo:ok"


async def test_a_slow_call_times_out_and_the_connection_goes_on():
    with anyio.fail_after(LIMIT):
        async with MCPClient.stdio(STDIO, timeout=10) as server:
            start = time.monotonic()
            with pytest.raises(ProtocolError, match="did not answer within 0.3 s"):
                await server.call("nap", {"seconds": 30}, timeout=0.3)
            assert time.monotonic() - start < 5
            assert await server.call("nap", {"seconds": 0}) == "rested"


async def test_a_stdio_server_that_dies_mid_call_raises_a_typed_error():
    with anyio.fail_after(LIMIT):
        async with MCPClient.stdio(STDIO) as server:
            assert await server.call("echo", {"text": "a"}) == "echo:a"
            with pytest.raises(ProtocolError, match="closed the connection"):
                await server.call("die")
            with pytest.raises(ProtocolError, match="closed the connection"):
                await server.call("echo", {"text": "b"})
            with pytest.raises(ProtocolError):
                await server.tools()


async def test_the_block_s_own_exception_leaves_as_raised():
    with anyio.fail_after(LIMIT), pytest.raises(KeyError, match="mine"):
        async with MCPClient.stdio(STDIO):
            raise KeyError("mine")


async def test_connection_failures_are_typed(tmp_path):
    silent = [sys.executable, "-c", "import time; time.sleep(30)"]
    with anyio.fail_after(LIMIT):
        with pytest.raises(ProtocolError, match="cannot start or reach"):
            async with MCPClient.stdio([str(tmp_path / "no-such-server")]):
                pass
        with pytest.raises(ProtocolError, match="closed the connection while connecting"):
            async with MCPClient.stdio([sys.executable, "-c", "pass"]):
                pass
        start = time.monotonic()
        with pytest.raises(ProtocolError, match="did not finish connecting within 0.5 s"):
            async with MCPClient.stdio(silent, timeout=0.5):
                pass
        assert time.monotonic() - start < 8  # the timeout, then a bounded shutdown
        with pytest.raises(ProtocolError, match="cannot start or reach"):
            async with MCPClient.http(f"http://127.0.0.1:{_free_port()}/mcp"):
                pass


async def test_http_lists_the_same_tools_and_runs_them(http_url):
    served = await _served_tools()
    with anyio.fail_after(LIMIT):
        async with MCPClient.http(http_url, headers={"X-Test": "1"}) as server:
            tools = await server.tools()
            assert [(t.name, t.description, t.parameters) for t in tools] == \
                [(s.name.replace(".", "_"), s.description, s.input_schema) for s in served]
            assert await server.call("echo", {"text": "web"}) == "echo:web"
            assert (await server.call("fail", {"reason": "it"})).startswith(ERROR_PREFIX)
            # prefixed names keep several servers' tools apart; long ones are cut and hashed
            long = await server.tools(prefix="a_very_long_server_prefix_" * 2)
            assert all(len(t.name) <= 64 for t in long)
            assert len({t.name for t in long}) == len(long)
            assert await long[[s.name for s in served].index("echo")].run({"text": "p"}) == \
                "echo:p"
        async with MCPClient.http(http_url) as plain:  # the mcp package's own HTTP client
            assert await plain.call("text.upper", {"text": "x"}) == "X"


async def test_an_http_server_that_dies_mid_session_raises_a_typed_error():
    proc, url = _start_http()
    try:
        with anyio.fail_after(LIMIT):
            async with MCPClient.http(url, timeout=5) as server:
                assert await server.call("echo", {"text": "a"}) == "echo:a"
                _stop(proc)
                with pytest.raises(ProtocolError):
                    await server.call("echo", {"text": "b"})
    finally:
        if proc.poll() is None:
            _stop(proc)


@pytest.mark.fp32_only("the MCP round trip does not depend on the model's dtype")
async def test_a_model_calls_an_mcp_tool_end_to_end(tiny_folder):
    greedy = Sampler.greedy()
    with anyio.fail_after(LIMIT):
        async with MCPClient.stdio(STDIO) as server, \
                sdk_runtime(tiny_folder, "local") as (rt, _):
            # tools whose arguments are bounded (the tiny model writes random strings), and
            # closed: no keys but the declared ones
            tools = [t for t in await server.tools(closed=True)
                     if t.name in ("echo", "lookup")]
            assert all(t.parameters["additionalProperties"] is False for t in tools)
            ctx = Context(rt).system("You call tools.", tools=tools).user("Echo hi.")
            gen = ctx.generate(greedy, max_tokens=300, tool_choice="required",
                               parallel_tool_calls=False)
            (call,) = await gen.calls()
            assert gen.finish_reason == "tool_calls" and call.name in ("echo", "lookup")
            result = await server.call(call.name, call.arguments)
            expected = ("echo:" + call.arguments["text"] if call.name == "echo"
                        else json.dumps({"code": call.arguments["code"],
                                         "value": 14}, indent=2))
            assert result == expected
            ctx.tool_result(call.id, result)
            answer = ctx.generate(greedy, max_tokens=8, tool_choice="none")
            await answer.text()
            assert answer.tool_calls == [] and answer.tokens_out
