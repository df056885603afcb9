"""The SDK's transport to an engine behind ``pie-ctx serve`` (Unix socket or TCP).

One ``SocketTransport`` is one connection, and one engine owner: the contexts it creates
live until they are released or the connection ends. Many requests run at once on the
connection; each carries an id and its replies come back tagged with it (the wire protocol
is described in ``runtime.server.wire`` and docs/server.md).

There is no background task (so the transport works under any anyio backend and needs no
task group): whichever caller is waiting for a reply reads frames for everyone, files each
one under its request id, and hands the reading over when its own reply has come. Frame
reading is cancellation-safe, so a cancelled caller never leaves half a frame behind.

Threads: :meth:`release_soon` and dropping a generation stream only append to deques
(thread-safe); the queued ``ReleaseContext``/``Cancel`` messages go out before the next
request. Everything else must be called from the event loop that connected.

Imports: only pie_ctx, msgspec, anyio and the torch-free wire modules of runtime.server.
"""

from __future__ import annotations

import collections
import os
from collections.abc import Callable
from typing import Any

import anyio
import msgspec

from pie_ctx import protocol as P
from pie_ctx.errors import InvalidArgument, PieError, ProtocolError, error_from_name
from pie_ctx.transport import raise_if_error
from runtime.server import wire
from runtime.server.endpoint import parse_address
from runtime.server.framing import FrameReader, FrameWriter, FramingError

__all__ = ["SocketTransport", "SocketGenerateStream"]

_GONE = (anyio.BrokenResourceError, anyio.ClosedResourceError, anyio.EndOfStream, OSError)
_END = (P.GenerateDone, P.ErrorReply)


def _default_tokenizer(data: dict[str, Any]) -> Any:
    from pie_ctx.tokenizer import Tokenizer  # torch-free; imported only when first needed

    return Tokenizer.from_wire(data)


