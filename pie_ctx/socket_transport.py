"""The SDK's transport to an engine behind ``pie-ctx serve`` (Unix socket or TCP).

One ``SocketTransport`` is one connection, and one engine owner: the contexts it creates
live until they are released or the connection ends. Many requests run at once on the
connection; each carries an id and its replies come back tagged with it (the wire protocol
is described in ``pie_ctx.proto.wire`` and docs/server.md).

Reading and writing never wait on each other: a background task reads every frame as it
arrives and files it under its request id, so the server can always write, and a client
writing a burst of requests can never fill both directions at once. Flow control is on the
client: at most ``Welcome.max_inflight`` calls are open at a time (a call counts until its
final message arrives); more wait for a slot instead of being refused.

Threads: :meth:`release_soon` and dropping a generation stream only append to deques
(thread-safe); the queued ``ReleaseContext``/``Cancel`` messages go out before the next
request. Everything else must be called from the event loop that opened the connection.

Imports: only the contract (``pie_ctx.proto``), msgspec and anyio.

Usage::

    async with SocketTransport.open("unix:/run/user/1000/pie-ctx/engine.sock") as t:
        stats = await t.request(GetStats())
"""

from __future__ import annotations

import collections
import contextlib
import os
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import msgspec

from pie_ctx.proto import messages as P
from pie_ctx.proto import wire
from pie_ctx.proto.address import parse_address
from pie_ctx.proto.errors import (
    InvalidArgument,
    PieError,
    ProtocolError,
    error_from_name,
    single_exception,
)
from pie_ctx.proto.framing import FrameReader, FrameWriter, FramingError
from pie_ctx.proto.messages import raise_if_error

__all__ = ["SocketTransport", "SocketGenerateStream"]

_GONE = (anyio.BrokenResourceError, anyio.ClosedResourceError, anyio.EndOfStream, OSError)
_ENVELOPE = 64  # bytes a Call adds around its request


def _default_tokenizer(data: dict[str, Any]) -> Any:
    from pie_ctx.proto.tokenizer import Tokenizer  # torch-free; imported only when first needed

    return Tokenizer.from_wire(data)


class _Inbox:
    """Messages for one request, and the event that wakes its reader."""

    __slots__ = ("messages", "event")

    def __init__(self) -> None:
        self.messages: collections.deque[Any] = collections.deque()
        self.event = anyio.Event()


