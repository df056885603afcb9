"""KV events (runtime.kv.events): every commit and eviction of a run makes its event, in
order, and the bytes on the wire decode with vLLM's own schema.

``Vllm*`` below mirror ``vllm/distributed/kv_events.py`` (vLLM main, commit 0181ea3173e,
read for this test) field by field, in vLLM's order and with vLLM's struct options, so a
decode here is the decode vLLM's consumers (and Dynamo's, llm-d's) do:

* ``EventBatch(msgspec.Struct, omit_defaults=True, gc=False)``: ``ts: float``,
  ``events: list[Any]``, ``data_parallel_rank: int | None = None``;
* ``KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True)``: the base, tagged
  by class name;
* ``BlockStored``: ``block_hashes: list[ExternalBlockHash]``, ``parent_block_hash:
  ExternalBlockHash | None``, ``token_ids: list[int]``, ``block_size: int``, ``lora_id:
  int | None``, ``medium: str | None``, ``lora_name: str | None``, then the defaulted
  ``extra_keys``, ``group_idx``, ``kv_cache_spec_kind``, ``kv_cache_spec_sliding_window``;
* ``BlockRemoved``: ``block_hashes``, ``medium: str | None``, ``group_idx: int | None = None``;
* ``AllBlocksCleared``: no fields;
* ``KVEventBatch(EventBatch)``: ``events: list[BlockStored | BlockRemoved | AllBlocksCleared]``;
* ``ExternalBlockHash = bytes | int`` (``vllm/v1/core/kv_cache_utils.py``);
* ``ZmqEventPublisher``: ``send_multipart((topic, seq.to_bytes(8, "big"), payload))`` with
  ``payload = msgspec.msgpack.Encoder().encode(batch)``; the replay ROUTER answers
  ``(client, b"", start_seq)`` with ``(client, b"", seq, payload)`` frames and ends with
  ``(-1).to_bytes(8, "big", signed=True), b""``.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec
import pytest

from runtime.kv import PageStore
from runtime.kv.context import chain_nodes
from runtime.kv.events import KVEventLog, ZmqEventPublisher

from .helpers import prefill

ExternalBlockHash = bytes | int


class VllmEventBatch(msgspec.Struct, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class VllmKVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(VllmKVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(VllmKVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(VllmKVCacheEvent):
    pass


class VllmKVEventBatch(VllmEventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


VLLM_DECODER = msgspec.msgpack.Decoder(VllmKVEventBatch)


def store_with_log(num_pages: int = 8) -> tuple[PageStore, KVEventLog]:
    log = KVEventLog(4, "CPU")
    store = PageStore(num_pages, 4, num_layers=1, num_kv_heads=1, head_dim=2, listeners=[log])
    return store, log


def test_commits_and_evictions_make_their_events_in_order() -> None:
    store, log = store_with_log(num_pages=8)
    a = prefill(store, list(range(8)))           # 2 pages: one chain, one BlockStored
    nodes = chain_nodes(dict(store.context_states())[a].tip)  # root first
    events = log.take()
    assert [type(e).__name__ for e in events] == ["BlockStored"]
    assert events[0].block_hashes == [n.page_hash for n in nodes]
    assert events[0].parent_block_hash is None
    assert events[0].token_ids == list(range(8)) and events[0].block_size == 4
    b = prefill(store, list(range(8)) + [50, 51, 52, 53])  # 2 hits, 1 new page after them
    events = log.take()
    assert len(events) == 1 and events[0].parent_block_hash == nodes[-1].page_hash
    assert events[0].token_ids == [50, 51, 52, 53]
    third = events[0].block_hashes[0]
    store.release(a)
    store.release(b)
    assert log.take() == []                     # releasing caches; nothing is evicted yet
    c = prefill(store, [90 + i for i in range(32)])   # needs all 8 pages: evicts 3
    events = log.take()
    assert [type(e).__name__ for e in events] == ["BlockRemoved", "BlockStored"]
    assert events[0].block_hashes == [third, nodes[1].page_hash, nodes[0].page_hash]  # LRU order
    assert events[1].token_ids == [90 + i for i in range(32)]
    assert store.stats().num_evictions == 3
    store.release(c)


def test_a_dedup_hit_and_a_private_page_make_no_event() -> None:
    store, log = store_with_log()
    prefill(store, list(range(4)))
    log.take()
    prefill(store, list(range(4)))  # the same page: shared, not stored again
    assert log.take() == []


def test_wire_bytes_decode_with_vllms_schema_over_zmq() -> None:
    zmq = pytest.importorskip("zmq")
    store, log = store_with_log()
    pub = ZmqEventPublisher(log, "tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*",
                            topic="kv")
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(pub.endpoint)
    try:
        time.sleep(0.3)  # a SUB socket misses what is sent before it joined (ZeroMQ's rule)
        cid = prefill(store, list(range(12)))
        tip = dict(store.context_states())[cid].tip
        hashes = [n.page_hash for n in chain_nodes(tip)]
        stored: list[BlockStored] = []
        seqs = []
        while not stored:  # (the AllBlocksCleared sent at start may come first)
            assert sub.poll(5000), "no KV event batch arrived"
            topic, seq, payload = sub.recv_multipart()
            assert topic == b"kv" and len(seq) == 8
            seqs.append(int.from_bytes(seq, "big"))
            batch = VLLM_DECODER.decode(payload)
            assert batch.ts > 0
            stored = [e for e in batch.events if isinstance(e, BlockStored)]
        assert seqs == sorted(seqs) and seqs[-1] <= 1
        assert stored[0].block_hashes == hashes and stored[0].parent_block_hash is None
        assert stored[0].token_ids == list(range(12)) and stored[0].medium == "CPU"
        # The replay socket: everything from sequence 0 (the AllBlocksCleared sent at start
        # and this batch), then vLLM's end marker.
        req = ctx.socket(zmq.DEALER)  # (frames as a REQ socket sends them: b"", start)
        req.connect(pub.replay_endpoint)
        req.send_multipart((b"", (0).to_bytes(8, "big")))
        got = []
        while True:
            assert req.poll(5000), "replay did not answer"
            empty, seq_bytes, body = req.recv_multipart()
            if seq_bytes == ZmqEventPublisher.END_SEQ:
                break
            got.append(VLLM_DECODER.decode(body))
        req.close(linger=0)
        kinds = [type(e).__name__ for b in got for e in b.events]
        assert kinds[0] == "AllBlocksCleared" and "BlockStored" in kinds
    finally:
        sub.close(linger=0)
        pub.close()


def test_an_engine_booted_with_kv_events_publishes_its_commits(tiny_folder_path) -> None:
    """``boot_engine(kv_events=...)`` gives the store the event log as a trie listener: a
    flush's committed pages reach a subscriber."""
    zmq = pytest.importorskip("zmq")
    import anyio

    from pie_ctx import Context, Runtime
    from runtime.boot import boot_engine

    engine = boot_engine(str(tiny_folder_path), page_size=4, num_pages=64, progress=False,
                         kv_events="tcp://127.0.0.1:*")
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(engine.kv_events.endpoint)
    time.sleep(0.3)  # a SUB socket misses what is sent before it joined

    async def run() -> None:
        async with engine, Runtime.local(engine=engine) as rt:
            await Context(rt).append(list(range(1, 10))).flush()  # 2 full pages

    try:
        anyio.run(run)
        stored: list[int] = []
        while sub.poll(2000):
            _, _, payload = sub.recv_multipart()
            for event in VLLM_DECODER.decode(payload).events:
                if isinstance(event, BlockStored):
                    stored.extend(event.token_ids)
            if len(stored) >= 8:
                break
        assert stored[:8] == list(range(1, 9))
    finally:
        sub.close(linger=0)
        engine.kv_events.close()
