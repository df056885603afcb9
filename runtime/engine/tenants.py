"""Tenants: the owners (clients) that hold a weighted share of the engine, and what they got.

Owns: the table ``owner -> Tenant`` (a server registers one per API key, docs/http.md,
"Keys and shares"), each tenant's share of the step rows and of the KV pool, its default
priority and its counters; and ``fair_split``, the weighted max-min split of a step's token
budget the scheduler uses when two or more tenants want more than it holds. Owners with no
tenant (SDK and socket clients) are scheduled as before, together as one more group of
weight 1.

The contextvar ``REQUEST_PRIORITY`` carries the priority a server request asked for (the
``x-pie-priority`` header) to the contexts created while it is answered.
"""

from __future__ import annotations

import math
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

__all__ = ["REQUEST_PRIORITY", "Tenant", "Tenants", "fair_split"]

# The priority the request being answered asked for (None: its tenant's, or 0).
REQUEST_PRIORITY: ContextVar[int | None] = ContextVar("pie_ctx_request_priority", default=None)


@dataclass(slots=True, eq=False)
class Tenant:
    """One weighted owner (an API key's)."""

    name: str  # how /metrics labels it (never the key itself)
    share: float  # its weight: step rows and pool pages are split in these proportions
    priority: int = 0  # the priority of its contexts unless a request says otherwise
    max_pages: int | None = None  # its share of the pool (set by ``Tenants.resize``)
    rows: int = 0  # step rows (tokens) computed for it since boot
    requests: int = 0  # passes and generations it submitted


class Tenants:
    """The tenants of one engine (see the module docstring)."""

    def __init__(self) -> None:
        self.by_owner: dict[Any, Tenant] = {}
        self._pool_pages = 0

    def __len__(self) -> int:
        return len(self.by_owner)

    def add(self, owner: Any, tenant: Tenant, pool_pages: int) -> None:
        """Register ``owner`` as ``tenant``; every tenant's page share is recomputed."""
        if not (isinstance(tenant.share, int | float) and math.isfinite(tenant.share)
                and tenant.share > 0):
            raise ValueError(f"a tenant's share must be a positive number, got {tenant.share!r}")
        self.by_owner[owner] = tenant
        self._pool_pages = pool_pages
        self._resize()

    def remove(self, owner: Any) -> None:
        self.by_owner.pop(owner, None)
        self._resize()

    def of(self, owner: Any) -> Tenant | None:
        return self.by_owner.get(owner)

    def _resize(self) -> None:
        total = sum(t.share for t in self.by_owner.values())
        for t in self.by_owner.values():
            t.max_pages = max(1, int(self._pool_pages * t.share / total))


def fair_split(demand: dict[Any, int], weight: dict[Any, float], budget: int) -> dict[Any, int]:
    """Split ``budget`` tokens between groups wanting ``demand`` each: weighted max-min
    fairness (each gets its weight's part of what is left, a group that wants less gives
    the rest back to the others), in whole tokens, at least one to each group that wants
    some while tokens are left. Deterministic: groups are served in ``demand``'s order."""
    alloc = dict.fromkeys(demand, 0)
    left = budget
    hungry = [g for g in demand if demand[g] > 0]
    while left > 0 and hungry:
        total = sum(weight[g] for g in hungry)
        given = 0
        for g in hungry:
            share = max(1, int(left * weight[g] / total))
            take = min(demand[g] - alloc[g], share, left - given)
            alloc[g] += take
            given += take
            if given >= left:
                break
        left -= given
        hungry = [g for g in hungry if alloc[g] < demand[g]]
    return alloc
