"""``Runtime``: what an inferlet receives as ``rt``.

Owns: one transport (one owner on the engine side) and a task group for the context
operations the SDK starts without awaiting (``fork()``, ``Context(rt)``, ``save()``).
Closing the runtime releases every context its inferlet left open; snapshots stay. After
that, every operation on its contexts raises ``ContextClosed`` at once. It is also the
inferlet's end of the channels between inferlets (``send``/``receive``,
``broadcast``/``subscribe``; docs/messages.md): closing it closes its subscriptions.

Usage::

    async with Runtime.local() as rt:            # boots the default model in-process
        ctx = Context(rt).user("Hi").cue()
        print(await ctx.generate(Sampler.greedy(), max_tokens=32).text())
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

import anyio

from pie_ctx.channels import Mailbox, Receiver, Subscription
from pie_ctx.inferlets import InferletHandle, Session, SessionSink, Store, check_argv, print_session
from pie_ctx.proto import checks
from pie_ctx.proto import messages as P
from pie_ctx.proto.errors import ContextClosed, single_exception
from pie_ctx.transport import LocalTransport, Transport

__all__ = ["Runtime"]


class Runtime:
    """A connection to an engine, in this process or behind ``pie-ctx serve``."""

    def __init__(self, transport: Transport, task_group: Any,
                 session: SessionSink | None = None) -> None:
        self.transport = transport
        self._tg = task_group
        self._closed = False
        self._mailbox = Mailbox(transport)
        self.session = Session(session or print_session)
        """The stream of text to whoever launched this inferlet (``rt.session.send``)."""
        self.store = Store(transport)
        """Small durable values shared by the namespace (``rt.store.get/set/delete/keys``)."""

    @property
    def closed(self) -> bool:
        """True once the runtime's block has ended (its contexts are released)."""
        return self._closed

    # ------------------------------------------------------------------ constructors

    @classmethod
    @asynccontextmanager
    async def local(cls, model: str | None = None, *, page_size: int = 16,
                    num_pages: int | None = None, snapshot_dir: str | os.PathLike | None = None,
                    engine: Any = None, **engine_kw: Any) -> AsyncIterator[Runtime]:
        """Boot an engine in this process (or use ``engine``, already running) for one owner.

        Args:
            model: model reference (None = the default SmolLM2-135M-Instruct).
            page_size: tokens per page.
            num_pages: pool size (default: what ``kv_memory_gb`` holds).
            snapshot_dir: an existing folder where snapshots are durable: they survive the
                runtime and are bounded by the disk, not the pool. None (the default): in
                memory, for this runtime's life (docs/snapshots.md). ``rt.store`` keeps its
                values there too.
            engine: an existing, running engine to share (then ``model`` etc. are ignored).
            **engine_kw: more ``boot_engine`` settings (``kv_memory_gb``, ``weights``,
                ``deterministic``: batch-invariant numerics, on by default, see
                docs/performance.md...).

        Raises:
            StorageError: ``snapshot_dir`` is missing, read-only, or in use by another engine.
        """
        if engine is not None:
            async with cls.over(LocalTransport(engine)) as rt:
                yield rt
            return
        # The documented lazy entry point into the runtime package: torch loads only here.
        from runtime.boot import boot_engine

        booted = boot_engine(model, page_size=page_size, num_pages=num_pages,
                             snapshot_dir=snapshot_dir, **engine_kw)
        async with booted, cls.over(LocalTransport(booted)) as rt:
            yield rt

    @classmethod
    @asynccontextmanager
    async def connect(cls, address: str, *, token: str | None = None,
                      namespace: str | None = None) -> AsyncIterator[Runtime]:
        """Connect to ``pie-ctx serve`` at ``address`` (see docs/server.md)."""
        from pie_ctx.socket_transport import SocketTransport

        async with SocketTransport.open(address, token=token, namespace=namespace) as transport, \
                cls.over(transport) as rt:
            yield rt

    @classmethod
    @asynccontextmanager
    async def over(cls, transport: Transport, *,
                   session: SessionSink | None = None) -> AsyncIterator[Runtime]:
        """A runtime over any ``transport`` (what ``local`` and ``connect`` use; the server
        runs hosted inferlets over its in-process one). Closing it closes the transport.

        Args:
            transport: the connection to the engine.
            session: where ``rt.session.send`` delivers text (default: standard output).
        """
        rt: Runtime | None = None
        try:
            async with anyio.create_task_group() as tg:
                rt = cls(transport, tg, session)
                yield rt
        except BaseExceptionGroup as group:
            # The task group wraps whatever the inferlet raised; give it back unwrapped.
            raise single_exception(group) from None
        finally:
            if rt is not None:
                rt._closed = True
            # Everything the inferlet left open is released by closing its owner.
            with anyio.CancelScope(shield=True):
                await transport.aclose()

    # ----------------------------------------------------------------------- queries

    _adapter_info: P.EngineInfo | None = None  # the info this runtime's adapter calls returned

    @property
    def info(self) -> P.EngineInfo:
        """Model name, page size, vocabulary size, limits and stop tokens of the engine,
        and its LoRA adapters (as of connecting, or of this runtime's last
        ``load_adapter``/``unload_adapter``)."""
        return self._adapter_info or self.transport.info

    async def load_adapter(self, name: str, path: str) -> P.AdapterInfo:
        """Load a PEFT LoRA folder (``adapter_config.json`` + ``adapter_model.safetensors``,
        read by the engine's process) as adapter ``name``, for ``Context(rt, adapter=name)``.

        Returns:
            Its ``AdapterInfo`` (also in ``rt.info.adapters`` now).

        Raises:
            InvalidArgument: ``name`` is already loaded, or is not a valid name.
            ModelError: the folder is missing or not a LoRA this engine supports (DoRA,
                biases, embedding LoRA, another base model): the message says which.
        """
        info = await self.transport.request(P.LoadAdapter(name=name, path=str(path)))
        self._adapter_info = info
        return next(a for a in info.adapters if a.name == name)

    async def unload_adapter(self, name: str) -> None:
        """Stop serving adapter ``name``. Fails, changing nothing, while live contexts use it
        (release them first); snapshots saved under it reopen once it is loaded again.

        Raises:
            AdapterNotFound: no adapter of that name is loaded.
            AdapterInUse: contexts still use it.
        """
        self._adapter_info = await self.transport.request(P.UnloadAdapter(name=name))

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer (``encode``, ``decode``, ``render_chat``...)."""
        return self.transport.tokenizer

    @property
    def page_size(self) -> int:
        """Tokens per KV page (fixed for the engine's life)."""
        return self.transport.info.page_size

    @property
    def model_name(self) -> str:
        """The loaded model's name."""
        return self.transport.info.model_name

    async def snapshots(self) -> list[str]:
        """Names of the saved snapshots this runtime can see."""
        return (await self.transport.request(P.ListSnapshots())).names

    async def release_hold(self, hold: P.HoldReply | int) -> None:
        """End a hold taken by ``Context.retain`` (the reply, or its id) now; its pages
        are the next cached pages to go.

        Raises:
            HoldNotFound: no such live hold of this client (it expired or was released).
        """
        hold_id = hold.hold if isinstance(hold, P.HoldReply) else hold
        await self.transport.request(P.ReleaseHold(hold=hold_id))

    async def stats(self) -> P.EngineStats:
        """Engine-wide counters: pages free/used/cached, hit rate, tokens, time."""
        return await self.transport.request(P.GetStats())

    # ---------------------------------------------------------------------- channels

    async def send(self, channel: str, message: str | bytes) -> None:
        """Put ``message`` at the back of the queue ``channel`` (in this runtime's namespace),
        for exactly one receiver. Waits while the queue is full (back-pressure); cancel it
        like any await (``anyio.fail_after``).

        Args:
            channel: the queue's name: 1-256 characters, no control characters.
            message: a ``str`` or ``bytes`` (the receiver gets the same type back), at most
                ``rt.info.max_message_bytes`` bytes (UTF-8 for a str).

        Raises:
            MessageTooLarge: the message is over the limit (nothing was sent).
            InvalidArgument: a bad name, or a message that is neither str nor bytes.
            TooManyChannels: the queue is not in use yet and the namespace has
                ``rt.info.max_channels`` queues and topics in use.
        """
        name = checks.channel_name(channel, "channel")
        payload, text = checks.message(message, self.info.max_message_bytes)
        await self.transport.request(P.ChannelSend(channel=name, payload=payload, text=text))

    def receive(self, channel: str) -> Receiver:
        """The messages of the queue ``channel``, each for exactly one receiver, in order.

        ``await rt.receive(channel)`` takes one message (waiting for one);
        ``async for message in rt.receive(channel)`` takes them as they come. A receive
        that is cancelled loses nothing: see :class:`Receiver` and docs/messages.md.

        Raises:
            InvalidArgument: a bad name (1-256 characters, no control characters).
        """
        return Receiver(self._mailbox, checks.channel_name(channel, "channel"))

    async def broadcast(self, topic: str, message: str | bytes) -> int:
        """Give ``message`` to every subscription to ``topic`` open right now (a later one
        never sees it). Never waits: a subscriber whose buffer is full loses its oldest
        message instead (it hears so: ``SubscriptionLagged``).

        Args:
            topic: the topic's name: 1-256 characters, no control characters.
            message: a ``str`` or ``bytes``, at most ``rt.info.max_message_bytes`` bytes.

        Returns:
            How many subscriptions got it (0: nobody listens; the message is gone).

        Raises:
            MessageTooLarge: the message is over the limit.
            InvalidArgument: a bad name, or a message that is neither str nor bytes.
        """
        name = checks.channel_name(topic, "topic")
        payload, text = checks.message(message, self.info.max_message_bytes)
        reply = await self.transport.request(P.Broadcast(topic=name, payload=payload, text=text))
        return reply.num_subscribers

    def subscribe(self, topic: str) -> Subscription:
        """A subscription to ``topic``: every message broadcast to it while it is open.

        Three forms:

        * ``sub = await rt.subscribe(topic)``: registered when the await returns (close it
          with ``await sub.aclose()``, or let the runtime close it);
        * ``async with rt.subscribe(topic) as sub:``: registered on entry, closed on exit;
        * ``async for message in rt.subscribe(topic):``: registered at the loop's first
          step, closed when the loop ends.

        The first two are race-free: subscribe, then tell the others to start.

        Raises:
            InvalidArgument: a bad name (1-256 characters, no control characters).
        """
        return Subscription(self._mailbox, checks.channel_name(topic, "topic"))

    # --------------------------------------------------------------------- inferlets

    async def spawn(self, name: str, args: Sequence[str] | None = None) -> InferletHandle:
        """Launch the inferlet ``name`` from the engine's inferlet folder (``pie-ctx serve
        --inferlets DIR``, ``pie-ctx run --inferlets DIR``), inside the engine's process,
        as an owner of its own in this runtime's namespace (docs/inferlets.md).

        Args:
            name: the file's name in the folder, without ``.py`` (``rt.info.inferlet_folder``).
            args: the words its ``main`` gets as ``args`` (as after ``--`` of ``pie-ctx launch``).

        Returns:
            A handle: ``await handle`` for its result, ``handle.output()`` for what it sends
            to its session, ``await handle.cancel()``. It is cancelled when this runtime closes.

        Raises:
            InferletNotFound: no folder, or no such inferlet in it, or a name that leads
                out of it (``..``, an absolute path, a symlink out).
            InvalidArgument: ``args`` is not a list of str.
        """
        argv = check_argv(args)
        reply = await self.transport.request(P.SpawnInferlet(name=name, argv=argv))
        return InferletHandle(self.transport, reply.id, name)

    def start_soon(self, fn: Callable[[], Awaitable[Any]]) -> None:
        """Run ``fn()`` in the background, inside this runtime's lifetime.

        Raises:
            ContextClosed: the runtime is closed.
        """
        if self._closed:
            raise ContextClosed("this runtime is closed (its inferlet ended)")
        self._tg.start_soon(fn)
