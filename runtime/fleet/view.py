"""What the fleet's routers in this process have learnt, shared with the ingress.

Owns three process-wide objects: ``VIEW`` (replica id -> what its
``record_routing_stats`` last said: its engine's URL, socket, KV-event endpoints),
``ROUTING_MS`` (the time each routing decision took) and ``INDEX`` (the pages each replica
holds, from its KV events). Ray Serve builds a handle's router in the process that holds
the handle (the ingress) from a copy of the router's module, so state the two share
lives here, in a module both import by name.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from runtime.fleet.prefix import PrefixIndex

__all__ = ["VIEW", "ROUTING_MS", "INDEX"]

VIEW: dict[str, dict[str, Any]] = {}
ROUTING_MS: deque[float] = deque(maxlen=100_000)
INDEX = PrefixIndex()
