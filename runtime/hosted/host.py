"""``InferletHost``: inferlets launched by name, running inside the engine's process.

Owns: every launch (its thread, its event loop, its output buffer, its outcome) and the
table of launch handles by spawner. The engine owns the launches' contexts, as it owns a
socket client's; a launch is one engine owner of its own, in its spawner's namespace, so it
has its own page share.

Threads: each launch runs its inferlet on an event loop of its own, on a thread of its own
(docs/inferlets.md, "CPU-heavy inferlets"): a launch that computes for seconds between
awaits delays the engine's threads by the GIL's switch interval at a time (set to
``SWITCH_INTERVAL`` while hosting), never for its whole computation, and one that hangs or
raises ends alone. The host's methods run on the
engine's loop; a launch's thread reaches them only through ``call_soon_threadsafe`` and
``run_coroutine_threadsafe``.

Invariants:

* A launch's owner is released when it ends, however it ends (return, raise, cancel, the
  engine stopping); a cancel releases it at once, even while its thread is still busy.
* Only the spawner (the owner that asked) can wait for or cancel a launch; when the
  spawner is released (its client left, its runtime closed) its launches are cancelled.
* Only files of the operator's folder run (``InferletFolder``): nothing is ever uploaded.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import logging
import os
import sys
import threading
from dataclasses import dataclass, field
from typing import Any

import anyio

from pie_ctx.loading import inferlet_args, load_inferlet
from pie_ctx.proto import messages as P
from pie_ctx.proto.errors import (
    InferletCancelled,
    InferletFailed,
    InferletUsage,
    InvalidArgument,
    PieError,
)
from pie_ctx.runtime import Runtime
from runtime.hosted.bridge import HostedTransport
from runtime.hosted.folder import InferletFolder

__all__ = ["InferletHost", "host_inferlets", "MAX_RUNNING", "MAX_UNREAD_BYTES"]

log = logging.getLogger("pie_ctx.hosted")

MAX_RUNNING = 64  # launches running at once (each is a thread)
MAX_UNREAD_BYTES = 4 << 20  # session text a launch may have sent and nobody read yet
# The GIL's switch interval while inferlets are hosted: a launch computing without awaiting
# holds the GIL this long before the engine's threads get it back (Python's default, 5 ms,
# slowed a tiny model's steps beside a busy launch about twice as much; docs/inferlets.md).
SWITCH_INTERVAL = 0.001

_IDS = itertools.count(1)


class _Owner:
    """A launch's engine owner (an identity, like a connection)."""

    def __init__(self, name: str, launch_id: int) -> None:
        self.name, self.id = name, launch_id

    def __repr__(self) -> str:
        return f"Launch({self.name!r}, id={self.id})"


@dataclass(eq=False)
class Launch:
    """One running (or ended) inferlet."""

    id: int
    name: str
    spawner: Any
    namespace: str
    owner: _Owner
    texts: list[str] = field(default_factory=list)
    base: int = 0  # the cursor of texts[0] (texts before it were read)
    unread_bytes: int = 0
    changed: anyio.Event = field(default_factory=anyio.Event)
    ended: bool = False
    cancelled: bool = False
    result: str | None = None
    error: PieError | None = None
    loop: asyncio.AbstractEventLoop | None = None
    task: asyncio.Task[Any] | None = None

    def wake(self) -> None:
        self.changed.set()
        self.changed = anyio.Event()


class _Parser(argparse.ArgumentParser):
    """Argument parsing for a hosted inferlet: errors and help are raised, never printed
    on the server's terminal or turned into the server's exit."""

    def error(self, message: str) -> Any:
        raise InferletUsage(f"{self.prog}: {message}\n{self.format_usage()}")

    def exit(self, status: int = 0, message: str | None = None) -> Any:
        raise InferletUsage(message or self.format_help())

    def print_help(self, file: Any = None) -> None:
        raise InferletUsage(self.format_help())


