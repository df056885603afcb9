"""What a client sees when a fleet replica fails, without a cluster: the ingress over a
stand-in for the engines' handle whose calls fail as Ray's handle fails them (a
``ReplicaUnavailable`` raised in the replica, wrapped in ``RayTaskError``; an
``ActorDiedError``). Every failure reaches the client as one OpenAI-shaped error,
``{"error": {"message", "type", "code": "replica_unavailable"}}`` with one sentence and
none of Ray's traceback, ANSI codes, process ids, addresses or paths; a call whose
replica failed before replying is retried once, on another replica."""

from __future__ import annotations

import json
from typing import Any

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("ray.serve")

from ray.exceptions import ActorDiedError, RayTaskError  # noqa: E402

from runtime.fleet import view  # noqa: E402
from runtime.fleet.ingress import FleetIngress, failed_replica  # noqa: E402
from runtime.fleet.replica import Call, ReplicaUnavailable  # noqa: E402

TRACEBACK = ("\x1b[36mray::ServeReplica:pie-ctx:engine.handle_request_streaming()\x1b[39m "
             "(pid=12345, ip=10.0.0.7, actor_id=abc, repr=<ray.serve._private.replica>)\n"
             '  File "/srv/venv/lib/python3.11/site-packages/ray/serve/_private/replica.py",'
             " line 1234, in handle\nhttpx.RemoteProtocolError: peer closed connection")


def wrapped(replica: str) -> BaseException:
    """A replica's ``ReplicaUnavailable`` as the ingress receives it from Ray."""
    cause = ReplicaUnavailable(replica, "The fleet replica serving this request stopped.")
    return RayTaskError("handle", TRACEBACK, cause).as_instanceof_cause()


class Stream:
    """One call's reply stream: the items, then (maybe) an error."""

    def __init__(self, items: list[Any], error: BaseException | None) -> None:
        self.items, self.error = list(items), error

    def __aiter__(self) -> Stream:
        return self

    async def __anext__(self) -> Any:
        if self.items:
            return self.items.pop(0)
        if self.error is not None:
            raise self.error
        raise StopAsyncIteration


class Handle:
    """The engines' handle: each ``remote`` call plays the next scripted reply."""

    def __init__(self, replies: list[tuple[list[Any], BaseException | None]]) -> None:
        self.replies, self.calls = list(replies), []

    def options(self, **_: Any) -> Handle:
        return self

    def remote(self, call: Call) -> Stream:
        self.calls.append({**call, "avoid": list(call.get("avoid") or [])})
        items, error = self.replies.pop(0)
        return Stream(items, error)


def head(replica: str, sse: bool = False) -> dict[str, Any]:
    kind = "text/event-stream" if sse else "application/json"
    return {"status": 200, "replica": replica, "headers": [("content-type", kind)]}


def call(session: str | None = None, prefer: str | None = None) -> Call:
    return Call(method="POST", path="/v1/chat/completions", query="", headers=[], body=b"{}",
                session=session, prefer=prefer, tokens=None, avoid=[])


async def body_of(response: Any) -> bytes:
    out = b""
    async for chunk in response.body_iterator:
        out += chunk if isinstance(chunk, bytes) else chunk.encode()
    return out


def assert_one_clean_error(error: dict[str, Any]) -> None:
    assert set(error) == {"message", "type", "code"}, error
    assert error["code"] == "replica_unavailable" and error["type"] == "server_error"
    message = error["message"]
    assert message.endswith(".") and ". " not in message and "\n" not in message  # one sentence
    for leak in ("\x1b", "Traceback", "pid", "12345", "10.0.0.7", "/srv", "ray::", "File "):
        assert leak not in message, (leak, message)
    assert len(message) < 300


async def test_a_call_whose_replicas_both_fail_is_one_503_error() -> None:
    handle = Handle([([], wrapped("r1")), ([], wrapped("r2"))])
    front = FleetIngress(handle, prefix_routing=False)
    response = await front._send(call(session="s:alice", prefer="r1"))
    assert response.status_code == 503
    got = json.loads(response.body)
    assert set(got) == {"error"}
    assert_one_clean_error(got["error"])
    # the retry avoided the replica that failed, and no longer preferred it
    assert handle.calls[1]["avoid"] == ["r1"] and handle.calls[1]["prefer"] is None


async def test_a_call_retried_after_its_engine_failed_is_answered_elsewhere() -> None:
    handle = Handle([([], wrapped("r1")), ([head("r2"), b'{"ok": true}'], None)])
    front = FleetIngress(handle, prefix_routing=False)
    response = await front._send(call())  # no session: the error names the replica
    assert response.status_code == 200 and response.headers["x-pie-replica"] == "r2"
    assert await body_of(response) == b'{"ok": true}'
    assert handle.calls[1]["avoid"] == ["r1"] and front.retries == 1


async def test_a_stream_cut_by_a_failed_replica_ends_with_one_error_event() -> None:
    handle = Handle([([head("r1", sse=True), b'data: {"x": 1}\n\n'], wrapped("r1"))])
    front = FleetIngress(handle, prefix_routing=False)
    response = await front._send(call())
    body = (await body_of(response)).decode()
    first, last = body.split("\n\n")[0], body.strip().split("\n\n")[-1]
    assert first == 'data: {"x": 1}'
    event, data = last.split("\n")
    assert event == "event: error" and data.startswith("data: ")
    got = json.loads(data[len("data: "):])
    assert set(got) == {"error"}
    assert_one_clean_error(got["error"])


def test_the_failed_replica_is_named_by_its_error() -> None:
    assert failed_replica(wrapped("r7")) == "r7"
    assert failed_replica(ReplicaUnavailable("r8", "x")) == "r8"
    view.VIEW["r9"] = {"replica": "r9", "actor_id": "a9"}
    try:
        assert failed_replica(ActorDiedError()) is None
        died = ActorDiedError()
        died.actor_id = "a9"
        assert failed_replica(died) == "r9"
    finally:
        view.VIEW.pop("r9")
