"""The errors pie-ctx raises: ``from pie_ctx.errors import InvalidArgument, ...``.

This is the public name of the hierarchy defined in ``pie_ctx.proto.errors`` (the contract
both the SDK and the runtime import). See that module for the three error tiers.
"""

from __future__ import annotations

from pie_ctx.proto import errors as _contract

PieError = _contract.PieError
InvalidArgument = _contract.InvalidArgument
ContextClosed = _contract.ContextClosed
SnapshotNotFound = _contract.SnapshotNotFound
SnapshotExists = _contract.SnapshotExists
OutOfPages = _contract.OutOfPages
ContextTooLong = _contract.ContextTooLong
ModelError = _contract.ModelError
AdapterNotFound = _contract.AdapterNotFound
AdapterInUse = _contract.AdapterInUse
ProtocolError = _contract.ProtocolError
AuthError = _contract.AuthError
StorageError = _contract.StorageError
SnapshotCorrupt = _contract.SnapshotCorrupt
SnapshotIncompatible = _contract.SnapshotIncompatible
MessageTooLarge = _contract.MessageTooLarge
TooManyChannels = _contract.TooManyChannels
SubscriptionLagged = _contract.SubscriptionLagged
InferletNotFound = _contract.InferletNotFound
InferletUsage = _contract.InferletUsage
InferletFailed = _contract.InferletFailed
InferletCancelled = _contract.InferletCancelled
ValueTooLarge = _contract.ValueTooLarge
StoreFull = _contract.StoreFull
HoldLimit = _contract.HoldLimit
HoldNotFound = _contract.HoldNotFound