class InferletHost:
    """Launch inferlets of ``folder`` on ``engine``.

    Args:
        engine: the running engine (its loop must be asyncio's).
        folder: the operator's inferlet folder.
    """

    def __init__(self, engine: Any, folder: InferletFolder) -> None:
        self.engine = engine
        self.folder = folder
        self._launches: dict[int, Launch] = {}

    @property
    def num_running(self) -> int:
        return sum(not launch.ended for launch in self._launches.values())

    # --------------------------------------------------------------------- requests

    def spawn(self, name: str, argv: list[str], spawner: Any, namespace: str) -> Launch:
        """Start the inferlet ``name`` (see ``Runtime.spawn``).

        Raises:
            InferletNotFound: see ``InferletFolder.resolve``.
            InvalidArgument: the engine does not run on asyncio, or too many launches run.
        """
        file = self.folder.resolve(name)
        try:
            engine_loop = asyncio.get_running_loop()
        except RuntimeError:
            raise InvalidArgument("hosted inferlets need an engine on asyncio (not trio)") from None
        if self.num_running >= MAX_RUNNING:
            raise InvalidArgument(f"{MAX_RUNNING} hosted inferlets are running already; await "
                                  "or cancel some first")
        launch_id = next(_IDS)
        launch = Launch(launch_id, name, spawner, namespace, _Owner(name, launch_id))
        self._launches[launch_id] = launch
        threading.Thread(target=self._thread, args=(launch, str(file), argv, engine_loop),
                         name=f"pie-ctx-inferlet-{name}-{launch_id}", daemon=True).start()
        return launch

    def _mine(self, launch_id: int, spawner: Any) -> Launch:
        launch = self._launches.get(launch_id)
        if launch is None or launch.spawner is not spawner:
            raise InvalidArgument(f"no launch {launch_id} of yours is running or unread; "
                                  "use the handle rt.spawn returned")
        return launch

    async def next(self, launch_id: int, cursor: int, spawner: Any) -> P.InferletEvent:
        """Texts past ``cursor``, waiting for some or for the end (which raises the
        launch's error, or returns its result, once; then the handle is forgotten)."""
        launch = self._mine(launch_id, spawner)
        while True:
            if cursor < launch.base:
                raise InvalidArgument(f"launch {launch_id}: texts before {launch.base} were "
                                      "read already")
            del launch.texts[:cursor - launch.base]  # the reader has these
            launch.unread_bytes = sum(len(t) for t in launch.texts)
            launch.base = cursor
            if launch.texts:
                launch.wake()  # a sender waiting for room may go on
                return P.InferletEvent(texts=list(launch.texts))
            if launch.ended:
                del self._launches[launch_id]
                if launch.error is not None:
                    raise launch.error
                return P.InferletEvent(texts=[], done=True, result=launch.result)
            await launch.changed.wait()

    def cancel(self, launch_id: int, spawner: Any) -> None:
        """Cancel a launch (idempotent): its owner is released now, its task cancelled."""
        self._cancel(self._mine(launch_id, spawner))

    def _cancel(self, launch: Launch) -> None:
        if launch.ended or launch.cancelled:
            return
        launch.cancelled = True
        self.engine.release_owner(launch.owner)
        if launch.loop is not None and launch.task is not None:
            try:
                launch.loop.call_soon_threadsafe(launch.task.cancel)
            except RuntimeError:
                pass  # its loop has just closed: it ended anyway
        launch.wake()

    def release_owner(self, spawner: Any) -> None:
        """The spawner left: cancel its launches and forget their handles."""
        for launch in [x for x in self._launches.values() if x.spawner is spawner]:
            self._cancel(launch)
            if launch.ended:
                del self._launches[launch.id]
            else:
                launch.spawner = None  # forgotten once it ends (see _finish)

    def stop(self) -> None:
        """The engine stops: cancel every launch."""
        for launch in list(self._launches.values()):
            self._cancel(launch)

    # ------------------------------------------------------------ on the launch's side

    async def _say(self, launch: Launch, text: str) -> None:
        """(engine loop) Queue one session text, waiting while too much is unread."""
        while launch.unread_bytes >= MAX_UNREAD_BYTES and not launch.cancelled:
            await launch.changed.wait()
        if launch.cancelled:
            raise InferletCancelled(f"inferlet {launch.name!r} was cancelled")
        launch.texts.append(text)
        launch.unread_bytes += len(text)
        launch.wake()

    def _finish(self, launch: Launch, result: str | None, error: PieError | None) -> None:
        """(engine loop) Record how a launch ended; release its owner."""
        self.engine.release_owner(launch.owner)
        launch.ended = True
        if launch.cancelled:
            error, result = InferletCancelled(f"inferlet {launch.name!r} was cancelled"), None
        launch.result, launch.error = result, error
        if launch.spawner is None:
            self._launches.pop(launch.id, None)
        launch.wake()

    def _thread(self, launch: Launch, file: str, argv: list[str],
                engine_loop: asyncio.AbstractEventLoop) -> None:
        outcome: tuple[str | None, PieError | None] = (None, None)
        try:
            outcome = asyncio.run(self._run(launch, file, argv, engine_loop))
        except BaseException as err:  # noqa: BLE001 - reported to the spawner, never raised here
            outcome = (None, _as_error(launch, err))
        try:
            engine_loop.call_soon_threadsafe(self._finish, launch, *outcome)
        except RuntimeError:
            pass  # the engine's loop is gone: nobody waits

    async def _run(self, launch: Launch, file: str, argv: list[str],
                   engine_loop: asyncio.AbstractEventLoop) -> tuple[str | None, PieError | None]:
        launch.loop = asyncio.get_running_loop()
        launch.task = asyncio.current_task()
        if launch.cancelled:
            return None, None

        async def say(text: str) -> None:
            await asyncio.wrap_future(
                asyncio.run_coroutine_threadsafe(self._say(launch, text), engine_loop))

        transport = HostedTransport(self.engine, engine_loop, launch.owner, launch.namespace,
                                    lambda: not launch.cancelled)
        try:
            module = load_inferlet(file)
            args = inferlet_args(module, argv, prog=f"pie-ctx launch {launch.name} --",
                                 parser_class=_Parser)
            async with Runtime.over(transport, session=say) as rt:
                result = await module.main(rt, args)
        except BaseException as err:  # noqa: BLE001 - the launch's outcome
            return None, _as_error(launch, err)
        return (None if result is None else str(result)), None


def host_inferlets(engine: Any, folder: str | os.PathLike[str]) -> InferletHost:
    """Let ``engine`` launch the inferlets of ``folder`` (``serve --inferlets DIR``).

    Raises:
        InvalidArgument: ``folder`` is not a folder.
    """
    host = InferletHost(engine, InferletFolder(folder))
    engine.attach_host(host, str(host.folder.path))
    if sys.getswitchinterval() > SWITCH_INTERVAL:
        sys.setswitchinterval(SWITCH_INTERVAL)  # process-wide: see SWITCH_INTERVAL
    return host


def _as_error(launch: Launch, err: BaseException) -> PieError:
    if isinstance(err, PieError):
        return err
    if isinstance(err, (asyncio.CancelledError, anyio.get_cancelled_exc_class())):
        return InferletCancelled(f"inferlet {launch.name!r} was cancelled")
    if isinstance(err, SystemExit):
        return InferletFailed(f"inferlet {launch.name!r} called sys.exit({err.code!r})")
    log.error("inferlet %r (launch %d) raised", launch.name, launch.id, exc_info=err)
    return InferletFailed(f"inferlet {launch.name!r} raised {type(err).__name__}: {err}")


