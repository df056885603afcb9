"""KV events: the trie's commits and evictions, published in vLLM's schema over ZeroMQ.

Owns: the event records (``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` in a
``KVEventBatch``), the buffer the trie appends to (``KVEventLog``, one of the trie's listeners, given to the
page store at construction), and the publisher thread with its PUB and replay sockets
(``ZmqEventPublisher``), which waits on the log. The trie owns the pages; it only tells
the log of each page it stores or removes.

The wire format is vLLM's (``vllm/distributed/kv_events.py``, ``KVEventsConfig``), so any
KV-aware router that reads vLLM's events (NVIDIA Dynamo, llm-d, pie-ctx's own fleet
router) reads ours:

* every message is a ZeroMQ multipart ``(topic, seq, payload)``: ``seq`` an 8-byte
  big-endian counter starting at 0, ``payload`` one ``KVEventBatch`` encoded by msgspec's
  MessagePack encoder;
* a batch is a map ``{ts, events[, data_parallel_rank]}``; an event is a map tagged by
  its class name (``{"type": "BlockStored", ...}``), defaults omitted;
* a replay socket (ROUTER) answers a request ``(b"", start_seq as 8 bytes)`` with every
  buffered ``(seq, payload)`` from ``start_seq`` on, then ``(-1 as 8 signed bytes, b"")``.

A page is vLLM's block: ``block_hashes`` are the pages' chained hashes (xxh3-64, as ints),
``parent_block_hash`` the hash of the page before the first one (None for a chain's first
page, as vLLM sends it), ``token_ids`` the pages' tokens in order and ``block_size`` the
engine's page size. Consecutive commits of one chain are sent as one ``BlockStored``.
Order: events leave in the order the trie made them; a publisher that starts sends
``AllBlocksCleared`` first, so a consumer forgets what an earlier run of the same endpoint
held (a replica that restarted has an empty pool).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from itertools import count
from typing import Any

import msgspec

from pie_ctx.proto.errors import InvalidArgument
from runtime.kv.trie import Node, TrieListener

__all__ = ["BlockStored", "BlockRemoved", "AllBlocksCleared", "KVEventBatch", "KVEventLog",
           "ZmqEventPublisher", "decode_batch"]

log = logging.getLogger("pie_ctx.kv_events")


class EventBatch(msgspec.Struct, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """A change to the set of pages an engine holds."""


class BlockStored(KVCacheEvent):
    """Pages committed (now findable by prefix), one chain, in order."""

    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(KVCacheEvent):
    """Pages evicted (no longer findable)."""

    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    """Every page is gone (the engine started, or dropped its cache)."""


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


_DECODER = msgspec.msgpack.Decoder(KVEventBatch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """One payload (the third frame of a message) as a batch."""
    return _DECODER.decode(payload)


class KVEventLog(TrieListener):
    """The events the trie made since the last ``take``, thread-safe.

    A reader waits for news with ``wait`` (the publisher's thread); ``interrupt`` wakes it
    without news.

    Args:
        page_size: tokens per page (``block_size``).
        medium: where the pages live (``"GPU"`` or ``"CPU"``).
    """

    def __init__(self, page_size: int, medium: str) -> None:
        self.page_size = page_size
        self.medium = medium
        self._lock = threading.Lock()
        self._news = threading.Event()
        self._events: list[BlockStored | BlockRemoved | AllBlocksCleared] = []

    def stored(self, node: Node) -> None:
        """The trie registered ``node``: a ``BlockStored`` (joined to the last one when it
        continues the same chain)."""
        parent = node.parent
        self.append_stored(node.page_hash, None if parent is None else parent.page_hash,
                           node.tokens)

    def removed(self, node: Node) -> None:
        """The trie evicted ``node``: a ``BlockRemoved``."""
        self.append_removed(node.page_hash)

    def append_stored(self, page_hash: int, parent_hash: int | None,
                      tokens: tuple[int, ...]) -> None:
        """A page was committed and registered after ``parent_hash`` (None: chain start)."""
        with self._lock:
            last = self._events[-1] if self._events else None
            if isinstance(last, BlockStored) and last.block_hashes[-1] == parent_hash \
                    and parent_hash is not None:
                last.block_hashes.append(page_hash)  # the same chain, one page further
                last.token_ids.extend(tokens)
            else:
                self._events.append(BlockStored(
                    block_hashes=[page_hash], parent_block_hash=parent_hash,
                    token_ids=list(tokens), block_size=self.page_size, lora_id=None,
                    medium=self.medium, lora_name=None))
        self._news.set()

    def append_removed(self, page_hash: int) -> None:
        """A page was evicted."""
        with self._lock:
            last = self._events[-1] if self._events else None
            if isinstance(last, BlockRemoved):
                last.block_hashes.append(page_hash)
            else:
                self._events.append(BlockRemoved(block_hashes=[page_hash], medium=self.medium))
        self._news.set()

    def cleared(self) -> None:
        """Every page is gone."""
        with self._lock:
            self._events.append(AllBlocksCleared())
        self._news.set()

    def wait(self, timeout: float) -> bool:
        """Block until an event is appended (or ``interrupt``) or ``timeout`` seconds
        pass; True when woken. Resets the wake-up for the next call."""
        woken = self._news.wait(timeout)
        self._news.clear()
        return woken

    def interrupt(self) -> None:
        """Wake a reader blocked in ``wait``, news or not."""
        self._news.set()

    def take(self) -> list[BlockStored | BlockRemoved | AllBlocksCleared]:
        """The events since the last call, oldest first (and forget them)."""
        with self._lock:
            events, self._events = self._events, []
        return events


class ZmqEventPublisher:
    """Sends a ``KVEventLog``'s events as vLLM's ``ZmqEventPublisher`` does, from a thread.

    Args:
        event_log: the events to send.
        endpoint: the PUB socket's address; bound when it has a ``*`` (``tcp://*:5557``)
            or is ``ipc://``/``inproc://``, else connected (vLLM's rule).
        replay_endpoint: a ROUTER address for replay requests (None: no replay).
        topic: the first frame of every message.
        buffer_steps: batches kept for replay.
        interval_s: the longest a batch waits for more events.

    Raises:
        InvalidArgument: an endpoint is not a ZeroMQ address, or cannot be bound.
    """

    END_SEQ = (-1).to_bytes(8, "big", signed=True)

    def __init__(self, event_log: KVEventLog, endpoint: str, replay_endpoint: str | None = None,
                 topic: str = "", buffer_steps: int = 10_000,
                 interval_s: float = 0.005) -> None:
        try:
            import zmq  # the optional extra `ray` (pyzmq); only engines that publish need it
        except ImportError:
            raise InvalidArgument("KV events need pyzmq: pip install 'pie-ctx[ray]' (or "
                                  "pyzmq)") from None

        self._zmq = zmq
        self.log = event_log
        self.topic = topic.encode()
        self.interval_s = interval_s
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._seq = count()
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(100_000)
        self._replay = None
        try:
            if "*" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
                self._pub.bind(endpoint)
            else:
                self._pub.connect(endpoint)
            self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT) or endpoint
            if replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.bind(replay_endpoint)
        except zmq.ZMQError as e:
            self._pub.close(linger=0)
            if self._replay is not None:
                self._replay.close(linger=0)
            raise InvalidArgument(f"--kv-events {endpoint}: {e}; pass tcp://*:PORT to bind a "
                                  "port or tcp://HOST:PORT to connect") from None
        self.replay_endpoint = (None if self._replay is None else
                                self._replay.getsockopt_string(zmq.LAST_ENDPOINT))
        self._encoder = msgspec.msgpack.Encoder()
        self._running = True
        event_log.cleared()  # consumers drop what an earlier run at this endpoint held
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name="pie-ctx-kv-events")
        self._thread.start()

    def _run(self) -> None:
        while self._running:
            if self.log.wait(0.1) and self._running:
                time.sleep(self.interval_s)  # let a step's events gather into one batch
            self._service_replay()
            self._send(self.log.take())
        self._send(self.log.take())

    def _send(self, events: list[Any]) -> None:
        if not events:
            return
        payload = self._encoder.encode(KVEventBatch(ts=time.time(), events=events))
        seq = next(self._seq)
        try:
            self._pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))
        except self._zmq.ZMQError as e:  # a consumer's problem must not stop the engine
            log.warning("kv events: batch %d not sent: %s", seq, e)
        self._buffer.append((seq, payload))

    def _service_replay(self) -> None:
        sock = self._replay
        while sock is not None and sock.poll(0):
            frames = sock.recv_multipart()
            if len(frames) != 3:
                log.warning("kv events: a replay request of %d frames ignored", len(frames))
                continue
            client, _, start = frames
            first = int.from_bytes(start, "big")
            for seq, payload in list(self._buffer):
                if seq >= first:
                    sock.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
            sock.send_multipart((client, b"", self.END_SEQ, b""))

    def close(self) -> None:
        """Send what is left, stop the thread and close the sockets."""
        if not self._running:
            return
        self._running = False
        self.log.interrupt()
        self._thread.join(timeout=2)
        self._pub.close(linger=500)
        if self._replay is not None:
            self._replay.close(linger=0)

