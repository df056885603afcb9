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
``check_health`` fails when the engine process is gone, and a replica whose engine exited
ends its own process, so Ray Serve replaces it at once.
A call the engine cannot answer (it exited, or its connection broke) raises
``ReplicaUnavailable``, which names this replica and says in one sentence what happened:
the ingress retries the call elsewhere or answers the client with it.

The engine's socket lives in a temporary folder of this replica
(``pie-ctx-replica-<pid>-*``), removed on every way out: a clean stop (``__del__``), the
engine exiting (the thread that reads its log removes it), a failed start, and the
replica process killed (the engine, which watches it, removes the folder as it exits;
a folder whose owner died with its engine is swept by the next replica to start).

A replica given early engines (``early``: the folders of ``EarlyEngines``, booted by the
fleet's driver while Ray and Serve started) adopts a free one instead of starting its
own (``runtime.fleet.engines``); the folder is then the driver's, with the same ways out.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator
from typing import Any, TypedDict

import httpx

from runtime.fleet.engines import TEMP_PREFIX, AdoptedEngine, SpawnedEngine, claim

__all__ = ["Call", "EngineReplica", "ReplicaUnavailable", "engine_command", "TEMP_PREFIX"]

log = logging.getLogger("pie_ctx.fleet")

_HTTP_READY = re.compile(r"serving HTTP on (http://\S+)")
_EVENTS_READY = re.compile(r"kv events on (\S+), replay on (\S+)")
_STOP_S = 8.0  # an engine's clean stop, within Serve's graceful_shutdown_timeout_s (10)
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


class ReplicaUnavailable(RuntimeError):
    """A replica's engine could not answer a call (it exited, or its connection broke).

    Args:
        replica: the replica's id.
        message: one sentence for the client: what happened and what to do.
    """

    def __init__(self, replica: str, message: str) -> None:
        super().__init__(replica, message)
        self.replica, self.message = replica, message

    def __str__(self) -> str:
        return self.message


def engine_command(engine_args: list[str], snapshot_dir: str, host: str,
                   socket_path: str) -> list[str]:
    """The engine process's command line for one replica, started by this process (its
    socket's folder is the replica's temporary folder, which the engine removes if it
    outlives the replica)."""
    return [sys.executable, "-m", "runtime.fleet.engine_proc", str(os.getpid()),
            os.path.dirname(socket_path), "serve",
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
        early: folders of engines the driver started with the same options
            (``EarlyEngines.folders``): the replica adopts a free one, if any.

    Raises:
        RuntimeError: the engine did not start (its output says why; its process and
            temporary folder are gone).
    """

    def __init__(self, engine_args: list[str], snapshot_dir: str, host: str = "127.0.0.1",
                 startup_s: float = 900.0, early: list[str] | None = None) -> None:
        from ray import serve

        started = time.monotonic()
        self.started_at = time.time()
        self.actor_id: str | None = None
        try:
            self.replica_id = serve.get_replica_context().replica_id.unique_id
            import ray

            self.actor_id = ray.get_runtime_context().get_actor_id()
        except Exception:  # outside Serve (a test of the class itself)
            self.replica_id = f"local-{os.getpid()}"
        self._stopping = False
        self.proc: SpawnedEngine | AdoptedEngine
        taken = claim(early) if early else None
        if taken is not None:
            self._tmp, self.proc = taken
        else:
            host = _node_ip() if host == "node" else host
            self._tmp = tempfile.mkdtemp(prefix=f"{TEMP_PREFIX}{os.getpid()}-")
        self.adopted = taken is not None
        self.socket = os.path.join(self._tmp, "engine.sock")
        try:
            if taken is None:
                self.proc = SpawnedEngine(
                    engine_command(engine_args, snapshot_dir, host, self.socket))
            self.url, self.kv_events, self.kv_replay = self._wait_ready(startup_s)
        except BaseException:
            self._stop_engine()
            raise
        self.ready_at = time.time()
        threading.Thread(target=self._drain, daemon=True, name="pie-ctx-engine-log").start()
        self.client = httpx.AsyncClient(base_url=self.url, timeout=None)
        self.inflight = 0
        log.info("replica %s: engine serving in %.2f s%s", self.replica_id,
                 time.monotonic() - started, " (adopted, booted early)" if self.adopted else "")
        _sweep_stale(os.path.dirname(self._tmp))

    def _wait_ready(self, startup_s: float) -> tuple[str, str, str]:
        """Read the engine's log until it serves HTTP: (url, kv events, replay).

        Raises:
            RuntimeError: the engine exited or took longer than ``startup_s``.
        """
        url = events = replay = ""
        lines: list[str] = []
        deadline = time.monotonic() + startup_s
        while time.monotonic() < deadline and not (url and events):
            line = self.proc.readline()
            if not line:
                break
            lines.append(line)
            if m := _EVENTS_READY.search(line):
                events, replay = m.group(1), m.group(2)
            if m := _HTTP_READY.search(line):
                url = m.group(1)
        if not (url and events):
            raise RuntimeError("the replica's engine did not start:\n" + "".join(lines[-30:]))
        return url, events, replay

    def _drain(self) -> None:
        """Keep reading the engine's log (a full pipe would block it) into ours; when the
        engine has exited, remove the temporary folder."""
        for line in iter(self.proc.readline, ""):
            log.info("[%s] %s", self.replica_id, line.rstrip())
        self.proc.wait()
        shutil.rmtree(self._tmp, ignore_errors=True)
        if self._stopping:
            return
        log.warning("replica %s: its engine exited (%s); Serve replaces this replica",
                    self.replica_id, self.proc.how())
        if self.actor_id is not None:
            # Serve marks a replica whose actor died unhealthy at once, one that fails its
            # health check only after three checks in a row (~3 s): end the actor.
            os._exit(1)

    def _unavailable(self, detail: str) -> ReplicaUnavailable:
        what = (f"its engine exited ({self.proc.how()})" if self.proc.exited()
                else f"its engine's connection failed ({detail})")
        return ReplicaUnavailable(
            self.replica_id, f"The fleet replica serving this request stopped before it "
                             f"finished ({what}); retry the request, another replica takes it.")

    async def handle(self, call: Call) -> AsyncIterator[dict[str, Any] | bytes]:
        """Send ``call`` to the engine; yield the reply's head, then its body's chunks.

        Raises:
            ReplicaUnavailable: the engine is gone or its connection broke.
        """
        if self.proc.exited():
            raise self._unavailable("")
        self.inflight += 1
        try:
            headers = [(k, v) for k, v in call.get("headers", []) if k.lower() not in _DROP]
            request = self.client.build_request(call["method"], call["path"],
                                                params=call.get("query") or None,
                                                headers=headers, content=call.get("body"))
            try:
                response = await self.client.send(request, stream=True)
            except httpx.HTTPError as err:
                raise self._unavailable(type(err).__name__) from None
            try:
                yield {"status": response.status_code, "replica": self.replica_id,
                       "headers": [(k, v) for k, v in response.headers.items()
                                   if k.lower() not in _DROP]}
                try:
                    async for chunk in response.aiter_raw():
                        yield chunk
                except httpx.HTTPError as err:
                    raise self._unavailable(type(err).__name__) from None
            finally:
                await response.aclose()
        finally:
            self.inflight -= 1

    def info(self) -> dict[str, Any]:
        """Where this replica's engine is (``GET /fleet/replicas``)."""
        return {"replica": self.replica_id, "pid": os.getpid(), "engine_pid": self.proc.pid,
                "actor_id": self.actor_id, "url": self.url, "socket": self.socket,
                "kv_events": self.kv_events, "kv_events_replay": self.kv_replay,
                "inflight": self.inflight, "adopted": self.adopted,
                "started_at": self.started_at, "ready_at": self.ready_at}

    def record_routing_stats(self) -> dict[str, Any]:
        """What the router reads of this replica (Ray Serve calls it periodically)."""
        return self.info()

    def check_health(self) -> None:
        """Ray Serve's health check: the engine process must be alive.

        Raises:
            RuntimeError: it exited (Serve then replaces this replica).
        """
        if self.proc.exited():
            raise RuntimeError(f"replica {self.replica_id}: its engine exited "
                               f"({self.proc.how()})")

    def _stop_engine(self) -> None:
        """Stop the engine (SIGTERM, then SIGKILL past ``_STOP_S``); remove the folder."""
        self._stopping = True
        proc = getattr(self, "proc", None)
        if proc is not None and not proc.exited():
            proc.signal(signal.SIGTERM)
            if not proc.wait(_STOP_S):
                proc.signal(signal.SIGKILL)
                proc.wait()
        shutil.rmtree(self._tmp, ignore_errors=True)

    def __del__(self) -> None:
        # Serve calls it on a graceful stop (a scale-down, ``serve.delete``, a shutdown).
        if hasattr(self, "_tmp"):
            self._stop_engine()


def _sweep_stale(root: str) -> None:
    """Remove replica folders in ``root`` whose replica process is gone (one killed
    together with its engine, which could not remove its folder)."""
    try:
        entries = os.listdir(root)
    except OSError:
        return
    for name in entries:
        pid = name[len(TEMP_PREFIX):].split("-", 1)[0]
        if not (name.startswith(TEMP_PREFIX) and pid.isdigit()):
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
        except PermissionError:  # another user's live process
            pass


def _node_ip() -> str:
    """The address other nodes reach this one at (loopback on a one-node cluster)."""
    try:
        import ray

        ip = ray.util.get_node_ip_address()
    except Exception:
        return "127.0.0.1"
    return "127.0.0.1" if ip in ("", "0.0.0.0") else ip
