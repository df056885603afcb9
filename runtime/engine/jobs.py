"""Jobs: one request's progress through the scheduler, as plain data.

A job is a flush/forward (``Forward``) or a generation (``Generate``) on one context. It
never writes the caller's context directly: on admission the scheduler forks a *shadow*
(O(1), a copy of at most the working tail) and the job writes only the shadow. When the job
finishes, the shadow replaces the caller's context in one synchronous swap; when it is
cancelled, fails or is preempted, the shadow is released and the caller's context is exactly
as it was. That is how "a failed or cancelled call changes nothing" holds for every request.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from pie_ctx.proto.messages import (
    Distribution,
    DistributionSpec,
    LogprobSpec,
    PassReport,
    SamplerSpec,
    SampleSpec,
    TopLogprobs,
    TopLogprobSpec,
)

if TYPE_CHECKING:
    import numpy as np

    from pie_ctx.proto.stops import StopChecker
    from runtime.engine.drafts import Drafter
    from runtime.engine.records import ContextRecord


class JobKind(enum.Enum):
    FORWARD = "forward"
    GENERATE = "generate"


class JobStatus(enum.Enum):
    WAITING = "waiting"  # queued for admission (no shadow yet)
    ACTIVE = "active"  # admitted: has a shadow, scheduled step by step
    DONE = "done"  # finished, failed or cancelled; `error` tells which


@dataclass(slots=True, eq=False)
class Job:
    """One request on one context, in three parts: the request (the fields up to ``key``,
    set by ``Passes`` and never changed after), its lifecycle (``status`` on: the shadow,
    ordering, cancel and failure, what was streamed), and its ``progress`` (what it
    computed into the shadow, with the outputs: a preemption starts it over with one
    assignment). Fields after ``status`` are owned by the scheduler."""

    kind: JobKind
    record: ContextRecord  # the context it runs on (``record.cid`` is the caller's context)
    tokens: list[int]
    positions: list[int]
    extras: list[int]
    mask: np.ndarray | None = None  # bool [len(tokens), base_seq_len + len(tokens)]
    commit: bool = True
    reuse_prefix: bool = False
    # forward probes (indices into `tokens`)
    sample: list[SampleSpec] = field(default_factory=list)
    logits: list[int] = field(default_factory=list)
    distributions: list[DistributionSpec] = field(default_factory=list)
    logprobs: list[LogprobSpec] = field(default_factory=list)
    entropy: list[int] = field(default_factory=list)
    top_logprobs: list[TopLogprobSpec] = field(default_factory=list)
    hidden: list[int] = field(default_factory=list)
    scores: Any = None  # runtime.engine.scores.ScoreProbe: attention scores asked
    verify: VerifyRound | None = None  # a speculative round: its draft ends ``tokens``
    # generation
    sampler: SamplerSpec | None = None
    seed: int = 0
    max_tokens: int = 0
    stop_token_ids: frozenset[int] = frozenset()
    stop: StopChecker | None = None
    first_logits: np.ndarray | None = None  # float32 [vocab]: sample the first token from it
    decoding: Decoding = field(default_factory=lambda: Decoding())  # how tokens are picked
    min_tokens: int = 0  # stop tokens are masked until this many tokens were generated
    drafter: Drafter | None = None  # proposes tokens to verify after the pending one
    # called once when the job ends (done, failed or cancelled), on the event loop
    waiter: Callable[[Job], None] | None = None
    on_chunk: Callable[[Job, int, str, Any], None] | None = None  # (job, token, text, row)

    key: int = 0  # unique per engine; names the job's sampling generator
    status: JobStatus = JobStatus.WAITING
    shadow: Any = None  # store ContextId of the shadow while ACTIVE
    base_working_pages: int = 0
    admitted_order: int = 0
    progress: Progress = field(default_factory=lambda: Progress())  # lost on preemption
    num_emitted: int = 0  # generated tokens already streamed (survives preemption)
    finish_reason: str = ""
    error: BaseException | None = None
    cancelled: bool = False
    num_preemptions: int = 0
    share_blocked_since: float | None = None  # held back by its owner's page share since

    @property
    def prompt_remaining(self) -> int:
        return len(self.tokens) - self.progress.num_written

    @property
    def is_decoding(self) -> bool:
        return (self.kind is JobKind.GENERATE and self.prompt_remaining == 0
                and bool(self.progress.generated))

    @property
    def needs_seed_row(self) -> bool:
        """A generation with no prompt samples its first token from cached logits."""
        return self.kind is JobKind.GENERATE and not self.tokens and not self.progress.generated

    @property
    def verify_start(self) -> int:
        """Index in ``tokens`` of a speculative round's first row: the token before its
        draft (only meaningful with ``verify``)."""
        k = 0 if self.verify is None else len(self.verify.draft)
        return len(self.tokens) - k - 1

    def probe_indices(self) -> set[int]:
        """Indices into ``tokens`` whose logits this job needs."""
        wanted = {s.index for s in self.sample}
        wanted.update(self.logits)
        wanted.update(d.index for d in self.distributions)
        wanted.update(lp.index for lp in self.logprobs)
        wanted.update(self.entropy)
        wanted.update(t.index for t in self.top_logprobs)
        wanted.update(self.hidden)
        if self.verify is not None:  # one row per draft token, and one after them
            wanted.update(range(self.verify_start, len(self.tokens)))
        if self.kind is JobKind.GENERATE and self.tokens:
            wanted.add(len(self.tokens) - 1)
        return wanted

    def reset_progress(self) -> None:
        """Forget everything written to the (released) shadow; keep what was streamed."""
        self.shadow = None
        self.status = JobStatus.WAITING
        self.progress = Progress()
        if self.scores is not None:
            self.scores.reset()
        if self.stop is not None:
            self.stop.reset()
        if self.decoding.matcher is not None:
            self.decoding.matcher.reset()  # the replay consumes its tokens again
        if self.drafter is not None:
            self.drafter.reset()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self.status = JobStatus.DONE


@dataclass(slots=True)
class Outputs:
    """A forward's answers, in the order its probes were requested (``rows.py`` fills them
    from ``rows`` when the job finishes)."""

    sampled: list[int] = field(default_factory=list)
    logits: list[bytes] = field(default_factory=list)
    distributions: list[Distribution] = field(default_factory=list)
    logprobs: list[list[float]] = field(default_factory=list)
    entropy: list[float] = field(default_factory=list)
    top_logprobs: list[TopLogprobs] = field(default_factory=list)
    hidden: list[bytes] = field(default_factory=list)
    rows: dict[int, Any] = field(default_factory=dict)  # token index -> RowResult


@dataclass(slots=True)
class Progress:
    """What a job computed into its shadow; a preempted job starts over from a new one."""

    num_written: int = 0  # prompt tokens written to the shadow (attached + computed)
    generated: list[int] = field(default_factory=list)
    report: PassReport = field(default_factory=PassReport)
    out: Outputs = field(default_factory=Outputs)


@dataclass(slots=True)
class Decoding:
    """How a generation's tokens are picked beyond its sampler (docs/decoding.md)."""

    logit_bias: dict[int, float] | None = None
    allowed: list[int] | None = None
    matcher: Any = None  # llguidance matcher of the generation's constraint
    top_logprobs: int = 0  # per token: k most likely tokens and the entropy (0 = none)


@dataclass(slots=True)
class VerifyRound:
    """A speculative round: the last ``len(draft)`` tokens of the job are the draft."""

    draft: list[int]
    sampler: SamplerSpec
    stops: frozenset[int]
    seed: int | None = None
    accepted: int = 0  # results
    token: int | None = None
    rows: list[Any] = field(default_factory=list)  # RowResult of each emitted token


class JobQueue(Protocol):
    """Where request handlers hand jobs over (the engine: its scheduler and its loop)."""

    def submit(self, job: Job) -> None:
        """Queue a job; its ``waiter`` is called when it ends."""
        ...

    def cancel(self, job: Job) -> None:
        """Cancel a job; its context stays exactly as it was before the job."""
        ...