class SocketTransport:
    """A connection to a pie-ctx server; implements ``pie_ctx.transport.Transport``.

    Build it with :meth:`connect`; close it with :meth:`aclose` (or ``async with``).
    """

    def __init__(self, stream: Any, reader: FrameReader, writer: FrameWriter,
                 welcome: wire.Welcome, tokenizer_factory: Callable[[dict[str, Any]], Any]) -> None:
        self._stream = stream
        self._reader = reader
        self._writer = writer
        self._welcome = welcome
        self._tokenizer_factory = tokenizer_factory
        self._tokenizer: Any = None
        self._inboxes: dict[int, collections.deque[Any]] = {}
        self._next_id = 1
        self._reading = False
        self._changed = anyio.Event()
        self._error: PieError | None = None
        self._server_error: P.ErrorReply | None = None
        self._release_queue: collections.deque[int] = collections.deque()
        self._cancel_queue: collections.deque[int] = collections.deque()
        self._closed = False

    @classmethod
    async def connect(cls, address: str | os.PathLike[str], token: str | None = None,
                      namespace: str | None = None, *, timeout: float = 30.0,
                      max_frame_bytes: int = 2**30,
                      tokenizer_factory: Callable[[dict[str, Any]], Any] | None = None,
                      ) -> SocketTransport:
        """Connect and shake hands.

        Args:
            address: ``"unix:/path"``, ``"tcp:127.0.0.1:PORT"`` or a socket path.
            token: the server's token (required for TCP; see its token file).
            namespace: a sub-namespace for snapshots, within the token's namespace.
            timeout: seconds allowed for connecting and the handshake.
            max_frame_bytes: largest frame accepted from the server.
            tokenizer_factory: builds the tokenizer from the server's wire data
                (default ``pie_ctx.tokenizer.Tokenizer.from_wire``).

        Raises:
            AuthError: the server refused the token (or its absence).
            ProtocolError: a protocol-version mismatch, a bad namespace or a broken handshake.
            InvalidArgument: the address cannot be parsed.
            OSError: nothing listens at the address.
            TimeoutError: the server did not answer within ``timeout``.
        """
        addr = parse_address(address)
        with anyio.fail_after(timeout):
            if addr.kind == "unix":
                stream: Any = await anyio.connect_unix(addr.path)
            else:
                stream = await anyio.connect_tcp(addr.host, addr.port)
            try:
                reader = FrameReader(stream, max_frame_bytes)
                writer = FrameWriter(stream)
                await writer.send(wire.encode(wire.Hello(
                    protocol_version=wire.PROTOCOL_VERSION, token=token, namespace=namespace)))
                payload = await reader.receive()
                if payload is None:
                    raise ProtocolError("the server closed the connection during the handshake")
                msg = wire.decode_server(payload)
                if isinstance(msg, wire.Response) and isinstance(msg.reply, P.ErrorReply):
                    raise error_from_name(msg.reply.kind, msg.reply.message)
                if not isinstance(msg, wire.Welcome):
                    raise ProtocolError(f"expected Welcome, got {type(msg).__name__}")
            except BaseException:
                await anyio.aclose_forcefully(stream)
                raise
        return cls(stream, reader, writer, msg, tokenizer_factory or _default_tokenizer)

    # ------------------------------------------------------------------- Transport API

    @property
    def info(self) -> P.EngineInfo:
        return self._welcome.info

    @property
    def namespace(self) -> str:
        """The snapshot namespace the server gave this connection."""
        return self._welcome.namespace

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            if self._welcome.tokenizer is None:
                raise ProtocolError("the server did not send its tokenizer")
            self._tokenizer = self._tokenizer_factory(self._welcome.tokenizer)
        return self._tokenizer

    async def request(self, req: Any) -> Any:
        """Send one non-streaming request; return its reply or raise its typed error.

        Raises:
            PieError: the engine's typed error; ``ProtocolError`` if the connection is lost.
        """
        rid = await self._call(req)
        try:
            reply = await self._next(rid)
        except BaseException:
            self._cancel_soon(rid)  # e.g. the caller was cancelled: stop the server's work
            raise
        finally:
            self._inboxes.pop(rid, None)
        return raise_if_error(reply)

    async def generate(self, req: P.Generate) -> SocketGenerateStream:
        """Start a generation; iterate the stream for ``GenerateChunk``s then the end."""
        return SocketGenerateStream(self, await self._call(req))

    def release_soon(self, ctx: int) -> None:
        """Queue a ``ReleaseContext`` (thread-safe; sent before the next request)."""
        if not self._closed:
            self._release_queue.append(ctx)

    async def aclose(self) -> None:
        """Release every context of this connection (snapshots stay) and disconnect."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._error is None:
                with anyio.move_on_after(5):
                    rid = self._new_id()
                    self._inboxes[rid] = collections.deque()
                    await self._writer.send(wire.encode(wire.Bye(id=rid)))
                    await self._next(rid)
        except (PieError, *_GONE):
            pass  # the server releases everything of a dropped connection anyway
        finally:
            self._fail(ProtocolError("this transport is closed"))
            await anyio.aclose_forcefully(self._stream)

    async def __aenter__(self) -> SocketTransport:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    # ------------------------------------------------------------------------ internals

    def _new_id(self) -> int:
        rid = self._next_id
        self._next_id += 1
        return rid

    async def _send(self, msg: Any) -> None:
        try:
            await self._writer.send(wire.encode(msg))
        except _GONE as err:
            self._fail(ProtocolError(f"connection to the server lost: {err!r}"))
            raise self._error from None  # type: ignore[misc]

    async def _call(self, req: Any) -> int:
        if self._error is not None:
            raise self._error
        while self._release_queue or self._cancel_queue:
            if self._cancel_queue:
                await self._send(wire.Cancel(id=self._cancel_queue.popleft()))
            else:
                ctx = self._release_queue.popleft()  # the reply is dropped (no inbox)
                await self._send(wire.Call(id=self._new_id(), request=msgspec.Raw(
                    wire.encode(P.ReleaseContext(ctx=ctx)))))
        body = wire.encode(req)
        if len(body) + 64 > self._welcome.max_frame_bytes:  # 64: room for the envelope
            raise InvalidArgument(
                f"{type(req).__name__} encodes to {len(body)} bytes, over the server's frame "
                f"limit of {self._welcome.max_frame_bytes}; split it into smaller requests")
        rid = self._new_id()
        self._inboxes[rid] = collections.deque()
        try:
            await self._send(wire.Call(id=rid, request=msgspec.Raw(body)))
        except BaseException:
            self._inboxes.pop(rid, None)
            raise
        return rid

    def _cancel_soon(self, rid: int) -> None:
        self._inboxes.pop(rid, None)
        if not self._closed:
            self._cancel_queue.append(rid)

    def _wake(self) -> None:
        event, self._changed = self._changed, anyio.Event()
        event.set()

    def _fail(self, err: PieError) -> None:
        if self._error is None:
            if self._server_error is not None and not self._closed:
                err = error_from_name(self._server_error.kind, self._server_error.message)
            self._error = err
        self._wake()

    async def _next(self, rid: int) -> Any:
        """The next message for request ``rid``, reading frames for everyone meanwhile."""
        while True:
            box = self._inboxes.get(rid)
            if box:
                return box.popleft()
            if self._error is not None:
                raise self._error
            if box is None:
                raise RuntimeError(f"request {rid} has no inbox (already finished)")
            if self._reading:
                await self._changed.wait()
                continue
            self._reading = True
            try:
                payload = await self._reader.receive()
            except (FramingError, *_GONE) as err:
                self._fail(ProtocolError(f"connection to the server lost: {err!r}"))
                continue
            finally:
                self._reading = False
                self._wake()
            if payload is None:
                self._fail(ProtocolError("the server closed the connection"))
                continue
            try:
                msg = wire.decode_server(payload)
            except ProtocolError as err:
                self._fail(err)
                continue
            if isinstance(msg, wire.Response):
                inbox = self._inboxes.get(msg.id)
                if inbox is not None:
                    inbox.append(msg.reply)
                elif msg.id == wire.CONNECTION_ID and isinstance(msg.reply, P.ErrorReply):
                    self._server_error = msg.reply  # the reason, if the server hangs up next


class SocketGenerateStream:
    """The messages of one generation over the socket (see ``Engine.generate``).

    Yields ``GenerateChunk``s, then ``GenerateDone`` or ``ErrorReply``. ``aclose()`` (or
    leaving ``async with``) before the end cancels the generation on the server.
    """

    def __init__(self, transport: SocketTransport, rid: int) -> None:
        self._transport = transport
        self._rid = rid
        self._done = False

    def __aiter__(self) -> SocketGenerateStream:
        return self

    async def __anext__(self) -> Any:
        if self._done:
            raise StopAsyncIteration
        try:
            msg = await self._transport._next(self._rid)
        except BaseException:
            self.close()
            raise
        if isinstance(msg, _END):
            self._done = True
            self._transport._inboxes.pop(self._rid, None)
        return msg

    def close(self) -> None:
        """Cancel the generation if still running (sync; the Cancel goes out next send)."""
        if not self._done:
            self._done = True
            self._transport._cancel_soon(self._rid)

    async def aclose(self) -> None:
        """Cancel the generation if it is still running, now."""
        if self._done:
            return
        self._done = True
        t = self._transport
        t._inboxes.pop(self._rid, None)
        if t._error is None and not t._closed:
            with anyio.move_on_after(5, shield=True):
                try:
                    await t._send(wire.Cancel(id=self._rid))
                except PieError:
                    pass

    async def __aenter__(self) -> SocketGenerateStream:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    def __del__(self) -> None:
        if not self._done:
            self._transport._cancel_soon(self._rid)
