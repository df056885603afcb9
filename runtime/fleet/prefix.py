"""Which replica holds which pages: an index built from the replicas' KV events.

Owns: one ZeroMQ subscriber thread per replica (``follow``) and, per replica, the pages
its events say it holds: ``(parent hash, page tokens) -> page hash``. It reads vLLM's
schema (``runtime.kv.events``), so it would index any engine that publishes vLLM's events.

Matching (``match``) walks a prompt's full pages from the chain's start: a page is held
when a ``BlockStored`` listed it after the previous one, and no later ``BlockRemoved``
took it out. No engine's hash function is needed: pages are found by their tokens and
their parent, as the events give them (a replica's first page has the parent None).

A subscriber that joins late (the router started after the replica, or reconnects) asks
the replica's replay socket for every buffered batch from sequence 0 first, then follows
the live stream, skipping batches it has already applied. ``AllBlocksCleared`` (sent when
an engine starts) empties that replica's entry: a restarted replica holds nothing.

The schema's module is imported with the first batch, not with this one: ``runtime.kv``'s
package brings the page pool (torch), seconds of a start-up the front (which imports this
module through ``view``) and ``pie-ctx fleet`` (which pickles the router) need not wait for.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

__all__ = ["PrefixIndex"]

log = logging.getLogger("pie_ctx.fleet")


@dataclass(slots=True)
class _Pages:
    """One replica's pages, as its events describe them."""

    page_size: int = 0
    by_key: dict[tuple[int | bytes | None, tuple[int, ...]], int | bytes] = field(
        default_factory=dict)
    key_of: dict[int | bytes, tuple[int | bytes | None, tuple[int, ...]]] = field(
        default_factory=dict)
    last_seq: int = -1


class PrefixIndex:
    """Replica id -> the pages it holds (see the module docstring). Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pages: dict[str, _Pages] = {}
        self._followed: dict[str, tuple[str, threading.Event]] = {}

    # -- events ------------------------------------------------------------------------

    def apply(self, replica: str, seq: int, payload: bytes) -> None:
        """Apply one batch (``seq`` as sent; a batch at or below the last applied one is
        a replayed duplicate and skipped)."""
        from runtime.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, decode_batch

        batch = decode_batch(payload)
        with self._lock:
            pages = self._pages.setdefault(replica, _Pages())
            if seq <= pages.last_seq:
                return
            pages.last_seq = seq
            for event in batch.events:
                if isinstance(event, BlockStored):
                    ps = pages.page_size = event.block_size
                    parent = event.parent_block_hash
                    for i, h in enumerate(event.block_hashes):
                        key = (parent, tuple(event.token_ids[i * ps:(i + 1) * ps]))
                        pages.by_key[key] = h
                        pages.key_of[h] = key
                        parent = h
                elif isinstance(event, BlockRemoved):
                    for h in event.block_hashes:
                        key = pages.key_of.pop(h, None)
                        if key is not None and pages.by_key.get(key) == h:
                            del pages.by_key[key]
                elif isinstance(event, AllBlocksCleared):
                    pages.by_key.clear()
                    pages.key_of.clear()

    def match(self, tokens: list[int]) -> dict[str, int]:
        """Replica id -> how many of the prompt's leading full pages it holds (>0 only)."""
        out: dict[str, int] = {}
        with self._lock:
            for replica, pages in self._pages.items():
                ps, n, parent = pages.page_size, 0, None
                if ps <= 0:
                    continue
                while (n + 1) * ps <= len(tokens):
                    h = pages.by_key.get((parent, tuple(tokens[n * ps:(n + 1) * ps])))
                    if h is None:
                        break
                    parent, n = h, n + 1
                if n:
                    out[replica] = n
        return out

    def num_pages(self, replica: str) -> int:
        with self._lock:
            pages = self._pages.get(replica)
            return 0 if pages is None else len(pages.by_key)

    # -- subscriptions -----------------------------------------------------------------

    def follow(self, replica: str, endpoint: str, replay: str | None) -> None:
        """Subscribe to ``replica``'s events at ``endpoint`` (idempotent; a new endpoint,
        a restarted replica, replaces the old subscription)."""
        with self._lock:
            old = self._followed.get(replica)
            if old is not None and old[0] == endpoint:
                return
            if old is not None:
                old[1].set()
            stop = threading.Event()
            self._followed[replica] = (endpoint, stop)
            self._pages[replica] = _Pages()
        threading.Thread(target=self._run, args=(replica, endpoint, replay, stop), daemon=True,
                         name=f"pie-ctx-kv-sub-{replica}").start()

    def forget(self, keep: set[str]) -> None:
        """Stop following, and drop, every replica not in ``keep`` (gone)."""
        with self._lock:
            for replica in [r for r in self._followed if r not in keep]:
                self._followed.pop(replica)[1].set()
                self._pages.pop(replica, None)

    def _run(self, replica: str, endpoint: str, replay: str | None,
             stop: threading.Event) -> None:
        import zmq

        ctx = zmq.Context.instance()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(endpoint)
        try:
            if replay:
                self._replay(ctx, replica, replay)
            while not stop.is_set():
                if not sub.poll(200):
                    continue
                frames = sub.recv_multipart()
                if len(frames) == 3:
                    self.apply(replica, int.from_bytes(frames[1], "big"), frames[2])
        except Exception as e:  # a replica that dies takes its socket with it
            log.info("kv events of %s: %s", replica, e)
        finally:
            sub.close(linger=0)

    def _replay(self, ctx: object, replica: str, endpoint: str) -> None:
        """Every batch the replica still buffers, from sequence 0."""
        import zmq

        sock = ctx.socket(zmq.DEALER)  # type: ignore[attr-defined]
        sock.connect(endpoint)
        try:
            sock.send_multipart((b"", (0).to_bytes(8, "big")))
            while sock.poll(5000):
                _, seq, payload = sock.recv_multipart()
                seq_n = int.from_bytes(seq, "big", signed=True)
                if seq_n < 0:
                    return
                self.apply(replica, seq_n, payload)
        finally:
            sock.close(linger=0)
