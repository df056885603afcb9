"""The MCP servers the operator configured (``pie-ctx serve --mcp NAME=COMMAND|URL``), for
``/v1/responses``' server-side tools (``{"type": "mcp", "server_label": NAME}``).

Owner: the connections to those servers. Each is an SDK ``pie_ctx.tools.mcp.MCPClient``
(docs/mcp.md), opened on first use and held by a task of the app's runtime (so it closes
with the app), shared by every request; a connection that breaks is opened again at the
next request. A request can name only servers listed here: nothing reaches an address the
operator did not list.

Tools are listed once per connection, with ``closed=True`` (undeclared argument keys are
refused by the call's constraint), and keep the server's names.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import anyio

from pie_ctx import Runtime
from pie_ctx.proto.errors import InvalidArgument, PieError, ProtocolError
from pie_ctx.tools import Tool

__all__ = ["McpServers", "parse_mcp_option", "ServerTools"]

_LABEL_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.")


def parse_mcp_option(value: str) -> tuple[str, str]:
    """``NAME=COMMAND`` or ``NAME=URL`` (``--mcp``) -> ``(name, target)``.

    Raises:
        InvalidArgument: not of that form.
    """
    name, sep, target = value.partition("=")
    if not sep or not name or not target.strip() or not set(name) <= _LABEL_CHARS \
            or len(name) > 64:
        raise InvalidArgument(f"--mcp takes NAME=COMMAND (a stdio server) or NAME=URL (a "
                              f"streamable-HTTP one), NAME of 1-64 characters from A-Z a-z "
                              f"0-9 _ - ., got {value!r}")
    if not target.startswith(("http://", "https://")):
        try:
            if not shlex.split(target):
                raise ValueError
        except ValueError:
            raise InvalidArgument(f"--mcp {name}=: cannot read the command {target!r}") \
                from None
    return name, target.strip()


@dataclass(slots=True)
class ServerTools:
    """A configured server's tools, as listed on its current connection."""

    label: str
    tools: list[Tool]
    client: Any
    scope: anyio.CancelScope  # the task holding the connection


class McpServers:
    """The configured servers by name (``--mcp``)."""

    def __init__(self, targets: Mapping[str, str], spawn: Callable[[], Runtime]) -> None:
        self.targets = dict(targets)
        self._spawn = spawn
        self._open: dict[str, ServerTools] = {}
        self._locks = {name: anyio.Lock() for name in self.targets}
        self._scopes: list[anyio.CancelScope] = []

    def close(self) -> None:
        """Close every connection (the app is stopping)."""
        for scope in self._scopes:
            scope.cancel()

    def _client(self, name: str) -> Any:
        from pie_ctx.tools.mcp import MCPClient

        target = self.targets[name]
        if target.startswith(("http://", "https://")):
            return MCPClient.http(target)
        return MCPClient.stdio(shlex.split(target))

    async def tools(self, name: str) -> ServerTools:
        """The server's tools (connecting first if it is not connected).

        Raises:
            PieError: the server cannot be started or reached (``ProtocolError``).
        """
        held = self._open.get(name)
        if held is not None:
            return held
        async with self._locks[name]:
            held = self._open.get(name)
            if held is not None:
                return held
            ready = anyio.Event()
            box: dict[str, Any] = {}
            client = self._client(name)
            scope = anyio.CancelScope()
            self._scopes = [s for s in self._scopes if not s.cancel_called] + [scope]

            async def hold() -> None:
                try:
                    with scope:
                        async with client:
                            box["tools"] = ServerTools(name, await client.tools(closed=True),
                                                       client, scope)
                            self._open[name] = box["tools"]
                            ready.set()
                            await anyio.sleep_forever()
                except Exception as err:  # noqa: BLE001 - reported to the waiting request
                    box["error"] = err
                finally:
                    if self._open.get(name) is box.get("tools"):
                        self._open.pop(name, None)
                    ready.set()

            self._spawn().start_soon(hold)
            await ready.wait()
            if "tools" not in box:
                err = box.get("error")
                if isinstance(err, PieError):
                    raise err
                raise ProtocolError(f"the MCP server {name!r} could not be reached: {err}")
            return box["tools"]

    async def call(self, name: str, tool: str, arguments: dict[str, Any]) -> tuple[str, bool]:
        """Run ``tool`` on server ``name``: ``(text, failed)``. A tool's own failure (MCP's
        ``isError``) and a broken connection are both results the model reads (a broken
        connection is dropped, and opened again by the next request)."""
        from pie_ctx.tools.mcp import ERROR_PREFIX

        held = await self.tools(name)
        try:
            text = await held.client.call(tool, arguments)
        except (ProtocolError, InvalidArgument) as err:
            if isinstance(err, ProtocolError) and self._open.get(name) is held:
                self._open.pop(name, None)  # reconnect next time
                held.scope.cancel()
            return f"{ERROR_PREFIX}{err}", True
        return text, text.startswith(ERROR_PREFIX)
