"""``ContextCore``: the SDK-side state of one context, behind one small internal interface.

Owns: the context's runtime handle, its *pending* tokens (filled but not yet in the KV
cache), its conversation, the latest counters the runtime sent, the chain that orders its
operations, and the generations running on it. ``Context`` is the public face; the
``Generator``, ``Forward`` and ``RawContext`` built from a context talk to this object
only through the methods and attributes documented here, so the context's internals can
change without editing them.

Liveness rules (each operation completes or raises in bounded time):

* every operation first checks that the context is open and its runtime is running;
  otherwise it raises ``ContextClosed`` at once;
* ``release()`` cancels the generations still running on the context (their streams end
  with ``ContextClosed``), so it never waits for a consumer;
* an operation queued behind an unfinished generation reads that generation to its end
  (see ``pie_ctx.ops``).

Fire-and-forget errors: ``save()`` may be left un-awaited. If it fails and nobody awaited
it, the next operation on the same context raises that error; a failure nobody ever sees
is logged when the context is released.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from pie_ctx.chat import Conversation
from pie_ctx.ops import Op, OpChain
from pie_ctx.proto import messages as P
from pie_ctx.proto.errors import ContextClosed

if TYPE_CHECKING:
    from pie_ctx.runtime import Runtime

__all__ = ["ContextCore", "Cancellable"]

log = logging.getLogger("pie_ctx")


class Cancellable:
    """Something running on a context that ``release()`` must stop first (a generation)."""

    def cancel(self, reason: BaseException) -> None:
        raise NotImplementedError


class ContextCore:
    """One context's SDK state (see the module docstring).

    Attributes:
        rt: the runtime (``rt.info``, ``rt.tokenizer``); ``transport``: its transport.
        ``handle``: the runtime's id for the context, None until created.
        state: the latest ``ContextState`` the runtime sent. ``pending``: token ids filled
        in but not in the KV cache. ``chat``: the conversation. ``created``: the operation
        that creates the context on the runtime (its error explains a missing handle).
    """

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self.transport = rt.transport
        self.handle: int | None = None
        self.state = P.ContextState(seq_len=0, page_size=rt.page_size, num_committed_pages=0,
                                    num_working_pages=0, num_working_tokens=0, next_position=0)
        self.pending: list[int] = []
        self.chat = Conversation()
        self.chain = OpChain()
        self.released = False
        self.created: Op | None = None
        self.open_report: P.PassReport | None = None  # set when opened from a snapshot
        self._running: set[Cancellable] = set()
        self._unobserved: list[Op] = []

    # ----------------------------------------------------------------------- checks

    def check_open(self) -> None:
        """Raise ``ContextClosed`` if the context was released or its runtime closed."""
        if self.released:
            raise ContextClosed("this context was released; fork, open or create a new one")
        if self.rt.closed:
            raise ContextClosed("this context's runtime is closed (its inferlet ended); "
                                "contexts do not outlive their runtime")

    # ------------------------------------------------------------------- operations

    def spawn(self, body: Callable[[], Awaitable[Any]], *, watch: bool = False) -> Op:
        """Queue ``body`` after every earlier operation and run it in the background.

        Args:
            body: the operation.
            watch: if it fails and nobody awaits the returned op, the next operation on
                this context raises the error.
        """
        self.check_open()
        op, run = self.chain.enqueue(self._guarded(body))
        try:
            self.rt.start_soon(run)
        except BaseException as err:
            op.finish(ContextClosed(f"the runtime could not start this operation: {err}"))
            raise
        if watch:
            self._unobserved.append(op)
        return op

    async def run(self, body: Callable[[], Awaitable[Any]]) -> Any:
        """Run ``body`` after every earlier operation, in the caller's task."""
        self.check_open()
        return await self.chain.run(self._guarded(body))

    def _guarded(self, body: Callable[[], Awaitable[Any]]) -> Callable[[], Awaitable[Any]]:
        async def guarded() -> Any:
            self.raise_unobserved()
            return await body()
        return guarded

    def raise_unobserved(self) -> None:
        """Raise the first error of a watched operation nobody awaited (once)."""
        for op in list(self._unobserved):
            if not op.done.is_set():
                continue
            self._unobserved.remove(op)
            if op.error is not None and not op.observed:
                op.observed = True
                raise op.error

    async def request(self, cls: type, **fields: Any) -> Any:
        """Send a request about this context (call it inside an operation).

        Operations queued before ``release()`` still run (in order); only calls made after
        it are refused, by ``check_open`` when they are made.
        """
        if self.rt.closed:
            self.check_open()
        if self.handle is None:
            if self.created is not None and self.created.error is not None:
                raise self.created.error  # why creating (or forking) it failed
            raise ContextClosed("this context was never created on the runtime")
        return await self.transport.request(cls(ctx=self.handle, **fields))

    async def create(self, adapter: str = "", priority: int | None = None) -> None:
        """Create the context on the runtime (the first operation of a new context), its
        tokens run through LoRA ``adapter`` ("" = the base model), at ``priority`` (None:
        the client's default)."""
        self.adopt(await self.transport.request(P.CreateContext(adapter=adapter,
                                                                priority=priority)))

    async def write_pending(self) -> P.PassReport:
        """Write the pending tokens into the KV cache (call it inside an operation)."""
        if not self.pending:
            return P.PassReport()
        tokens = list(self.pending)
        reply = await self.request(P.Forward, tokens=tokens, reuse_prefix=True)
        del self.pending[: len(tokens)]
        self.set_state(reply.state)
        return reply.report

    def adopt(self, reply: P.ContextReply) -> None:
        """Take the handle and counters of a context the runtime just created."""
        self.handle, self.state = reply.ctx, reply.state
        if self.released:  # released before creation finished: release it here, once
            self.transport.release_soon(reply.ctx)
            self.handle = None

    def set_state(self, state: P.ContextState) -> None:
        """Record the counters of the runtime's latest reply."""
        self.state = state

    # ----------------------------------------------------------------- generations

    def started(self, task: Cancellable) -> None:
        """A generation started running on this context."""
        self._running.add(task)

    def ended(self, task: Cancellable) -> None:
        """A generation ended (finished, failed or cancelled)."""
        self._running.discard(task)

    # --------------------------------------------------------------------- release

    async def release(self) -> None:
        """Free the context's pages; idempotent; never waits for a generation's consumer."""
        if self.released:
            return
        self.released = True
        reason = ContextClosed("the context was released while this generation was running")
        for task in list(self._running):
            task.cancel(reason)
        self._log_unobserved()
        if self.rt.closed:
            return  # closing the runtime released everything it owned

        async def body() -> None:
            if self.handle is not None:
                await self.transport.request(P.ReleaseContext(ctx=self.handle))

        await self.chain.run(body)

    def __del__(self) -> None:
        # Whatever still refers to the context (the Context, a RawContext, a Forward, a
        # Generator) keeps this object alive; once all are gone, the runtime side goes too.
        if self.released or self.handle is None or self.rt.closed:
            return
        if os.environ.get("PIE_CTX_DEBUG"):
            log.warning("context %s was garbage collected without release(); releasing it",
                        self.handle)
        self.transport.release_soon(self.handle)

    def _log_unobserved(self) -> None:
        for op in self._unobserved:
            if op.done.is_set() and op.error is not None and not op.observed:
                log.warning("an operation on a released context failed and nobody awaited it: "
                            "%s", op.error)
        self._unobserved.clear()
