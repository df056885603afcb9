"""Length-prefixed frames over a byte stream (the lowest layer of the wire protocol).

A frame is a 4-byte unsigned big-endian length ``n`` followed by ``n`` bytes of payload
(one MessagePack message, see ``pie_ctx.proto.wire``). Both ends refuse frames longer
than their ``max_frame_bytes``; a refused, truncated or zero-length frame is a framing
error after which the stream cannot be resynchronised, so the connection must be closed.

Owns: :class:`FrameReader` owns its receive buffer; :class:`FrameWriter` owns the right to
write (a lock, so concurrent tasks never interleave the bytes of two frames).

Invariant: :meth:`FrameReader.receive` is cancellation-safe. It only takes bytes out of
its buffer once a whole frame is there, so a reader cancelled mid-frame loses nothing and
the next call resumes where it stopped. This module imports neither torch nor the engine.
"""

from __future__ import annotations

import struct
from typing import Any

import anyio

from pie_ctx.proto.errors import ProtocolError

__all__ = [
    "DEFAULT_MAX_FRAME_BYTES",
    "HEADER",
    "FramingError",
    "FrameReader",
    "FrameWriter",
    "encode_frame",
]

HEADER = struct.Struct("!I")
DEFAULT_MAX_FRAME_BYTES = 32 * 2**20
_RECV_CHUNK = 1 << 16


class FramingError(ProtocolError):
    """The byte stream does not hold a valid frame; the connection cannot continue."""


def encode_frame(payload: bytes, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> bytes:
    """Prefix ``payload`` with its length.

    Args:
        payload: the encoded message.
        max_frame_bytes: the largest payload allowed.

    Returns:
        The bytes to write: header then payload.

    Raises:
        FramingError: the payload is empty or longer than ``max_frame_bytes``.
    """
    n = len(payload)
    if n == 0 or n > max_frame_bytes:
        raise FramingError(f"frame of {n} bytes is outside [1, {max_frame_bytes}]")
    return HEADER.pack(n) + payload


class FrameReader:
    """Read whole frames from an anyio byte stream.

    Args:
        stream: an anyio ``ByteReceiveStream`` (a socket stream).
        max_frame_bytes: frames announcing more than this many bytes are refused.
    """

    def __init__(self, stream: Any, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> None:
        if max_frame_bytes < 1:
            raise ValueError(f"max_frame_bytes must be positive, got {max_frame_bytes}")
        self._stream = stream
        self._buf = bytearray()
        self.max_frame_bytes = max_frame_bytes

    async def receive(self) -> bytes | None:
        """Return the next frame's payload, or None at a clean end of stream.

        Raises:
            FramingError: the frame is empty or too long, or the stream ended mid-frame.
            anyio.BrokenResourceError: the connection was reset.
        """
        while True:
            if len(self._buf) >= HEADER.size:
                (n,) = HEADER.unpack_from(self._buf)
                if n == 0:
                    raise FramingError("empty frame (length 0)")
                if n > self.max_frame_bytes:
                    raise FramingError(
                        f"frame of {n} bytes exceeds the limit of {self.max_frame_bytes} bytes"
                    )
                end = HEADER.size + n
                if len(self._buf) >= end:
                    payload = bytes(self._buf[HEADER.size:end])
                    del self._buf[:end]
                    return payload
            try:
                chunk = await self._stream.receive(_RECV_CHUNK)
            except anyio.EndOfStream:
                if self._buf:
                    raise FramingError(
                        f"connection closed in the middle of a frame ({len(self._buf)} bytes "
                        "buffered)"
                    ) from None
                return None
            self._buf += chunk


class FrameWriter:
    """Write whole frames to an anyio byte stream, one task at a time.

    Args:
        stream: an anyio ``ByteSendStream``.
        max_frame_bytes: the largest payload this side will send.
    """

    def __init__(self, stream: Any, max_frame_bytes: int = 2**31 - 1,
                 send_timeout: float = 10.0) -> None:
        self._stream = stream
        self._lock = anyio.Lock()
        self._broken = False
        self.max_frame_bytes = max_frame_bytes
        self.send_timeout = send_timeout

    async def send(self, payload: bytes) -> None:
        """Send one frame.

        Cancellation while waiting for the lock sends nothing; once writing starts the
        frame is finished (shielded), so cancelling one request never desynchronises the
        stream. A peer that does not read for ``send_timeout`` seconds breaks the writer.

        Raises:
            FramingError: the payload is too large to frame.
            anyio.BrokenResourceError, anyio.ClosedResourceError: the peer is gone.
        """
        data = encode_frame(payload, self.max_frame_bytes)
        async with self._lock:
            if self._broken:
                raise anyio.BrokenResourceError("an earlier send on this stream timed out")
            with anyio.CancelScope(shield=True) as scope:
                scope.deadline = anyio.current_time() + self.send_timeout
                await self._stream.send(data)
            if scope.cancelled_caught:
                self._broken = True
                raise anyio.BrokenResourceError(
                    f"the peer did not read a frame within {self.send_timeout} s"
                )
