"""Suspended contexts: a context's pages leave the pool, and come back without recompute.

Owns: the ``Suspended`` record of one suspended context and the two moves, out
(``suspend_state``) and back (``resume_state``). The page store calls them; the engine
decides when (docs/pages.md, "Suspend and resume").

Out, a context's state is let go like a released one, after keeping what brings it back:

* **its committed chain**, root to tip, as the tokens, positions and extras of each page.
  With a disk tier (a snapshot directory of this engine's own) the whole chain gets a hold
  with no time limit, charged to no client (``HoldTable.hold_suspended``): its pages stay
  cached and findable while the pool has room, and a page evicted under pressure is written
  to the disk tier first and kept there until the hold ends. Without a tier (or with a
  folder shared by a fleet, which does not spill cache pages, or a chain holding a private
  page, which is never cached), each chain page's bytes are copied to host memory instead.
* **its working pages'** bytes (those holding tokens) and their tokens, positions and
  extras, copied to host memory; reserved empty pages are only counted.

Back, a new state is built in the same order: the chain's pages still in the pool are
attached (a verified prefix match), the rest are read from the disk tier or the host copy
into fresh pages and committed (each page's identity verified, so a page comes back only
as exactly what it was), then the working pages are refilled. Nothing is computed.
Resuming needs the pages that are no longer in the pool: without room for them it raises
``OutOfPages`` and changes nothing (the context stays suspended); a page the disk tier has
lost (a damaged or missing file) raises ``SnapshotCorrupt``, again changing nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pie_ctx.proto.errors import OutOfPages, SnapshotCorrupt
from runtime.kv.context import PageState, chain_nodes
from runtime.kv.durable import parent_hash
from runtime.kv.holds import HoldTable
from runtime.kv.states import ContextStates
from runtime.kv.tier import DiskTier
from runtime.kv.trie import Hold

__all__ = ["Suspended", "suspend_state", "resume_state", "drop_suspended"]


@dataclass(slots=True, eq=False)
class Suspended:
    """What brings one suspended context back (see the module docstring)."""

    owner: Any
    adapter: int
    num_chain_pages: int
    chain_tokens: list[int]  # every committed page's, root first (full pages)
    chain_positions: list[int]
    chain_extras: list[int]
    hold: Hold | None  # keeps the chain cached, then on disk (None: host copy, or no chain)
    host_pages: list[bytes] | None  # each chain page's bytes, when not held on disk
    working: list[bytes]  # bytes of the working pages that hold tokens
    num_working_pages: int  # reserved empty pages included
    tokens: list[int] = field(default_factory=list)  # the working tokens
    positions: list[int] = field(default_factory=list)
    extras: list[int] = field(default_factory=list)

    @property
    def num_pages(self) -> int:
        """Pages the context held in the pool: its chain and its working pages."""
        return self.num_chain_pages + self.num_working_pages

    @property
    def num_host_bytes(self) -> int:
        """Host memory its copies take."""
        return sum(map(len, self.working)) + sum(map(len, self.host_pages or ()))


def suspend_state(states: ContextStates, holds: HoldTable, tier: DiskTier | None,
                  state: PageState, priority: int) -> Suspended:
    """Keep what brings ``state`` back, then let go of its pages (``state`` is left empty;
    the caller has unlisted it). ``priority`` orders its held pages among other holds."""
    nodes = chain_nodes(state.tip)
    toks: list[int] = []
    poss: list[int] = []
    extras: list[int] = []
    for node in nodes:
        toks.extend(node.tokens)
        poss.extend(node.positions)
        extras.extend(node.extras)
    on_disk = (tier is not None and not tier.files.shared
               and all(node.registered for node in nodes))
    pool = states.pool
    used = -(-len(state.tokens) // states.page_size)
    suspended = Suspended(
        owner=state.owner, adapter=state.adapter, num_chain_pages=len(nodes),
        chain_tokens=toks, chain_positions=poss, chain_extras=extras,
        hold=holds.hold_suspended(state, priority) if on_disk and nodes else None,
        host_pages=None if on_disk else [bytes(pool.read_page(n.page_id)) for n in nodes],
        working=[bytes(pool.read_page(p)) for p in state.working[:used]],
        num_working_pages=len(state.working), tokens=list(state.tokens),
        positions=list(state.positions), extras=list(state.extras))
    states.release(state)
    return suspended


def resume_state(states: ContextStates, holds: HoldTable, tier: DiskTier | None,
                 s: Suspended) -> tuple[PageState, int, int]:
    """A new state with ``s``'s pages back (the caller lists it), and how many of its pages
    were still in the pool and how many were read from disk; ``s``'s hold ends.

    Raises:
        OutOfPages: the pool has no room for the pages that left it.
        SnapshotCorrupt: the disk tier lost one of its pages. Nothing changes on either.
    """
    ps = states.page_size
    state = PageState(owner=s.owner, adapter=s.adapter)
    hits = states.trie.match_pages(None, s.chain_tokens, s.chain_positions, s.chain_extras, ps)
    if hits:  # pinned now: the room made below never evicts them
        states.set_tip(state, hits[-1])
        state.committed_ids = [node.page_id for node in hits]
    need = s.num_chain_pages - len(hits) + s.num_working_pages
    if not states.room_for(need):
        states.release(state)
        raise OutOfPages(f"resume: the suspended context needs {need} pages back but only "
                         f"{states.num_available()} can be freed; release contexts or "
                         "wait for running requests to end")
    from_disk = 0
    for i in range(len(hits), s.num_chain_pages):
        lo, hi = i * ps, (i + 1) * ps
        page = (s.chain_tokens[lo:hi], s.chain_positions[lo:hi], s.chain_extras[lo:hi])
        if s.host_pages is not None:
            new = states.allocate_or_raise(1, "resume")
            states.pool.write_page(new[0], s.host_pages[i])
        else:  # a held chain: there is a tier
            record = None if tier is None else tier.find(
                parent_hash(state.tip, states.trie.root_hash), *page)
            if record is None:
                states.release(state)
                raise SnapshotCorrupt(
                    f"resume: page {i} of the suspended context is no longer on disk (its "
                    "file is missing or damaged); release the context and compute it again")
            new = states.allocate_or_raise(1, "resume")
            tier.install(new[0], record.payload)
            from_disk += 1
        states.commit_page(state, new[0], *(tuple(part) for part in page))
    working = states.allocate_or_raise(s.num_working_pages, "resume")
    states.count_working(state, len(working))
    for page_id, payload in zip(working, s.working, strict=False):
        states.pool.write_page(page_id, payload)
    state.working = working
    state.tokens, state.positions, state.extras = (
        list(s.tokens), list(s.positions), list(s.extras))
    from_memory = s.num_chain_pages - from_disk + len(s.working)
    drop_suspended(holds, s)
    return state, from_memory, from_disk


def drop_suspended(holds: HoldTable, s: Suspended) -> None:
    """Forget a suspended context (released, or resumed): its hold ends, its copies go."""
    if s.hold is not None:
        holds.end(s.hold)
        s.hold = None
    s.host_pages = None
    s.working = []

