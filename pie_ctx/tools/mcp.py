"""Tools from MCP servers: connect, list them as ``Tool``s, run the model's calls.

Owns one connection to one MCP server (a subprocess over stdio, or a streamable-HTTP
endpoint) for the life of an ``async with`` block, through the official ``mcp`` package
(``pip install 'pie-ctx[mcp]'``). The package is imported only when a connection opens:
importing ``pie_ctx``, ``pie_ctx.tools`` or this module never loads it.

Invariants:

* Every wait is bounded by ``timeout`` seconds: connecting (the handshake included), each
  page of ``tools/list``, each ``tools/call``. A server that exits, crashes, goes silent
  or cannot be reached raises ``ProtocolError``, never hangs, and never cancels the code
  in the ``async with`` block: the connection lives in a task of its own.
* A result is always a ``str``, the content of the tool turn: the text blocks joined by
  newlines, else the structured content as JSON. A result the server marks ``isError``
  (the tool failed) comes back the same way, after ``ERROR_PREFIX``, so that the model
  reads what went wrong and can try again; only a failing connection raises.
* MCP names may hold dots and run to 128 characters; a ``Tool``'s may not. ``tools()``
  renames such tools (``a.b`` becomes ``a_b``) and ``call()`` maps the name back.

Usage::

    from pie_ctx import Context, Sampler
    from pie_ctx.tools.mcp import MCPClient

    async with MCPClient.stdio(["python", "server.py"]) as server:
        tools = await server.tools()               # list[Tool]; await tool.run(args) works
        ctx = Context(rt).system("You use tools.", tools=tools).user("What is 2 + 3?")
        for call in await ctx.generate(Sampler.greedy(), tool_choice="required").calls():
            ctx.tool_result(call.id, await server.call(call.name, call.arguments))
        print(await ctx.generate(Sampler.greedy(), tool_choice="none").text())
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from types import TracebackType
from typing import Any

import anyio

from pie_ctx.proto.errors import InvalidArgument, PieError, ProtocolError, single_exception
from pie_ctx.tools.tool import Tool

__all__ = ["ERROR_PREFIX", "MCPClient", "result_text"]

ERROR_PREFIX = "Error: "
"""What starts the text of a result the server marked ``isError``."""

_INSTALL = "pip install 'pie-ctx[mcp]' (or pip install mcp)"
_BAD_CHARS = re.compile(r"[^A-Za-z0-9_-]")
_OPEN_KEYS = {"additionalProperties", "patternProperties", "unevaluatedProperties"}
_MAX_PAGES = 100  # a server whose tools/list never ends cannot hang tools()


def _mcp() -> Any:
    """The ``mcp`` package, imported on first use (an optional dependency)."""
    try:
        import mcp
    except ImportError as err:
        raise ImportError(f"MCP tools need the mcp package: {_INSTALL}") from err
    if not hasattr(mcp, "Client"):  # mcp 1.x: another API
        raise ImportError("MCP tools need mcp 2.0 or later, and this is an older mcp: "
                          "pip install -U 'pie-ctx[mcp]' (or pip install -U mcp)")
    return mcp


class MCPClient:
    """A connection to one MCP server: its tools as ``Tool``s, and calls to them.

    Build one with :meth:`stdio` or :meth:`http`, then use it as an async context
    manager: entering connects (and starts the server, for stdio); leaving disconnects
    (and stops it). One client serves any number of concurrent calls.

    Args:
        transport: returns the ``mcp`` package's transport (an async context manager of
            its message streams); ``stdio()`` and ``http()`` build it.
        label: how messages name this server.
        timeout: the most seconds any one wait may take.
    """

    def __init__(self, transport: Callable[[], Any], *, label: str, timeout: float) -> None:
        if not timeout > 0:
            raise InvalidArgument(f"timeout must be > 0 seconds, got {timeout!r}")
        self._transport = transport
        self._label = label
        self._timeout = float(timeout)
        self._group: Any = None  # the task group the connection's task runs in
        self._client: Any = None  # the mcp package's Client, while connected
        self._done: anyio.Event | None = None  # set when the block ends
        self._failure: BaseException | None = None  # what broke the connection, if it broke
        self._names: dict[str, str] = {}  # Tool name -> the server's name, where they differ

    # ------------------------------------------------------------------ constructors

    @classmethod
    def stdio(cls, command: Sequence[str], *, env: Mapping[str, str] | None = None,
              cwd: str | Path | None = None, timeout: float = 60.0) -> MCPClient:
        """A server the client starts as a subprocess and talks to over its stdin/stdout.

        Args:
            command: the program and its arguments, e.g. ``["python", "server.py"]``.
            env: variables for the server, over the few it inherits (``HOME``, ``PATH``,
                ``USER``...: the ``mcp`` package's choice, which keeps this process's
                secrets from the server).
            cwd: the server's working directory.
            timeout: the most seconds any one wait may take.

        Raises:
            InvalidArgument: the command is not a non-empty list of strings.
        """
        if isinstance(command, str) or not command or \
                not all(isinstance(part, str) for part in command):
            raise InvalidArgument(f"command is a list of strings, program first, e.g. "
                                  f"['python', 'server.py'], got {command!r}")
        argv = list(command)
        extra = dict(env) if env is not None else None

        def transport() -> Any:
            from mcp.client.stdio import StdioServerParameters, stdio_client

            return stdio_client(StdioServerParameters(command=argv[0], args=argv[1:],
                                                      env=extra, cwd=cwd))

        return cls(transport, label=repr(" ".join(argv)), timeout=timeout)

    @classmethod
    def http(cls, url: str, *, headers: Mapping[str, str] | None = None,
             timeout: float = 60.0) -> MCPClient:
        """A server at a streamable-HTTP endpoint, e.g. ``http://127.0.0.1:8000/mcp``.

        Args:
            url: the endpoint, path included (servers usually serve ``/mcp``).
            headers: HTTP headers for every request, e.g. ``{"Authorization": "Bearer
                ..."}``.
            timeout: the most seconds any one wait may take.

        Raises:
            InvalidArgument: the URL is not http(s).
        """
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise InvalidArgument(f"an MCP endpoint is an http:// or https:// URL, got {url!r}")
        extra = dict(headers or {})

        def transport() -> Any:
            from mcp.client.streamable_http import streamable_http_client

            if not extra:
                return streamable_http_client(url)
            # The mcp package takes headers through an HTTP client of its own kind (httpx2),
            # which it then leaves open: close it after the transport.
            import httpx2

            client = httpx2.AsyncClient(headers=extra,  # the package's default timeouts
                                        timeout=httpx2.Timeout(30.0, read=300.0))
            return _closing(client, streamable_http_client(url, http_client=client))

        return cls(transport, label=url, timeout=timeout)

    # ------------------------------------------------------------------- lifetime

    async def __aenter__(self) -> MCPClient:
        """Connect (start the server, for stdio) and finish MCP's handshake.

        Raises:
            ImportError: the ``mcp`` package is not installed.
            ProtocolError: the server could not be started or reached, failed the
                handshake, or did not finish it within ``timeout`` seconds.
        """
        if self._done is not None:
            raise InvalidArgument("an MCPClient connects once; build another one with "
                                  "MCPClient.stdio() or MCPClient.http()")
        mcp = _mcp()
        self._done = anyio.Event()
        group = anyio.create_task_group()
        await group.__aenter__()
        try:
            with anyio.fail_after(self._timeout):
                await group.start(self._serve, mcp)
        except BaseException as err:
            group.cancel_scope.cancel()
            try:
                await group.__aexit__(None, None, None)
            except BaseException:  # nothing else ran in the group: err says it all
                pass
            if isinstance(err, TimeoutError):
                raise ProtocolError(f"the MCP server {self._label} did not finish connecting "
                                    f"within {self._timeout:g} s: is it an MCP server? Pass "
                                    f"a larger timeout= if it starts slowly") from None
            if not isinstance(err, Exception):  # cancelled from outside, interrupted
                raise
            raise self._error(err, "connecting", self._timeout) from err
        self._group = group
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> bool:
        """Disconnect; stop the server, for stdio (bounded: it is killed if it lingers).

        The exception that ended the block, if any, leaves as it was raised.
        """
        group, self._group = self._group, None
        if group is None or self._done is None:
            return False
        self._done.set()
        try:
            await group.__aexit__(exc_type, exc, tb)
        except BaseException as err:
            # The task group wraps the block's own exception in a group.
            if exc is not None and _single(err) is exc:
                return False
            raise
        return False

    async def _serve(self, mcp: Any, *, task_status: Any) -> None:
        """Hold the connection open until the block ends, in a task of its own.

        The mcp package's transport fails by cancelling the task that opened it (a dead
        HTTP server, say): that must be this task, not the caller's block. Its failure is
        kept in ``_failure``, and the calls it cut short, and any after it, raise.
        """
        done = self._done
        if done is None:
            raise RuntimeError("MCPClient._serve runs only from __aenter__")
        started = False
        try:
            async with mcp.Client(self._transport(),
                                  read_timeout_seconds=self._timeout) as client:
                self._client = client
                started = True
                task_status.started()
                await done.wait()
        except Exception as err:
            if not started:
                raise
            self._failure = _single(err)
        finally:
            self._client = None

    # ---------------------------------------------------------------------- tools

    @property
    def instructions(self) -> str | None:
        """The server's instructions for the model (what its tools are for), if it sent
        any: worth adding to the system prompt."""
        return self._connected().instructions

    async def tools(self, *, prefix: str = "", closed: bool = False) -> list[Tool]:
        """The server's tools, each runnable: ``await tool.run(arguments)`` calls it here.

        Args:
            prefix: put before every name, e.g. ``"fs_"``, to keep the tools of several
                servers apart; ``call()`` accepts the prefixed names.
            closed: add ``"additionalProperties": false`` to each schema that lists its
                ``properties`` and says nothing of other keys, so that a constrained
                model writes only the declared arguments. JSON Schema allows other keys
                by default, most servers' schemas leave them allowed (and ignore them),
                and a small model under that constraint may write extra keys until it
                runs out of tokens.

        Returns:
            One ``Tool`` per server tool, in the server's order: its name (made valid for
            a ``Tool``: characters outside ``A-Z a-z 0-9 _ -`` become ``_``, and a name
            over 64 characters is cut and ends in a hash), its description, and its
            ``inputSchema`` as ``parameters``.

        Raises:
            ProtocolError: the connection failed, or the server listed a tool whose
                schema is not a JSON object schema.
        """
        listed: list[Any] = []
        cursor: str | None = None
        for _ in range(_MAX_PAGES):
            client = self._connected()
            try:
                page = await client.list_tools(cursor=cursor)
            except Exception as err:
                raise self._error(err, "listing tools", self._timeout) from err
            listed.extend(page.tools)
            cursor = page.next_cursor
            if cursor is None:
                break
        out: list[Tool] = []
        names: dict[str, str] = {}
        for spec in listed:
            name = _tool_name(prefix + spec.name, taken=names)
            names[name] = spec.name
            schema = dict(spec.input_schema or {})
            if closed and schema.get("properties") and not _OPEN_KEYS & schema.keys():
                schema["additionalProperties"] = False
            try:
                out.append(Tool(name=name, description=spec.description or spec.title or "",
                                parameters=schema, fn=self._runner(spec.name)))
            except InvalidArgument as err:
                raise ProtocolError(f"the MCP server {self._label} listed a tool that cannot "
                                    f"be offered to a model: {err}") from None
        self._names.update({k: v for k, v in names.items() if k != v})
        return out

    async def call(self, name: str, arguments: Mapping[str, Any] | None = None, *,
                   timeout: float | None = None) -> str:
        """Run one tool on the server; its result is the tool turn's text.

        Args:
            name: the tool's name, as ``tools()`` gave it or as the server spells it.
            arguments: the arguments (``call.arguments``).
            timeout: the most seconds to wait for this call; the client's by default.

        Returns:
            The text blocks of the result joined by newlines (other blocks as a short
            note in brackets, e.g. ``[image/png image, 2048 bytes]``); with no text, the
            structured content as JSON. A result marked ``isError`` starts with
            ``ERROR_PREFIX``: the model reads the server's message and can try again.

        Raises:
            InvalidArgument: a timeout that is not > 0; or the server refused the request
                itself (most servers answer bad arguments and unknown tools with an
                ``isError`` result instead).
            ProtocolError: the connection failed, or the call took over ``timeout`` s.
        """
        if timeout is not None and not timeout > 0:
            raise InvalidArgument(f"timeout must be > 0 seconds, got {timeout!r}")
        client = self._connected()
        wait = self._timeout if timeout is None else float(timeout)
        server_name = self._names.get(name, name)
        try:
            result = await client.call_tool(server_name, dict(arguments or {}),
                                            read_timeout_seconds=wait)
        except Exception as err:
            raise self._error(err, f"calling tool {server_name!r}", wait) from err
        return result_text(result)

    # -------------------------------------------------------------------- helpers

    def _connected(self) -> Any:
        if self._failure is not None:
            raise ProtocolError(f"the connection to the MCP server {self._label} broke: "
                                f"{_describe(self._failure)}; connect again with a new "
                                f"MCPClient")
        if self._client is None:
            raise InvalidArgument("this MCPClient is not connected: use it inside "
                                  "`async with MCPClient.stdio(...) as server:`")
        return self._client

    def _runner(self, server_name: str) -> Callable[..., Any]:
        async def run(**arguments: Any) -> str:
            return await self.call(server_name, arguments)

        return run

    def _error(self, err: Exception, doing: str, timeout: float) -> Exception:
        """The typed error for ``err``, raised while ``doing``."""
        inner = _single(err)
        if isinstance(inner, PieError):
            return inner
        mcp = _mcp()
        code = inner.code if isinstance(inner, mcp.MCPError) else None
        if self._failure is not None or code == mcp.types.CONNECTION_CLOSED:
            cause = (_describe(self._failure) if self._failure is not None else
                     "it exited, crashed or dropped the connection (its log says why)")
            then = ("check that it is an MCP server" if doing == "connecting" else
                    "connect again with a new MCPClient")
            return ProtocolError(f"the MCP server {self._label} closed the connection while "
                                 f"{doing}: {cause}; {then}")
        if code == mcp.types.REQUEST_TIMEOUT or isinstance(inner, TimeoutError):
            return ProtocolError(f"the MCP server {self._label} did not answer within "
                                 f"{timeout:g} s while {doing}; pass a larger timeout= if "
                                 f"it is slow")
        if code == mcp.types.INVALID_PARAMS:
            return InvalidArgument(f"the MCP server {self._label} refused {doing}: "
                                   f"{inner.message}")
        if code is not None:
            return ProtocolError(f"the MCP server {self._label} answered with error {code} "
                                 f"while {doing}: {inner.message}")
        if doing == "connecting":
            return ProtocolError(f"cannot start or reach the MCP server {self._label}: "
                                 f"{_describe(inner)}; check the command or the URL, and "
                                 f"that the server runs")
        return ProtocolError(f"the connection to the MCP server {self._label} failed while "
                             f"{doing}: {_describe(inner)}")


def result_text(result: Any) -> str:
    """The tool turn's text for an MCP ``CallToolResult`` (see ``MCPClient.call``)."""
    blocks = result.content
    if result.structured_content is not None and not any(b.type == "text" for b in blocks):
        text = json.dumps(result.structured_content, ensure_ascii=False)
    else:
        text = "\n".join(_block_text(b) for b in blocks)
    if result.is_error:
        return ERROR_PREFIX + (text or "the tool failed and gave no message")
    return text


