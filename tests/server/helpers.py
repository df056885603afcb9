"""Shared helpers for the server tests: a fake engine with a wire tokenizer, raw clients,
``serve`` as a subprocess (``ServeProcess``).

Owner: tests/server. ``RawClient`` speaks frames directly (for malformed input);
``collect`` drains a generation; ``wait_settled`` waits until the engine has released
every context of departed clients, then checks the page store's invariants.
"""

from __future__ import annotations

import os
import queue
import re
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import msgspec

from pie_ctx.proto import messages as P
from pie_ctx.proto import wire
from pie_ctx.proto.address import parse_address
from pie_ctx.proto.framing import FrameReader, FrameWriter
from pie_ctx.socket_transport import SocketTransport
from tests.engine.fake import FakeTokenizer, make_engine
from tests.model.loader_fixtures import hf_reference_weights, write_tiny_hf_folder

REPO = str(Path(__file__).resolve().parents[2])


class WireFakeTokenizer(FakeTokenizer):
    """The fake tokenizer with a wire form, so the handshake can carry it."""

    def to_wire(self) -> dict[str, Any]:
        return {"kind": "fake"}

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> WireFakeTokenizer:
        if data.get("kind") != "fake":
            raise ValueError(data)
        return cls()


def fake_engine(**kw: Any) -> Any:
    engine = make_engine(**kw)
    engine.tokenizer = WireFakeTokenizer()
    return engine


def connect(address: str, **kw: Any) -> Any:
    """``async with connect(address) as t``: a SocketTransport to a fake-engine server."""
    return SocketTransport.open(address, tokenizer_factory=WireFakeTokenizer.from_wire, **kw)


async def collect(stream: Any) -> tuple[list[int], Any]:
    """Drain a generation: (tokens from chunks, final message)."""
    tokens: list[int] = []
    final = None
    async for msg in stream:
        if isinstance(msg, P.GenerateChunk):
            tokens.extend(msg.tokens)
        else:
            final = msg
    return tokens, final


async def wait_settled(engine: Any, timeout: float = 10.0) -> None:
    """Wait until no context is live and no page is used, then check invariants."""
    with anyio.fail_after(timeout):
        while engine.stats().num_contexts or engine.stats().num_pages_used:
            await anyio.sleep(0.01)
    engine.store.check_invariants()


class RawClient:
    """An async client that sends arbitrary frames (after an optional handshake)."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.reader = FrameReader(stream, 2**30)
        self.writer = FrameWriter(stream)

    @classmethod
    async def open(cls, address: str, hello: Any = None) -> RawClient:
        addr = parse_address(address)
        if addr.kind == "unix":
            stream: Any = await anyio.connect_unix(addr.path)
        else:
            stream = await anyio.connect_tcp(addr.host, addr.port)
        client = cls(stream)
        if hello is not None:
            await client.send(hello)
            welcome = await client.receive()
            if not isinstance(welcome, wire.Welcome):
                raise AssertionError(welcome)
        return client

    async def send(self, msg: Any) -> None:
        await self.writer.send(wire.encode(msg))

    async def send_bytes(self, data: bytes) -> None:
        await self.stream.send(data)

    async def call(self, rid: int, req: Any) -> None:
        await self.send(wire.Call(id=rid, request=msgspec.Raw(wire.encode(req))))

    async def receive(self, timeout: float = 5.0) -> Any:
        with anyio.fail_after(timeout):
            payload = await self.reader.receive()
        return None if payload is None else wire.decode_server(payload)

    async def aclose(self) -> None:
        await anyio.aclose_forcefully(self.stream)


HELLO = wire.Hello(protocol_version=wire.PROTOCOL_VERSION)


def sync_frame(payload: bytes) -> bytes:
    return struct.pack("!I", len(payload)) + payload


class SyncRawClient:
    """A blocking-socket client for tests whose server runs in another thread."""

    def __init__(self, path: str, timeout: float = 5.0) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        self.sock.connect(path)
        self.buf = b""

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def receive(self, deadline_s: float = 5.0) -> bytes | None:
        """One frame's payload, or None when the server closed the connection."""
        end = time.monotonic() + deadline_s
        while True:
            if len(self.buf) >= 4:
                (n,) = struct.unpack_from("!I", self.buf)
                if len(self.buf) >= 4 + n:
                    payload, self.buf = self.buf[4:4 + n], self.buf[4 + n:]
                    return payload
            if time.monotonic() > end:
                raise TimeoutError("no frame from the server")
            try:
                chunk = self.sock.recv(65536)
            except (ConnectionResetError, BrokenPipeError):
                return None
            if not chunk:
                return None
            self.buf += chunk

    def close(self) -> None:
        self.sock.close()


__all__ = [
    "HELLO", "REPO", "RawClient", "ServeProcess", "SyncRawClient", "WireFakeTokenizer",
    "collect", "connect", "fake_engine", "serve_env", "sync_frame", "wait_settled",
]


def serve_env(tmp_path: Path) -> dict[str, str]:
    """The environment of a server or CLI subprocess: this repository importable, and every
    folder it writes by default (model cache, socket, snapshots) inside ``tmp_path``."""
    return {**os.environ, "PYTHONPATH": REPO, "PIE_CTX_CACHE": str(tmp_path / "cache"),
            "XDG_RUNTIME_DIR": str(tmp_path), "XDG_DATA_HOME": str(tmp_path / "data")}


class ServeProcess:
    """A ``python -m runtime.server serve`` subprocess and its stderr lines."""

    def __init__(self, tmp_path: Path, *args: str, model: Path | None = None) -> None:
        model = model or write_tiny_hf_folder(tmp_path / "model", hf_reference_weights())
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "runtime.server", "serve", "--model", str(model),
             "--num-pages", "64", *args],
            stderr=subprocess.PIPE, text=True, env=serve_env(tmp_path), cwd=REPO)
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stderr:
            self.lines.put(line)

    def wait_for(self, pattern: str, timeout: float = 60.0) -> re.Match[str]:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            try:
                line = self.lines.get(timeout=0.2)
            except queue.Empty:
                if self.proc.poll() is not None:
                    break
                continue
            if m := re.search(pattern, line):
                return m
        raise AssertionError(f"server never printed {pattern!r} (exit {self.proc.poll()})")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
