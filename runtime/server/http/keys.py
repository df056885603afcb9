"""API keys with shares: who may call the HTTP API, and which tenant each request is.

Owns: the ``ApiKey`` spec (``serve --api-key KEY:SHARE[:PRIORITY[:NAME]]``, or one per line
of ``--api-keys-file``), its parsing, and ``KeyCheck``, the ASGI middleware that admits a
request only with a known key and runs it as that key's tenant: ``CURRENT_KEY`` names the
key (the app answers with that key's runtime, one owner per key), and an
``x-pie-priority`` header sets the priority of the contexts the request creates
(``runtime.engine.tenants.REQUEST_PRIORITY``). Docs: docs/http.md, "Keys and shares".
"""

from __future__ import annotations

import hmac
import math
from collections.abc import Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pie_ctx.proto.checks import MAX_HOLD_PRIORITY
from pie_ctx.proto.errors import InvalidArgument
from runtime.engine.tenants import REQUEST_PRIORITY

__all__ = ["ApiKey", "CURRENT_KEY", "KeyCheck", "parse_key", "read_keys_file"]

# The name of the key the request being answered came with ("" without keys).
CURRENT_KEY: ContextVar[str] = ContextVar("pie_ctx_api_key", default="")

PRIORITY_HEADER = b"x-pie-priority"


@dataclass(frozen=True, slots=True)
class ApiKey:
    """One key: its secret, its name (for /metrics and logs), its share of the step rows
    and of the pool (None: no share, the whole engine, as a lone ``--api-key-file`` key),
    and its contexts' default priority."""

    key: str
    name: str
    share: float | None = None
    priority: int = 0


def parse_key(spec: str, default_name: str) -> ApiKey:
    """``KEY:SHARE[:PRIORITY[:NAME]]`` as an ``ApiKey``.

    Raises:
        InvalidArgument: an empty key, a share that is not a positive number, a priority
            not an int in [0, 100].
    """
    parts = spec.strip().split(":")
    if len(parts) < 2 or len(parts) > 4 or not parts[0]:
        raise InvalidArgument("an API key is given as KEY:SHARE[:PRIORITY[:NAME]] (e.g. "
                              f"'k3y:2' or 'k3y:1:10:batch'), got {len(parts)} fields")
    try:
        share = float(parts[1])
    except ValueError:
        share = math.nan
    if not math.isfinite(share) or share <= 0:
        raise InvalidArgument(f"an API key's share is a positive number, got {parts[1]!r}")
    priority = parts[2] if len(parts) > 2 else "0"
    if not priority.isdigit() or int(priority) > MAX_HOLD_PRIORITY:
        raise InvalidArgument(f"an API key's priority is an int in [0, {MAX_HOLD_PRIORITY}], "
                              f"got {priority!r}")
    name = parts[3] if len(parts) > 3 and parts[3] else default_name
    return ApiKey(parts[0], name, share, int(priority))


def read_keys_file(path: str | Path, first: int = 1) -> list[ApiKey]:
    """The keys of a keys file: one ``KEY:SHARE[:PRIORITY[:NAME]]`` per line; blank lines
    and lines starting with ``#`` are skipped; unnamed keys are ``key<N>`` from ``first``.

    Raises:
        InvalidArgument: the file cannot be read, or a line is not a key (its number said).
    """
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as err:
        raise InvalidArgument(f"cannot read the API keys file {path}: {err.strerror}") from None
    keys = []
    for number, line in enumerate(lines, 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        try:
            keys.append(parse_key(line, f"key{first + len(keys)}"))
        except InvalidArgument as err:
            raise InvalidArgument(f"{path}:{number}: {err}") from None
    return keys


def check_keys(keys: Sequence[ApiKey]) -> None:
    """Keys and names must differ.

    Raises:
        InvalidArgument: two keys are the same, or two names are.
    """
    if len({k.key for k in keys}) != len(keys):
        raise InvalidArgument("the same API key is given twice")
    if len({k.name for k in keys}) != len(keys):
        raise InvalidArgument("two API keys have the same name")


class KeyCheck:
    """ASGI middleware: every request but ``open_paths`` carries one of ``keys`` (as
    ``Authorization: Bearer KEY``, or ``x-api-key: KEY`` as Anthropic's clients send it),
    and runs as that key (``CURRENT_KEY``) with the priority of its ``x-pie-priority``
    header, if any. Without keys every request is let through (loopback)."""

    def __init__(self, app: Any, keys: Sequence[ApiKey], open_paths: frozenset[str],
                 refuse: Any) -> None:
        self.app, self.open_paths, self.refuse = app, open_paths, refuse
        self._keys = [(k.key.encode(), k.name) for k in keys]

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        given, priority = b"", None
        for name, value in scope.get("headers", ()):
            if name == b"authorization" and value[:7].lower() == b"bearer ":
                given = value[7:].strip()
            elif name == b"x-api-key" and not given:  # Anthropic's clients
                given = value.strip()
            elif name == PRIORITY_HEADER:
                priority = value.strip()
        found = self._match(given) if self._keys else ""
        if found is None:
            message = ("missing API key: send 'Authorization: Bearer KEY' or 'x-api-key: KEY'"
                       if not given else "invalid API key")
            await self.refuse(scope, receive, send, 401, message, "invalid_api_key")
            return
        if priority is not None and (not priority.isdigit()
                                     or int(priority) > MAX_HOLD_PRIORITY):
            await self.refuse(scope, receive, send, 400, "the x-pie-priority header is an int "
                              f"in [0, {MAX_HOLD_PRIORITY}] (higher goes first)",
                              "invalid_priority")
            return
        key_token = CURRENT_KEY.set(found)
        priority_token = REQUEST_PRIORITY.set(None if priority is None else int(priority))
        try:
            await self.app(scope, receive, send)
        finally:
            REQUEST_PRIORITY.reset(priority_token)
            CURRENT_KEY.reset(key_token)

    def _match(self, given: bytes) -> str | None:
        """The name of the key ``given`` is (compared in constant time), or None."""
        found = None
        for key, name in self._keys:
            if hmac.compare_digest(given, key):
                found = name
        return found