def _block_text(block: Any) -> str:
    """One content block as text: text as it is, anything else as a note in brackets."""
    kind = block.type
    if kind == "text":
        return block.text
    if kind in ("image", "audio"):  # base64 holds 3 bytes in 4 characters
        return f"[{block.mime_type} {kind}, {len(block.data) * 3 // 4} bytes]"
    if kind == "resource":
        resource = block.resource
        text = getattr(resource, "text", None)
        if text is not None:
            return text
        return f"[resource {resource.uri} ({resource.mime_type or 'binary'})]"
    if kind == "resource_link":
        return f"[resource {block.uri}]"
    return f"[{kind} content]"


def _tool_name(name: str, *, taken: Mapping[str, str]) -> str:
    """``name`` made valid for a ``Tool`` (1-64 of ``A-Z a-z 0-9 _ -``), unique in
    ``taken``: cut and ended with a hash of the original where needed."""
    clean = _BAD_CHARS.sub("_", name) or "_"
    if len(clean) <= 64 and clean not in taken:
        return clean
    return f"{clean[:55]}_{hashlib.sha256(name.encode()).hexdigest()[:8]}"


def _single(err: BaseException) -> BaseException:
    """The one failure inside (nested) exception groups; the first where there are more."""
    inner = single_exception(err) if isinstance(err, BaseExceptionGroup) else err
    while isinstance(inner, BaseExceptionGroup):
        inner = inner.exceptions[0]
    return inner


def _describe(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}" if str(err) else type(err).__name__


def _closing(client: Any, transport: Any) -> Any:
    """``transport``, and the HTTP ``client`` closed after it."""

    @asynccontextmanager
    async def both() -> AsyncIterator[Any]:
        async with client, transport as streams:
            yield streams

    return both()
