"""What an inferlet uses to work with others: ``rt.spawn``, ``rt.session``, ``rt.store``.

Owns: the SDK's side of launches (:class:`InferletHandle`), of the launcher's output
(:class:`Session`) and of the shared store (:class:`Store`). Each speaks the contract's
requests over the runtime's transport, so they behave the same in-process, over a socket
and inside the server (docs/inferlets.md).

Usage::

    child = await rt.spawn("summarize", ["--words", "20"])   # from the server's folder
    async for text in child.output():                        # what it rt.session.send()s
        await rt.session.send(text)                          # ... passed on to our launcher
    summary = await child                                    # what its main returned
    await rt.store.set("last-summary", summary)              # durable, namespaced
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Generator, Sequence
from typing import Any

import anyio

from pie_ctx.proto import messages as P
from pie_ctx.proto.errors import InvalidArgument, PieError

__all__ = ["InferletHandle", "Session", "Store", "print_session"]

SessionSink = Callable[[str], Awaitable[None]]


async def print_session(text: str) -> None:
    """The session of a program run by hand (``pie-ctx run``, ``Runtime.local``,
    ``Runtime.connect``): its launcher is whoever reads its standard output."""
    sys.stdout.write(text)
    sys.stdout.flush()


class Session:
    """The stream of text from an inferlet to whoever launched it (``rt.session``).

    Args:
        sink: delivers one text (waits while the reader is behind).
    """

    def __init__(self, sink: SessionSink) -> None:
        self._sink = sink

    async def send(self, text: str) -> None:
        """Stream ``text`` to the launcher, as is (add your own newlines): ``pie-ctx launch``
        prints it, ``POST /v1/pie/inferlets/{name}`` streams it, a spawning inferlet reads it
        from ``handle.output()``, and under ``pie-ctx run`` it goes to standard output.

        Raises:
            InvalidArgument: ``text`` is not a str.
        """
        if not isinstance(text, str):
            raise InvalidArgument(f"session.send takes a str, got {type(text).__name__}; "
                                  "encode it first (json.dumps)")
        if text:
            await self._sink(text)


class InferletHandle:
    """A launched inferlet (``await rt.spawn(name, args)``): await it for its result,
    read its output, or cancel it. It ends when its spawner's runtime closes.

    ``await handle`` returns what its ``main`` returned, as a ``str`` (None for None), after
    skipping any output not yet read. It raises what the inferlet raised if that was a
    ``PieError``, ``InferletFailed`` for any other exception, and ``InferletCancelled`` if
    it was cancelled.
    """

    def __init__(self, transport: Any, launch_id: int, name: str) -> None:
        self._transport = transport
        self.id = launch_id
        self.name = name
        self._cursor = 0
        self._outcome: tuple[str | None, BaseException | None] | None = None
        self._lock = anyio.Lock()

    @property
    def done(self) -> bool:
        """True once its end has been seen (by ``await`` or ``output()``)."""
        return self._outcome is not None

    async def _next(self) -> list[str]:
        """The next texts, or [] once it has ended (its outcome is then recorded)."""
        async with self._lock:
            if self._outcome is not None:
                return []
            try:
                event = await self._transport.request(P.InferletNext(id=self.id,
                                                                     cursor=self._cursor))
            except PieError as err:  # how it ended: its error, or InferletCancelled
                self._outcome = (None, err)
                return []
            self._cursor += len(event.texts)
            if event.done:
                self._outcome = (event.result, None)
            return event.texts

    async def output(self) -> AsyncIterator[str]:
        """The texts it sends with ``rt.session.send``, as they come, until it ends
        (each text once, across every reader)."""
        while True:
            texts = await self._next()
            if not texts and self._outcome is not None:
                return
            for text in texts:
                yield text

    async def result(self) -> str | None:
        """Wait for its end; see the class docstring."""
        while self._outcome is None:
            await self._next()
        value, error = self._outcome
        if error is not None:
            raise error
        return value

    def __await__(self) -> Generator[Any, None, str | None]:
        return self.result().__await__()

    async def cancel(self) -> None:
        """Cancel it (its contexts are released); then awaiting it raises
        ``InferletCancelled``, unless it had already ended. Idempotent."""
        if self._outcome is None:
            await self._transport.request(P.CancelInferlet(id=self.id))

    def __repr__(self) -> str:
        return f"InferletHandle({self.name!r}, id={self.id})"


def check_argv(args: Sequence[str] | str | None) -> list[str]:
    """The words of ``rt.spawn``'s ``args``.

    Raises:
        InvalidArgument: not None, a str, or a sequence of str.
    """
    if args is None:
        return []
    if isinstance(args, str):
        return [args]
    if not isinstance(args, Sequence) or not all(isinstance(a, str) for a in args):
        raise InvalidArgument("spawn's args are the words after `--` of `pie-ctx launch`: a "
                              f"list of str, got {args!r:.80}")
    return list(args)


class Store:
    """Small values shared by every inferlet of the namespace (``rt.store``), durable in
    the server's snapshot directory (crash-safe; in memory for an engine without one).

    Keys are str of 1-128 UTF-8 bytes; values are str or bytes (you get back the type you
    stored) of at most ``rt.info.max_store_value_bytes``.
    """

    def __init__(self, transport: Any) -> None:
        self._transport = transport

    async def get(self, key: str, default: Any = None) -> str | bytes | Any:
        """The value of ``key``, or ``default``."""
        reply = await self._transport.request(P.StoreGet(key=key))
        if not reply.found:
            return default
        return reply.payload.decode() if reply.text else reply.payload

    async def set(self, key: str, value: str | bytes) -> None:
        """Store ``value`` under ``key`` (replacing any), durably once this returns.

        Raises:
            InvalidArgument: a bad key, or a value neither str nor bytes.
            ValueTooLarge: the value is over ``rt.info.max_store_value_bytes``.
            StoreFull: the namespace's store is at ``max_store_keys`` or ``max_store_bytes``.
        """
        if isinstance(value, str):
            payload, text = value.encode(), True
        elif isinstance(value, (bytes, bytearray, memoryview)):
            payload, text = bytes(value), False
        else:
            raise InvalidArgument(f"a store value is str or bytes, got {type(value).__name__}; "
                                  "encode it first (json.dumps)")
        await self._transport.request(P.StoreSet(key=key, payload=payload, text=text))

    async def delete(self, key: str) -> bool:
        """Remove ``key``; returns False if it was not there."""
        return (await self._transport.request(P.StoreDelete(key=key))).found

    async def keys(self, prefix: str = "") -> list[str]:
        """The keys that start with ``prefix``, sorted."""
        return (await self._transport.request(P.StoreKeys(prefix=prefix))).keys
