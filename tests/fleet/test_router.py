"""The fleet's routing rules without a cluster: rendezvous order, the ranks a call gets,
the prefix index fed with KV-event batches, what a request names, merged /metrics."""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
import pytest

pytest.importorskip("ray.serve")

from runtime.fleet.ingress import merge_metrics  # noqa: E402
from runtime.fleet.prefix import PrefixIndex  # noqa: E402
from runtime.fleet.router import FleetRouter, rendezvous  # noqa: E402
from runtime.fleet.sessions import session_of  # noqa: E402
from runtime.kv.events import BlockRemoved, BlockStored, KVEventBatch  # noqa: E402


@dataclass(frozen=True)
class _Id:
    unique_id: str


@dataclass(frozen=True)
class _Replica:  # what FleetRouter.rank reads of Serve's RunningReplica
    replica_id: _Id


def _router(index: PrefixIndex) -> FleetRouter:
    router = FleetRouter.__new__(FleetRouter)  # (rank needs only the index)
    router.index = index
    return router


def _batch(seq_events: list) -> bytes:
    return msgspec.msgpack.encode(KVEventBatch(ts=1.0, events=seq_events))


def test_rendezvous_is_stable_and_moves_only_the_lost_replicas_sessions() -> None:
    replicas = ["r1", "r2", "r3"]
    first = {s: rendezvous(s, replicas)[0] for s in (f"s{i}" for i in range(300))}
    assert set(first.values()) == set(replicas)  # spread over all
    without = {s: rendezvous(s, ["r1", "r3"])[0] for s in first}
    for s, r in first.items():
        if r != "r2":
            assert without[s] == r  # only r2's sessions moved
        else:
            assert without[s] == rendezvous(s, replicas)[1]  # to their next choice


def test_a_session_goes_to_its_override_then_in_rendezvous_order() -> None:
    reps = [_Replica(_Id(r)) for r in ("a", "b", "c")]
    router = _router(PrefixIndex())
    ranks = router.rank({"session": "s:1"}, reps)
    order = [rank[0].replica_id.unique_id for rank in ranks]
    assert order == rendezvous("s:1", ["a", "b", "c"])
    ranks = router.rank({"session": "s:1", "prefer": order[2]}, reps)
    assert ranks[0][0].replica_id.unique_id == order[2]
    # A replica to avoid (it just failed the call) is tried last.
    ranks = router.rank({"session": "s:1", "avoid": [order[0]]}, reps)
    assert [r[0].replica_id.unique_id for r in ranks][-1] == order[0]


def test_a_prompt_goes_to_the_replica_holding_its_longest_prefix() -> None:
    index = PrefixIndex()
    index.apply("a", 0, _batch([BlockStored(block_hashes=[1, 2], parent_block_hash=None,
                                            token_ids=[1, 2, 3, 4, 5, 6, 7, 8], block_size=4,
                                            lora_id=None, medium="CPU", lora_name=None)]))
    index.apply("b", 0, _batch([BlockStored(block_hashes=[9], parent_block_hash=None,
                                            token_ids=[1, 2, 3, 4], block_size=4,
                                            lora_id=None, medium="CPU", lora_name=None)]))
    assert index.match([1, 2, 3, 4, 5, 6, 7, 8, 0]) == {"a": 2, "b": 1}
    reps = [_Replica(_Id(r)) for r in ("a", "b", "c")]
    ranks = _router(index).rank({"tokens": [1, 2, 3, 4, 5, 6, 7, 8]}, reps)
    assert ranks[0][0].replica_id.unique_id == "a"
    assert len(ranks[1]) == 2  # then the less loaded of two others
    # An eviction takes the page out; a replayed (old) batch changes nothing.
    index.apply("a", 1, _batch([BlockRemoved(block_hashes=[2], medium="CPU")]))
    index.apply("a", 0, _batch([BlockStored(block_hashes=[2], parent_block_hash=1,
                                            token_ids=[5, 6, 7, 8], block_size=4,
                                            lora_id=None, medium="CPU", lora_name=None)]))
    assert index.match([1, 2, 3, 4, 5, 6, 7, 8]) == {"a": 1, "b": 1}


def test_what_a_request_names() -> None:
    h = {"authorization": "Bearer k"}
    assert session_of("POST", "/v1/responses", h, {"previous_response_id": "resp_1"}) == \
        "r:resp_1"
    assert session_of("GET", "/v1/responses/resp_" + "a" * 32, h, None) == "r:resp_" + "a" * 32
    chan = session_of("POST", "/v1/pie/channels/jobs", h, None)
    assert chan == session_of("GET", "/v1/pie/channels/jobs", h, None)  # parties meet
    assert session_of("POST", "/v1/chat/completions", {**h, "x-session-id": "u7"}, {}) != \
        session_of("POST", "/v1/chat/completions", {"x-session-id": "u7"}, {})  # per key
    assert session_of("POST", "/v1/chat/completions", h, {"messages": []}) is None


def test_metrics_of_replicas_merge_into_one_exposition() -> None:
    from prometheus_client.parser import text_string_to_metric_families

    one = "# HELP x_total things\n# TYPE x_total counter\nx_total 3.0\n"
    two = "# HELP x_total things\n# TYPE x_total counter\nx_total 4.0\n"
    merged = merge_metrics({"r1": one, "r2": two})
    fams = list(text_string_to_metric_families(merged))
    assert len(fams) == 1
    assert {s.labels["replica"]: s.value for s in fams[0].samples} == {"r1": 3.0, "r2": 4.0}
