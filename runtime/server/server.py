"""The engine server: many client connections, one engine.

Owns: the accepted connections and the tasks running their requests. The engine owns every
context and page; the server only decides *who* is asking (``owner``) and *which* snapshot
namespace they see, then forwards ``pie_ctx.proto.messages`` requests to ``Engine.handle`` /
``Engine.generate``.

Invariants:

* A connection is one engine owner. It can only name contexts it created, forked or
  opened (the engine checks the owner on every handle), and when it ends (``Bye``, clean
  close, crash, reset, framing error, server shutdown) its running requests are cancelled
  first and then ``engine.release_owner(conn)`` releases every context it still owns.
  Snapshots are not released: they belong to the namespace.
* Nothing reaches the engine before the handshake has checked the protocol version and
  the token (compared in constant time). A TCP server always requires a token.
* A channel message is never lost to a cancelled receive: a receive that took a message
  after its ``Cancel`` arrived gives it back instead of replying (the client gives back
  one whose reply crossed its ``Cancel``; docs/messages.md).
* Bad input never stops the server: a malformed message or request gets an ``ErrorReply``
  under its id (or id 0) and the connection continues; a framing error (oversize, empty,
  truncated frame) gets an ``ErrorReply`` and closes that connection only.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
from collections.abc import Sequence
from typing import Any

import anyio
import anyio.abc

from pie_ctx.proto import messages as P
from pie_ctx.proto import wire
from pie_ctx.proto.errors import AuthError, PieError, ProtocolError
from pie_ctx.proto.framing import DEFAULT_MAX_FRAME_BYTES, FrameReader, FrameWriter, FramingError
from pie_ctx.proto.messages import error_reply

__all__ = ["Server", "namespace_for_token", "DEFAULT_NAMESPACE"]

log = logging.getLogger("pie_ctx.server")

DEFAULT_NAMESPACE = "default"
_SUB_NAMESPACE = re.compile(r"[A-Za-z0-9._-]{1,64}")
_REPLY_ENVELOPE = 1024  # bytes a Response adds around the largest reply, with room to spare
_GONE = (anyio.BrokenResourceError, anyio.ClosedResourceError, anyio.EndOfStream, OSError)


def namespace_for_token(token: str) -> str:
    """The snapshot namespace of everyone holding ``token`` (a digest, never the token)."""
    return "token-" + hashlib.blake2b(token.encode(), digest_size=8).hexdigest()


class Connection:
    """One client: the engine owner of its contexts, and its requests in flight."""

    def __init__(self, writer: FrameWriter, namespace: str, peer: str) -> None:
        self.writer = writer
        self.namespace = namespace
        self.peer = peer
        self.running: dict[int, anyio.CancelScope] = {}

    async def send(self, rid: int, reply: Any) -> None:
        await self.writer.send(wire.encode(wire.Response(id=rid, reply=reply)))

    async def send_error(self, rid: int, err: PieError) -> None:
        await self.send(rid, error_reply(err))

    def __repr__(self) -> str:
        return f"Connection({self.peer}, namespace={self.namespace!r})"


class Server:
    """Serve one engine to every client of a listener.

    Args:
        engine: a running ``runtime.engine.Engine`` (inside ``async with engine``).
        tokens: accepted tokens; each token's holders share one snapshot namespace.
        require_token: refuse clients without a token (always set for TCP listeners).
        max_frame_bytes: largest frame accepted from a client.
        max_inflight: most requests one connection may have running at once.
        handshake_timeout: seconds a new connection has to send its ``Hello``.

    Usage::

        server = Server(engine, tokens=[token], require_token=True)
        async with anyio.create_task_group() as tg:
            await tg.start(server.serve, listener)
    """

    def __init__(self, engine: Any, *, tokens: Sequence[str] = (), require_token: bool = False,
                 max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES, max_inflight: int = 256,
                 handshake_timeout: float = 10.0) -> None:
        if require_token and not tokens:
            raise ValueError("require_token=True needs at least one token")
        self.engine = engine
        # No request may ask for a reply this server could not send in one frame.
        engine.cap_reply_bytes(max_frame_bytes - _REPLY_ENVELOPE)
        self._token_digests = [hashlib.sha256(t.encode()).digest() for t in tokens]
        self._token_namespaces = [namespace_for_token(t) for t in tokens]
        self.require_token = require_token
        self.max_frame_bytes = max_frame_bytes
        self.max_inflight = max_inflight
        self.handshake_timeout = handshake_timeout
        self.connections: set[Connection] = set()
        self.num_accepted = 0
        tok = engine.tokenizer
        self._tokenizer_wire = tok.to_wire() if hasattr(tok, "to_wire") else None

    async def serve(self, listener: anyio.abc.Listener[Any], *,
                    task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Accept connections until cancelled; cancelling also ends every connection."""
        async with listener, anyio.create_task_group() as tg:
            task_status.started()
            await listener.serve(self.handle_connection, task_group=tg)

    # ------------------------------------------------------------------------ handshake

    def _authenticate(self, hello: wire.Hello) -> str:
        if hello.protocol_version != wire.PROTOCOL_VERSION:
            raise ProtocolError(f"protocol version {hello.protocol_version} is not supported; "
                                f"this server speaks version {wire.PROTOCOL_VERSION}")
        if hello.token is None:
            if self.require_token:
                raise AuthError("this server requires a token: pass the contents of the "
                                "server's token file")
            base = DEFAULT_NAMESPACE
        else:
            digest = hashlib.sha256(hello.token.encode()).digest()
            match = -1
            for i, known in enumerate(self._token_digests):  # no early exit: constant time
                if hmac.compare_digest(digest, known):
                    match = i
            if match < 0:
                raise AuthError("wrong token; read it from the server's token file")
            base = self._token_namespaces[match]
        if hello.namespace is None:
            return base
        if not _SUB_NAMESPACE.fullmatch(hello.namespace):
            raise ProtocolError("namespace must be 1-64 characters from A-Z a-z 0-9 . _ -")
        return f"{base}/{hello.namespace}"

    async def _handshake(self, reader: FrameReader, writer: FrameWriter, peer: str) -> Connection:
        with anyio.fail_after(self.handshake_timeout):
            payload = await reader.receive()
        if payload is None:
            raise anyio.EndOfStream
        msg = wire.decode_client(payload)
        if not isinstance(msg, wire.Hello):
            raise ProtocolError(f"expected Hello as the first message, got {type(msg).__name__}")
        conn = Connection(writer, self._authenticate(msg), peer)
        await writer.send(wire.encode(wire.Welcome(
            info=self.engine.info(), namespace=conn.namespace, max_frame_bytes=self.max_frame_bytes,
            max_inflight=self.max_inflight, tokenizer=self._tokenizer_wire,
        )))
        return conn

    # ----------------------------------------------------------------------- connection

    async def handle_connection(self, stream: anyio.abc.ByteStream) -> None:
        """Serve one client until it leaves; never raises (except cancellation)."""
        self.num_accepted += 1
        peer = _peer_name(stream)
        reader = FrameReader(stream, self.max_frame_bytes)
        writer = FrameWriter(stream)
        async with stream:
            try:
                conn = await self._handshake(reader, writer, peer)
            except PieError as err:
                log.info("refused %s: %s", peer, err)
                with anyio.move_on_after(1), _suppress_gone():
                    await writer.send(wire.encode(wire.Response(
                        id=wire.CONNECTION_ID, reply=error_reply(err))))
                return
            except (TimeoutError, *_GONE):
                return
            self.connections.add(conn)
            bye: int | None = None
            try:
                async with anyio.create_task_group() as tg:
                    bye = await self._read_loop(conn, reader, tg)
                    tg.cancel_scope.cancel()
            except Exception:  # a bug must cost one connection, never the server
                log.exception("connection %s failed", peer)
            finally:
                self.connections.discard(conn)
                self.engine.release_owner(conn)  # after its requests ended: nothing races
            if bye is not None:
                with anyio.move_on_after(1), _suppress_gone():
                    await conn.send(bye, P.Ok())

    async def _read_loop(self, conn: Connection, reader: FrameReader,
                         tg: anyio.abc.TaskGroup) -> int | None:
        """Dispatch the client's messages; return the ``Bye`` id, or None when it left."""
        while True:
            try:
                payload = await reader.receive()
            except FramingError as err:
                with anyio.move_on_after(1), _suppress_gone():
                    await conn.send_error(wire.CONNECTION_ID, err)
                return None
            except _GONE:
                return None
            if payload is None:
                return None
            try:
                msg = wire.decode_client(payload)
            except ProtocolError as err:
                await conn.send_error(wire.guess_id(payload), err)
                continue
            if isinstance(msg, wire.Call):
                await self._start(conn, msg, tg)
            elif isinstance(msg, wire.Cancel):
                scope = conn.running.get(msg.id)
                if scope is not None:
                    scope.cancel()
            elif isinstance(msg, wire.Bye):
                return msg.id
            else:
                await conn.send_error(wire.CONNECTION_ID,
                                      ProtocolError("unexpected Hello: the handshake is done"))

    async def _start(self, conn: Connection, call: wire.Call, tg: anyio.abc.TaskGroup) -> None:
        rid = call.id
        if rid <= 0:
            await conn.send_error(wire.CONNECTION_ID,
                                  ProtocolError(f"request id must be positive, got {rid}"))
            return
        if rid in conn.running:
            await conn.send_error(rid, ProtocolError(f"request id {rid} is already in flight"))
            return
        if len(conn.running) >= self.max_inflight:
            await conn.send_error(rid, ProtocolError(
                f"too many requests in flight (limit {self.max_inflight}); await some first"))
            return
        try:
            req = wire.decode_request(call.request)
        except ProtocolError as err:
            await conn.send_error(rid, err)
            return
        scope = anyio.CancelScope()
        conn.running[rid] = scope
        tg.start_soon(self._run, conn, rid, req, scope)

    async def _run(self, conn: Connection, rid: int, req: Any, scope: anyio.CancelScope) -> None:
        """Run one request and send its messages; the last one is its final message."""
        final: Any = None
        try:
            with scope:
                if isinstance(req, P.Generate):
                    stream = await self.engine.generate(req, owner=conn, namespace=conn.namespace)
                    try:
                        async for msg in stream:
                            if not isinstance(msg, P.GenerateChunk):
                                final = msg
                                break
                            await conn.send(rid, msg)
                    finally:
                        stream.close()
                else:
                    final = await self.engine.handle(req, owner=conn, namespace=conn.namespace)
            if scope.cancel_called and isinstance(final, P.ChannelMessage):
                # The client cancelled this receive and will drop its reply, but the receive
                # had already taken a message: it goes back to the front of its queue.
                await self.engine.handle(P.SettleMessage(lease=final.lease, delivered=False),
                                         owner=conn, namespace=conn.namespace)
                final = None
        except _GONE:
            return  # the read loop sees the disconnect and cleans up
        except Exception as err:
            log.exception("request %d of %s failed", rid, conn.peer)
            final = error_reply(err)
        finally:
            # No longer in flight *before* its final message leaves, so a client that
            # counts its calls until their final message never exceeds max_inflight.
            conn.running.pop(rid, None)
        message: Any = wire.Cancelled(id=rid) if final is None else wire.Response(id=rid, reply=final)
        payload = wire.encode(message)
        if len(payload) > self.max_frame_bytes:
            log.error("reply to request %d of %s is %d bytes; sending an error instead",
                      rid, conn.peer, len(payload))
            payload = wire.encode(wire.Response(id=rid, reply=error_reply(PieError(
                f"the reply would be {len(payload)} bytes, over the {self.max_frame_bytes}-byte "
                "frame limit; ask for less in one request"))))
        with _suppress_gone():
            await conn.writer.send(payload)


class _suppress_gone:
    """``contextlib.suppress`` for a peer that went away (and for a timed-out send)."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        return exc_type is not None and issubclass(exc_type, _GONE)


def _peer_name(stream: Any) -> str:
    from anyio.abc import SocketAttribute

    try:
        addr = stream.extra(SocketAttribute.remote_address)
    except Exception:  # Unix socket peers have no name; some streams have no attribute
        return "unix-peer"
    if isinstance(addr, tuple):
        return f"{addr[0]}:{addr[1]}"
    return str(addr) or "unix-peer"