class SocketTransport:
    """A connection to a pie-ctx server; implements ``pie_ctx.transport.Transport``.

    Open it with :meth:`open` (an async context manager: the connection lives inside it).
    """

    def __init__(self, stream: Any, reader: FrameReader, writer: FrameWriter,
                 welcome: wire.Welcome, tokenizer_factory: Callable[[dict[str, Any]], Any]) -> None:
        self._stream = stream
        self._reader = reader
        self._writer = writer
        self._welcome = welcome
        self._tokenizer_factory = tokenizer_factory
        self._tokenizer: Any = None
        self._inboxes: dict[int, _Inbox] = {}
        self._next_id = 1
        self._open_calls: set[int] = set()  # calls whose final message has not arrived
        self._slot_freed = anyio.Event()
        self._error: PieError | None = None
        self._server_error: P.ErrorReply | None = None
        self._release_queue: collections.deque[int] = collections.deque()
        self._cancel_queue: collections.deque[int] = collections.deque()
        self._closed = False

    @classmethod
    @contextlib.asynccontextmanager
    async def open(cls, address: str | os.PathLike[str], token: str | None = None,
                   namespace: str | None = None, *, timeout: float = 30.0,
                   max_frame_bytes: int = 2**30,
                   tokenizer_factory: Callable[[dict[str, Any]], Any] | None = None,
                   ) -> AsyncIterator[SocketTransport]:
        """Connect, shake hands, and keep the connection open for the ``async with`` block.

        Args:
            address: ``"unix:/path"``, ``"tcp:127.0.0.1:PORT"`` or a socket path.
            token: the server's token (required for TCP; see its token file).
            namespace: a sub-namespace for snapshots, within the token's namespace.
            timeout: seconds allowed for connecting and the handshake.
            max_frame_bytes: largest frame accepted from the server.
            tokenizer_factory: builds the tokenizer from the server's wire data
                (default ``pie_ctx.proto.tokenizer.Tokenizer.from_wire``).

        Raises:
            AuthError: the server refused the token (or its absence).
            ProtocolError: nothing listens at the address, the server did not answer in
                time, a protocol-version mismatch, a bad namespace or a broken handshake.
            InvalidArgument: the address cannot be parsed.
        """
        transport = await cls._connect(address, token, namespace, timeout, max_frame_bytes,
                                       tokenizer_factory or _default_tokenizer)
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(transport._read_loop)
                try:
                    yield transport
                finally:
                    with anyio.CancelScope(shield=True):
                        await transport.aclose()
                    tg.cancel_scope.cancel()
        except BaseExceptionGroup as group:
            raise single_exception(group) from None

    @classmethod
    async def _connect(cls, address: str | os.PathLike[str], token: str | None,
                       namespace: str | None, timeout: float, max_frame_bytes: int,
                       tokenizer_factory: Callable[[dict[str, Any]], Any]) -> SocketTransport:
        addr = parse_address(address)
        try:
            with anyio.fail_after(timeout):
                if addr.kind == "unix":
                    stream: Any = await anyio.connect_unix(addr.path)
                else:
                    stream = await anyio.connect_tcp(addr.host, addr.port)
        except TimeoutError:
            raise ProtocolError(f"connecting to {addr} took longer than {timeout} s") from None
        except OSError as err:
            raise ProtocolError(f"cannot connect to {addr}: {err.strerror or err}; is "
                                "`pie-ctx serve` running there?") from None
        try:
            with anyio.fail_after(timeout):
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
        except TimeoutError:
            await anyio.aclose_forcefully(stream)
            raise ProtocolError(f"the server at {addr} did not finish the handshake within "
                                f"{timeout} s") from None
        except _GONE as err:
            await anyio.aclose_forcefully(stream)
            raise ProtocolError(f"the connection to {addr} broke during the handshake: "
                                f"{err!r}") from None
        except BaseException:
            await anyio.aclose_forcefully(stream)
            raise
        return cls(stream, reader, writer, msg, tokenizer_factory)

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
            await self._cancel_now(rid)  # e.g. the caller was cancelled: stop the server's work
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
                    self._inboxes[rid] = _Inbox()
                    await self._writer.send(wire.encode(wire.Bye(id=rid)))
                    await self._next(rid)
        except (PieError, *_GONE):
            pass  # the server releases everything of a dropped connection anyway
        finally:
            self._fail(ProtocolError("this transport is closed"))
            await anyio.aclose_forcefully(self._stream)

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

    def _encode_request(self, req: Any) -> bytes:
        try:
            body = wire.encode(req)
        except (TypeError, ValueError, OverflowError) as err:
            raise InvalidArgument(f"{type(req).__name__} cannot be sent: {err}") from None
        if len(body) + _ENVELOPE > self._welcome.max_frame_bytes:
            raise InvalidArgument(
                f"{type(req).__name__} encodes to {len(body)} bytes, over the server's frame "
                f"limit of {self._welcome.max_frame_bytes}; split it into smaller requests")
        return body

    async def _open_call(self, body: bytes, inbox: bool) -> int:
        """Wait for a free slot, then send one ``Call``; return its id."""
        while len(self._open_calls) >= self._welcome.max_inflight:
            if self._error is not None:
                raise self._error
            freed = self._slot_freed
            await freed.wait()
        if self._error is not None:
            raise self._error
        rid = self._new_id()
        self._open_calls.add(rid)
        if inbox:
            self._inboxes[rid] = _Inbox()
        try:
            await self._send(wire.Call(id=rid, request=msgspec.Raw(body)))
        except BaseException:
            self._inboxes.pop(rid, None)
            self._close_call(rid)
            raise
        return rid

    async def _call(self, req: Any) -> int:
        if self._error is not None:
            raise self._error
        body = self._encode_request(req)
        await self._send_queued()
        return await self._open_call(body, inbox=True)

    async def _send_queued(self) -> None:
        """Send the releases and cancels queued by synchronous code (their replies are
        dropped by the reader)."""
        while self._cancel_queue:
            await self._send(wire.Cancel(id=self._cancel_queue.popleft()))
        while self._release_queue:
            ctx = self._release_queue.popleft()
            await self._open_call(wire.encode(P.ReleaseContext(ctx=ctx)), inbox=False)

    async def _cancel_now(self, rid: int) -> None:
        """Tell the server to stop request ``rid`` (shielded: the caller may be cancelled)."""
        self._inboxes.pop(rid, None)
        if rid not in self._open_calls or self._error is not None or self._closed:
            return
        with anyio.CancelScope(shield=True), anyio.move_on_after(5):
            try:
                await self._send(wire.Cancel(id=rid))
            except PieError:
                pass

    def _cancel_soon(self, rid: int) -> None:
        self._inboxes.pop(rid, None)
        if rid in self._open_calls and not self._closed:
            self._cancel_queue.append(rid)

    def _close_call(self, rid: int) -> None:
        """Request ``rid`` got its final message: its slot is free."""
        if rid in self._open_calls:
            self._open_calls.discard(rid)
            event, self._slot_freed = self._slot_freed, anyio.Event()
            event.set()

    def _fail(self, err: PieError) -> None:
        if self._error is None:
            if self._server_error is not None and not self._closed:
                err = error_from_name(self._server_error.kind, self._server_error.message)
            self._error = err
        for box in self._inboxes.values():
            box.event.set()
        self._slot_freed.set()

    async def _next(self, rid: int) -> Any:
        """The next message for request ``rid`` (the reader task files them)."""
        while True:
            box = self._inboxes.get(rid)
            if box is None:
                raise StopAsyncIteration  # the request was closed meanwhile
            if box.messages:
                return box.messages.popleft()
            if self._error is not None:
                raise self._error
            box.event = anyio.Event()
            await box.event.wait()

    async def _read_loop(self) -> None:
        """Read every frame as it arrives and file it under its request id."""
        while True:
            try:
                payload = await self._reader.receive()
            except (FramingError, *_GONE) as err:
                self._fail(ProtocolError(f"connection to the server lost: {err!r}"))
                return
            if payload is None:
                self._fail(ProtocolError("the server closed the connection"))
                return
            try:
                msg = wire.decode_server(payload)
            except ProtocolError as err:
                self._fail(err)
                return
            if isinstance(msg, wire.Cancelled):
                self._close_call(msg.id)
            elif isinstance(msg, wire.Response):
                if not isinstance(msg.reply, P.GenerateChunk):
                    self._close_call(msg.id)
                box = self._inboxes.get(msg.id)
                if box is not None:
                    box.messages.append(msg.reply)
                    box.event.set()
                elif msg.id == wire.CONNECTION_ID and isinstance(msg.reply, P.ErrorReply):
                    self._server_error = msg.reply  # the reason, if the server hangs up next


class SocketGenerateStream:
    """The messages of one generation over the socket.

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
        except StopAsyncIteration:
            self._done = True
            raise
        except BaseException:
            self.close()
            raise
        if isinstance(msg, P.GenerateDone | P.ErrorReply):
            self._done = True
            self._transport._inboxes.pop(self._rid, None)
        return msg

    def close(self) -> None:
        """Cancel the generation if still running (sync; the Cancel goes out next send)."""
        if not self._done:
            self._done = True
            self._wake()
            self._transport._cancel_soon(self._rid)

    async def aclose(self) -> None:
        """Cancel the generation if it is still running, now."""
        if self._done:
            return
        self._done = True
        self._wake()
        await self._transport._cancel_now(self._rid)

    def _wake(self) -> None:
        box = self._transport._inboxes.pop(self._rid, None)
        if box is not None:
            box.event.set()  # a reader blocked on this stream sees it closed

    async def __aenter__(self) -> SocketGenerateStream:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    def __del__(self) -> None:
        if not self._done:
            self._transport._cancel_soon(self._rid)
