"""A dense reference of the page store: plain token lists, no pages, no trie.

Used as an oracle by the state-machine and KV-content tests. Each context is a list of
committed pages (each a tuple of ``(token, position, extra)`` entries) plus a flat list of
working entries and a working page count. Page sharing is implied by content: two holders
whose committed chains start with the same pages share those physical pages, so the
number of committed pages the store must keep pinned is the number of distinct chain
prefixes over all holders. That makes back-pressure predictable without modelling the
cache: ``available = total - distinct prefixes - working pages``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from runtime.kv.compaction import compacted_extras
from runtime.kv.hashing import fold_extras, hash_page

Entry = tuple[int, int, int]  # (token, position, extra)
Page = tuple[Entry, ...]


@dataclass(slots=True)
class RefContext:
    """One context or snapshot in the dense reference."""

    committed: list[Page] = field(default_factory=list)
    working: list[Entry] = field(default_factory=list)
    num_working_pages: int = 0

    def copy(self) -> RefContext:
        return RefContext(list(self.committed), list(self.working), self.num_working_pages)

    def tokens(self) -> list[int]:
        return [e[0] for page in self.committed for e in page] + [e[0] for e in self.working]

    def seq_len(self, page_size: int) -> int:
        return len(self.committed) * page_size + len(self.working)

    def next_position(self) -> int:
        if self.working:
            return self.working[-1][1] + 1
        if self.committed:
            return self.committed[-1][-1][1] + 1
        return 0


@dataclass(slots=True)
class DenseReference:
    """Contexts and snapshots as plain lists; the oracle the store must agree with."""

    num_pages: int
    page_size: int
    contexts: dict[int, RefContext] = field(default_factory=dict)
    snapshots: dict[tuple[str, str], RefContext] = field(default_factory=dict)

    def holders(self) -> list[RefContext]:
        return list(self.contexts.values()) + list(self.snapshots.values())

    def prefixes(self) -> set[tuple[Page, ...]]:
        """Distinct committed chain prefixes: the committed pages that must stay pinned."""
        out: set[tuple[Page, ...]] = set()
        for ctx in self.holders():
            for i in range(1, len(ctx.committed) + 1):
                out.add(tuple(ctx.committed[:i]))
        return out

    def num_working_pages(self) -> int:
        return sum(ctx.num_working_pages for ctx in self.holders())

    def num_available(self) -> int:
        """Free + cached pages in the real store."""
        return self.num_pages - len(self.prefixes()) - self.num_working_pages()

    def commit(self, ctx: RefContext, k: int) -> None:
        ps = self.page_size
        for i in range(k):
            ctx.committed.append(tuple(ctx.working[i * ps : (i + 1) * ps]))
        del ctx.working[: k * ps]
        ctx.num_working_pages -= k

    def live_prefix_hits(self, ctx: RefContext, entries: list[Entry]) -> int:
        """Pages of ``entries`` that live holders' chains guarantee the trie still has."""
        prefixes = self.prefixes()
        ps, chain, hits = self.page_size, list(ctx.committed), 0
        for i in range(len(entries) // ps):
            chain.append(tuple(entries[i * ps : (i + 1) * ps]))
            if tuple(chain) not in prefixes:
                break
            hits += 1
        return hits

    def compact(self, ctx: RefContext, keep: list[int]) -> tuple[RefContext, int]:
        """What ``PageStore.compact`` makes of ``ctx`` (valid ``keep``), and the fresh
        pages it needs: leading wholly kept committed pages stay; every other kept entry
        is copied, with its extra renamed by its original history once an entry before
        it was dropped; the full pages of formerly committed entries are committed."""
        ps = self.page_size
        entries = [e for page in ctx.committed for e in page] + list(ctx.working)
        nc = len(ctx.committed)
        hashes, parent = [], None
        for p in range(len(entries) // ps):
            page = entries[p * ps:(p + 1) * ps]
            parent = hash_page(parent, [e[0] for e in page], [e[1] for e in page],
                               fold_extras([e[2] for e in page]))
            hashes.append(parent)
        first_drop = next((j for j, i in enumerate(keep) if i != j), len(keep))
        shared = min(first_drop // ps, nc)
        rest = keep[shared * ps:]
        new: list[Entry] = []
        for j, i in enumerate(rest, start=shared * ps):
            t, pos, extra = entries[i]
            if j != i:
                lo = i // ps * ps
                part = entries[lo:i + 1]
                history = hash_page(None if lo == 0 else hashes[i // ps - 1],
                                    [e[0] for e in part], [e[1] for e in part],
                                    fold_extras([e[2] for e in part]))
                extra = compacted_extras(history, extra)
            new.append((t, pos, extra))
        n_new = -(-len(rest) // ps)
        out = RefContext(list(ctx.committed[:shared]), new, n_new)
        self.commit(out, sum(1 for i in rest if i < nc * ps) // ps)
        return out, n_new

