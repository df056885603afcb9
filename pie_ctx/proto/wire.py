"""The wire protocol: the messages that travel in frames between a client and the server.

Every frame (``pie_ctx.proto.framing``) holds one MessagePack-encoded msgspec Struct. The
structs here are envelopes around the plain-data requests and replies of
``pie_ctx.proto.messages``; the engine never sees these envelopes.

Conversation::

    client                                   server
    Hello{protocol_version, token?, namespace?}  ->
                                             <-  Welcome{info, namespace, limits, tokenizer}
                                                 (or Response{id=0, ErrorReply} and close)
    Call{id, request}                        ->
                                             <-  Response{id, reply}          (one reply)
    Call{id, Generate}                       ->
                                             <-  Response{id, GenerateChunk} ... then
                                             <-  Response{id, GenerateDone | ErrorReply}
    Cancel{id}                               ->
                                             <-  Cancelled{id} (if ``id`` had not ended)
    Bye{id}                                  ->
                                             <-  Response{id, Ok}, then the server closes

Request ids are chosen by the client, positive, and unique among its requests in flight;
many requests run concurrently on one connection and their replies may come back in any
order. Id 0 is reserved for connection-level errors (a message that could not be tied to
a request). ``Call.request`` is kept as raw MessagePack so that a request with a bad field
still gets an ``ErrorReply`` under its own id.

Every ``Call`` ends with exactly one final message: its reply (for a generation, the
``GenerateDone`` or ``ErrorReply`` after the chunks), or ``Cancelled`` if a ``Cancel``
stopped it first. A request stops counting against ``Welcome.max_inflight`` before its
final message is sent, so a client that keeps at most that many calls open (counting each
until its final message arrives) is never refused for having too many in flight.

Versioning: ``Hello.protocol_version`` must equal the server's ``PROTOCOL_VERSION`` (from
``pie_ctx.proto.messages``); otherwise the server refuses the connection with a
``ProtocolError`` naming both versions. New optional fields may be added without a bump.

This module imports neither torch nor the engine.
"""

from __future__ import annotations

from typing import Any

import msgspec

from pie_ctx.proto import messages as P
from pie_ctx.proto.errors import ProtocolError

__all__ = [
    "PROTOCOL_VERSION",
    "CONNECTION_ID",
    "Hello",
    "Call",
    "Cancel",
    "Bye",
    "Welcome",
    "Response",
    "Cancelled",
    "ClientMessage",
    "ServerMessage",
    "encode",
    "decode_client",
    "decode_server",
    "decode_request",
    "guess_id",
]

PROTOCOL_VERSION = P.PROTOCOL_VERSION
CONNECTION_ID = 0  # Response id of errors that belong to the connection, not to a request


class Hello(msgspec.Struct, tag=True, kw_only=True, frozen=True):
    """First message of a connection: the client's protocol version and credentials."""

    protocol_version: int
    token: str | None = None
    namespace: str | None = None  # a sub-namespace of the one the token grants


class Call(msgspec.Struct, tag=True, kw_only=True, frozen=True):
    """One request: ``request`` is a ``pie_ctx.proto.messages.Request`` as raw MessagePack."""

    id: int
    request: msgspec.Raw


class Cancel(msgspec.Struct, tag=True, kw_only=True, frozen=True):
    """Stop request ``id`` (a generation, or a request still waiting); no reply is sent."""

    id: int


class Bye(msgspec.Struct, tag=True, kw_only=True, frozen=True):
    """Release everything this connection owns, answer ``Ok`` under ``id``, then close."""

    id: int


class Welcome(msgspec.Struct, tag=True, kw_only=True):
    """The server's answer to a valid ``Hello``."""

    info: P.EngineInfo
    namespace: str  # the snapshot namespace this connection sees
    max_frame_bytes: int  # the largest frame the server accepts
    max_inflight: int  # the most requests one connection may have running at once
    tokenizer: dict[str, Any] | None = None  # ``Tokenizer.to_wire()``, None if unavailable


class Response(msgspec.Struct, tag=True, kw_only=True):
    """A reply (or one streamed message) to the request ``id``."""

    id: int
    reply: P.Reply


class Cancelled(msgspec.Struct, tag=True, kw_only=True):
    """The final message of request ``id``, which a ``Cancel`` stopped before it ended."""

    id: int


ClientMessage = Hello | Call | Cancel | Bye
ServerMessage = Welcome | Response | Cancelled

# msgspec raises DecodeError for most bad input, but a str with invalid UTF-8 surfaces as
# UnicodeDecodeError (a ValueError) and absurd nesting as RecursionError.
_BAD_INPUT = (msgspec.DecodeError, ValueError, RecursionError)

_encoder = msgspec.msgpack.Encoder()
_client_decoder = msgspec.msgpack.Decoder(ClientMessage)
_server_decoder = msgspec.msgpack.Decoder(ServerMessage)
_request_decoder = msgspec.msgpack.Decoder(P.Request)


def encode(msg: Any) -> bytes:
    """Encode any wire or protocol Struct as MessagePack."""
    return _encoder.encode(msg)


def decode_client(payload: bytes) -> Hello | Call | Cancel | Bye:
    """Decode a client-to-server message.

    Raises:
        ProtocolError: not valid MessagePack, an unknown message type, or wrong fields.
    """
    try:
        return _client_decoder.decode(payload)
    except _BAD_INPUT as err:
        raise ProtocolError(f"malformed message: {err}") from None


def decode_server(payload: bytes) -> Welcome | Response | Cancelled:
    """Decode a server-to-client message.

    Raises:
        ProtocolError: the server sent something this client does not understand.
    """
    try:
        return _server_decoder.decode(payload)
    except _BAD_INPUT as err:
        raise ProtocolError(f"malformed message from the server: {err}") from None


def decode_request(raw: msgspec.Raw) -> Any:
    """Decode the request inside a ``Call``.

    Raises:
        ProtocolError: an unknown request type or a field of the wrong type; the message
            says which (msgspec names the field's path, e.g. ``$.ctx``).
    """
    try:
        return _request_decoder.decode(raw)
    except _BAD_INPUT as err:
        raise ProtocolError(f"malformed request: {err}") from None


def guess_id(payload: bytes) -> int:
    """Best-effort request id of a message that failed to decode (``CONNECTION_ID`` if none)."""
    try:
        obj = msgspec.msgpack.decode(payload)
    except _BAD_INPUT:
        return CONNECTION_ID
    if isinstance(obj, dict):
        rid = obj.get("id")
        if isinstance(rid, int) and not isinstance(rid, bool) and 0 < rid < 2**63:
            return rid
    return CONNECTION_ID
