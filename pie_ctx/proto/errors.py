"""Typed errors shared by the SDK and the runtime (public name: ``pie_ctx.errors``).

Pure Python, part of the contract both sides import. Three tiers, as in docs/design.md:

* expected back-pressure is not an error: functions return ``None``/``False``;
* caller misuse raises a subclass of :class:`PieError`, whose message says what to do;
* a broken internal invariant raises :class:`RuntimeError` (a bug, never the caller's fault).

Every call that raises a :class:`PieError` leaves all state exactly as it was.
"""

from __future__ import annotations

__all__ = [
    "PieError",
    "InvalidArgument",
    "ContextClosed",
    "SnapshotNotFound",
    "SnapshotExists",
    "OutOfPages",
    "ContextTooLong",
    "ModelError",
    "AdapterNotFound",
    "AdapterInUse",
    "ProtocolError",
    "AuthError",
    "StorageError",
    "SnapshotCorrupt",
    "SnapshotIncompatible",
    "MessageTooLarge",
    "TooManyChannels",
    "SubscriptionLagged",
    "InferletNotFound",
    "InferletUsage",
    "InferletFailed",
    "InferletCancelled",
    "ValueTooLarge",
    "StoreFull",
    "HoldLimit",
    "HoldNotFound",
    "error_from_name",
    "known_name",
    "single_exception",
]


class PieError(Exception):
    """Base class of every error pie-ctx raises for caller misuse or unmet requests."""


class InvalidArgument(PieError, ValueError):
    """An argument is out of range or of the wrong kind; the message says which and why."""


class ContextClosed(PieError):
    """The context (or raw handle) was released; create, fork or open a new one."""


class SnapshotNotFound(PieError, KeyError):
    """No snapshot has this name (in this namespace); ``rt.snapshots()`` lists the saved names."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class SnapshotExists(PieError):
    """A snapshot with this name already exists; delete it first or pick another name."""


class OutOfPages(PieError):
    """The request needs more KV pages than the pool can ever provide."""


class ContextTooLong(PieError):
    """The context would exceed the model's maximum sequence length."""


class ModelError(PieError):
    """A model file is missing, corrupt or unsupported; the message names the file."""


class AdapterNotFound(InvalidArgument):
    """No LoRA adapter of this name is loaded (``rt.info.adapters`` lists them), or a
    snapshot was saved under an adapter that is not loaded now: load it first
    (``rt.load_adapter``, ``pie-ctx serve --adapter NAME=PATH``)."""


class AdapterInUse(PieError):
    """Live contexts still use the LoRA adapter being unloaded; nothing changed. Release
    those contexts (their requests end first), then unload it."""


class ProtocolError(PieError):
    """A malformed or unexpected message on the wire."""


class AuthError(PieError):
    """The server refused the connection: missing or wrong token."""


class StorageError(PieError, OSError):
    """The snapshot directory failed (disk full, read-only, missing, in use): the message
    names the folder or file and the cause. The operation changed nothing."""


class SnapshotCorrupt(StorageError):
    """A snapshot's file on disk is damaged or missing (checksum, size or content): the
    message names the file. Other snapshots are unaffected; delete this one."""


class SnapshotIncompatible(StorageError):
    """The snapshot was saved by another model, weights or page size than this engine
    runs: the message says which. Reopen it with that engine, or save it again."""


class MessageTooLarge(InvalidArgument):
    """A channel message is over the engine's ``max_message_bytes`` (see ``rt.info``):
    nothing was sent. Split it, or keep the bulk elsewhere (a snapshot, a file) and send
    its name."""


class TooManyChannels(PieError):
    """The namespace already has ``max_channels`` queues and topics in use, or this
    runtime holds ``max_subscriptions`` subscriptions (see ``rt.info``). Drain queues
    nobody reads, or close subscriptions you no longer need (``async with
    rt.subscribe(...)`` closes one for you)."""


class SubscriptionLagged(PieError):
    """A subscription's buffer was full, so broadcasts dropped its oldest messages; the
    message says how many. Nothing else changed: the next receive goes on with the oldest
    message still buffered. Read faster, or treat the topic as lossy."""


class InferletNotFound(InvalidArgument):
    """No inferlet of this name can be launched: the engine has no inferlet folder
    (``pie-ctx serve --inferlets DIR``), or the name is not a file ``NAME.py`` inside it
    (names outside the folder, with ``..``, or symlinks leading out are refused). The
    message lists what is there."""


class InferletUsage(InvalidArgument):
    """The words given to a launched inferlet do not fit its ``add_arguments`` (or asked for
    ``--help``); the message is its usage or help text. Nothing ran."""


class InferletFailed(PieError):
    """A launched inferlet raised an exception that is not a ``PieError``; the message
    names its type and text (the server logs the traceback). Its contexts were released."""


class InferletCancelled(PieError):
    """The launched inferlet was cancelled (``handle.cancel()``, or its launcher left)
    before it returned."""


class ValueTooLarge(InvalidArgument):
    """A store value is over the store's ``max_value_bytes`` (see ``rt.info``); nothing
    was written. Keep the bulk in a snapshot or a file and store its name."""


class StoreFull(PieError):
    """The namespace's store holds ``max_store_bytes`` or ``max_store_keys`` already (see
    ``rt.info``); nothing was written. Delete keys you no longer need."""


class HoldLimit(PieError):
    """A hold would take the client over its held-page limit (``max_held_pages_per_owner``
    in ``rt.info``); nothing was held. Release a hold or hold fewer tokens."""


class HoldNotFound(PieError, KeyError):
    """No live hold has this id for this client: it expired or was released."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


_BY_NAME: dict[str, type[PieError]] = {
    cls.__name__: cls
    for cls in (
        PieError,
        InvalidArgument,
        ContextClosed,
        SnapshotNotFound,
        SnapshotExists,
        OutOfPages,
        ContextTooLong,
        ModelError,
        AdapterNotFound,
        AdapterInUse,
        ProtocolError,
        AuthError,
        StorageError,
        SnapshotCorrupt,
        SnapshotIncompatible,
        MessageTooLarge,
        TooManyChannels,
        SubscriptionLagged,
        InferletNotFound,
        InferletUsage,
        InferletFailed,
        InferletCancelled,
        ValueTooLarge,
        StoreFull,
        HoldLimit,
        HoldNotFound,
    )
}


def known_name(err: PieError) -> str:
    """The name of the nearest class of ``err`` defined here (what a client can rebuild)."""
    return next(c.__name__ for c in type(err).__mro__ if c.__name__ in _BY_NAME)


def error_from_name(name: str, message: str) -> PieError:
    """Rebuild a typed error from its class name (used by transports that carry errors)."""
    return _BY_NAME.get(name, PieError)(message)


def single_exception(group: BaseExceptionGroup) -> BaseException:
    """The one exception inside nested single-member groups, else the group itself.

    Task groups wrap whatever their body raised; callers of the SDK and the engine get the
    inferlet's own exception back.
    """
    exc: BaseException = group
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc
