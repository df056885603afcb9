"""``EngineReplica``: one pie-ctx engine as a Ray Serve replica.

Owns: the engine process of one replica (``pie-ctx serve`` under
``runtime.fleet.engine_proc``, so it dies with the replica), and the HTTP hop to it. The
engine is the one pie-ctx runs alone: the same OpenAI/Anthropic/Responses API, channels,
hosted inferlets and /metrics, on the fleet's shared snapshot folder
(``--shared-snapshots``), publishing its KV events (``--kv-events``, with replay).

A call (``handle``) is one HTTP request as the ingress read it (``Call``); the reply
streams back as a head (status, headers, this replica's id) and then the body's bytes as
the engine sends them, so a streamed completion streams through. ``record_routing_stats``
tells the router (``runtime.fleet.router``) where this replica's KV events are;
``check_health`` fails when the engine process is gone, so Ray Serve replaces the replica.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator
from typing import Any, TypedDict

import httpx

__all__ = ["Call", "EngineReplica", "engine_command"]

log = logging.getLogger("pie_ctx.fleet")

_HTTP_READY = re.compile(r"serving HTTP on (http://\S+)")
_EVENTS_READY = re.compile(r"kv events on (\S+), replay on (\S+)")
# Hop-by-hop headers (RFC 9110 7.6.1) and those the hop recomputes.
_DROP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade",
         "proxy-authorization", "proxy-authenticate", "host", "content-length"}


class Call(TypedDict, total=False):
    """One HTTP request for a replica, and what the router reads of it."""

    method: str
    path: str
    query: str
    headers: list[tuple[str, str]]
    body: bytes
    session: str | None  # a routing key naming a session (rendezvous-hashed)
    prefer: str | None  # the replica the session was last served by (an override)
    tokens: list[int] | None  # the prompt's tokens, for prefix routing
    avoid: list[str]  # replicas not to pick (one that just failed this call)


def engine_command(engine_args: list[str], snapshot_dir: str, host: str,
                   socket_path: str) -> list[str]:
    """The engine process's command line for one replica."""
    return [sys.executable, "-m", "runtime.fleet.engine_proc", str(os.getpid()), "serve",
            *engine_args, "--snapshot-dir", snapshot_dir, "--shared-snapshots",
            "--kv-events", f"tcp://{host}:*", "--kv-events-replay", f"tcp://{host}:*",
            "--http", f"{host}:0", "--socket", socket_path]


class EngineReplica:
    """The deployment class of the fleet's engines (see the module docstring).

    Args:
        engine_args: ``pie-ctx serve`` engine options (``--model``, ``--page-size``...).
        snapshot_dir: the folder every replica shares (it must exist).
        host: the address the engine's HTTP API and KV events bind: ``127.0.0.1`` (one
            machine), or ``"node"`` for this node's address (a cluster of several: the
            router subscribes to every replica's events from the ingress's node; off
            loopback the engine asks for an API key, so pass ``--api-key-file`` on the
            shared folder in ``engine_args`` and give clients that key).
        startup_s: how long the engine may take to boot.

    Raises:
        RuntimeError: the engine did not start (its output says why).
    """

    def __init__(self, engine_args: list[str], snapshot_dir: str, host: str = "127.0.0.1",
                 startup_s: float = 900.0) -> None:
        from ray import serve

        try:
            self.replica_id = serve.get_replica_context().replica_id.unique_id
        except Exception:  # outside Serve (a test of the class itself)
            self.replica_id = f"local-{os.getpid()}"
        host = _node_ip() if host == "node" else host
        self._tmp = tempfile.mkdtemp(prefix="pie-ctx-replica-")
        self.socket = os.path.join(self._tmp, "engine.sock")
        self.proc = subprocess.Popen(engine_command(engine_args, snapshot_dir, host, self.socket),
                                     stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.url = self.kv_events = self.kv_replay = ""
        lines: list[str] = []
        deadline = time.monotonic() + startup_s
        while time.monotonic() < deadline and not (self.url and self.kv_events):
            line = self.proc.stderr.readline()  # type: ignore[union-attr]
            if not line:
                break
            lines.append(line)
            if m := _EVENTS_READY.search(line):
                self.kv_events, self.kv_replay = m.group(1), m.group(2)
            if m := _HTTP_READY.search(line):
                self.url = m.group(1)
        if not self.url:
            self.proc.kill()
            raise RuntimeError("the replica's engine did not start:\n" + "".join(lines[-30:]))
        threading.Thread(target=self._drain, daemon=True, name="pie-ctx-engine-log").start()
        self.client = httpx.AsyncClient(base_url=self.url, timeout=None)
        self.inflight = 0

    def _drain(self) -> None:
        """Keep reading the engine's log (a full pipe would block it) into ours."""
        for line in self.proc.stderr:  # type: ignore[union-attr]
            log.info("[%s] %s", self.replica_id, line.rstrip())

    async def handle(self, call: Call) -> AsyncIterator[dict[str, Any] | bytes]:
        """Send ``call`` to the engine; yield the reply's head, then its body's chunks."""
        self.inflight += 1
        try:
            headers = [(k, v) for k, v in call.get("headers", []) if k.lower() not in _DROP]
            request = self.client.build_request(call["method"], call["path"],
                                                params=call.get("query") or None,
                                                headers=headers, content=call.get("body"))
            response = await self.client.send(request, stream=True)
            try:
                yield {"status": response.status_code, "replica": self.replica_id,
                       "headers": [(k, v) for k, v in response.headers.items()
                                   if k.lower() not in _DROP]}
                async for chunk in response.aiter_raw():
                    yield chunk
            finally:
                await response.aclose()
        finally:
            self.inflight -= 1

    def info(self) -> dict[str, Any]:
        """Where this replica's engine is (``GET /fleet/replicas``)."""
        return {"replica": self.replica_id, "pid": os.getpid(), "engine_pid": self.proc.pid,
                "url": self.url, "socket": self.socket, "kv_events": self.kv_events,
                "kv_events_replay": self.kv_replay, "inflight": self.inflight}

    def record_routing_stats(self) -> dict[str, Any]:
        """What the router reads of this replica (Ray Serve calls it periodically)."""
        return self.info()

    def check_health(self) -> None:
        """Ray Serve's health check: the engine process must be alive.

        Raises:
            RuntimeError: it exited (Serve then replaces this replica).
        """
        if self.proc.poll() is not None:
            raise RuntimeError(f"replica {self.replica_id}: its engine exited with "
                               f"{self.proc.returncode}")

    def __del__(self) -> None:
        proc = getattr(self, "proc", None)
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()


def _node_ip() -> str:
    """The address other nodes reach this one at (loopback on a one-node cluster)."""
    try:
        import ray

        ip = ray.util.get_node_ip_address()
    except Exception:
        return "127.0.0.1"
    return "127.0.0.1" if ip in ("", "0.0.0.0") else ip
