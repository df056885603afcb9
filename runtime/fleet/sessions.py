"""What a request names: the session the fleet's router keeps on one replica.

Read by ``runtime.fleet.ingress`` (the order is in its docstring). Kept apart from the
ingress because it imports no Ray: the HTTP tests check that the fleet scopes sessions
by the same API-key function as the engine's stored responses.
"""

from __future__ import annotations

import re
from typing import Any

from runtime.server.http.conversation.keys import key_scope

__all__ = ["session_of"]


def session_of(method: str, path: str, headers: Any, body: Any) -> str | None:
    """The session a request names (see the module docstring), or None."""
    if sid := headers.get("x-session-id"):
        return f"s:{key_scope(headers)}:{sid}"
    if m := re.match(r"^/v1/responses/(resp_[0-9a-f]{32})", path):
        return f"r:{m.group(1)}"
    if m := re.match(r"^/v1/pie/(channels|topics)/(.+)$", path):
        return f"{m.group(1)}:{key_scope(headers)}:{m.group(2)}"
    if isinstance(body, dict):
        prev = body.get("previous_response_id")
        if isinstance(prev, str) and prev:
            return f"r:{prev}"
        conv = body.get("conversation")
        if isinstance(conv, dict):
            conv = conv.get("id")
        if isinstance(conv, str) and conv:
            return f"c:{key_scope(headers)}:{conv}"
        snap = body.get("snapshot")
        if isinstance(snap, str) and snap:
            return f"snap:{key_scope(headers)}:{snap}"
        cache_key = body.get("prompt_cache_key")  # OpenAI's: same key, same replica
        if isinstance(cache_key, str) and cache_key:
            return f"pck:{key_scope(headers)}:{cache_key}"
    return None
