"""Rows: what a step asks of the model for each job, and what comes back.

Owns: the plain data between the scheduler and the executor (``StepPlan``: the batch, one
``RowRequest`` per logits row, one ``Entry`` per job saying what it put in; ``RowResult``:
what a row produced), and the rules that turn a job into row requests (``row_request``,
``draft_row``, the ``min_tokens`` bias) and a forward's rows back into its outputs
(``fill_forward_outputs``). No torch, no state: the scheduler decides *which* tokens run,
this module only says what each row must compute.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any

from pie_ctx.proto.messages import Distribution, TopLogprobs
from runtime.engine.jobs import Job, JobKind
from runtime.model.batch import SeqInput

__all__ = ["Entry", "EntryKind", "RowRequest", "RowResult", "StepPlan", "draft_row",
           "fill_forward_outputs", "min_tokens_bias", "row_request"]


@dataclass(slots=True)
class RowRequest:
    """What to compute from one logits row (all optional)."""

    sample: Any = None  # SamplerSpec
    generator_seed: int | None = None  # seed for a fresh generator (None: job's own)
    job_key: int = 0  # identifies the job's persistent generator
    raw_logits: bool = False
    top_k: int = 0  # distribution size (0 = none)
    logprob_ids: list[int] | None = None
    given_logits: Any = None  # np.ndarray [vocab]: a row computed earlier (no model row)
    # what the row is sampled from (docs/decoding.md): bias, then restrictions
    logit_bias: dict[int, float] | None = None
    allowed: list[int] | None = None
    matcher: Any = None  # the generation's constraint matcher (llguidance)
    # probes of the model's own distribution (temperature 1)
    top_logprobs: int = 0  # k most likely tokens with their log-probabilities
    entropy: bool = False
    hidden: bool = False  # the final-norm hidden state of the row's token
    # speculative verification: set on the first row of a group of len(draft) + 1 rows
    verify: list[int] | None = None  # the draft tokens the group judges
    stops: frozenset[int] = frozenset()  # a kept draft token in here ends the group


class EntryKind(enum.Enum):
    """What one job puts into a step."""

    PROMPT = "prompt"  # a chunk of ``job.tokens`` from ``start``
    DECODE = "decode"  # a generation's pending token, then any draft to verify
    SEED = "seed"  # one row sampled from cached logits: no chunk, no model compute


@dataclass(slots=True)
class Entry:
    """One job's part of a step."""

    job: Job
    kind: EntryKind
    start: int  # PROMPT: where the chunk starts in ``job.tokens`` (0 for the others)
    length: int  # tokens the chunk writes (0 for a seed row)
    rows: list[tuple[int | None, int]]  # (token index in ``job.tokens`` or None, row)

    @property
    def has_chunk(self) -> bool:
        """Whether the entry runs tokens through the model (all but seed rows)."""
        return self.kind is not EntryKind.SEED


@dataclass(slots=True)
class StepPlan:
    """One step: the model call's batch, the rows asked of it, and who asked."""

    chunks: list[SeqInput] = field(default_factory=list)  # one model call's batch
    rows: list[RowRequest] = field(default_factory=list)
    # one entry per job; the entries with a chunk are in ``chunks`` order
    entries: list[Entry] = field(default_factory=list)

    def subset(self, keep: list[int]) -> tuple[StepPlan, list[int]]:
        """The plan of some entries only (in order), to run them apart from the others.

        Returns:
            ``(plan, rows)``: row ``i`` of the new plan is row ``rows[i]`` of this one.
        """
        if len(keep) == len(self.entries):
            return self, list(range(len(self.rows)))
        sub = StepPlan()
        rows: list[int] = []
        chunk_of = iter(range(len(self.chunks)))
        chunk_index = [next(chunk_of) if e.has_chunk else None for e in self.entries]
        for e in keep:
            entry = self.entries[e]
            chunk = chunk_index[e]
            if chunk is not None:
                sub.chunks.append(self.chunks[chunk])
            new_rows: list[tuple[int | None, int]] = []
            for index, row in entry.rows:
                new_rows.append((index, len(sub.rows)))
                sub.rows.append(self.rows[row])
                rows.append(row)
            sub.entries.append(Entry(entry.job, entry.kind, entry.start, entry.length,
                                     new_rows))
        return sub, rows


@dataclass(slots=True)
class RowResult:
    """What the executor computed for one row."""

    sampled: int | None = None  # for a verify group: the token emitted at this row, if any
    sampled_logprob: float = 0.0
    logits: bytes | None = None
    top_ids: list[int] | None = None
    top_probs: list[float] | None = None
    logprob_ids: list[int] | None = None
    logprobs: list[float] | None = None
    top_logprobs: Any = None  # TopLogprobs
    entropy: float | None = None
    hidden: bytes | None = None
    accepted: int | None = None  # verify groups (first row): draft tokens kept
    error: str | None = None  # the row's job cannot go on (e.g. no token allowed)


def row_request(job: Job, index: int | None) -> RowRequest:
    """The request of the row that reads token ``index`` of ``job`` (None: a decode step's
    pending token, or a seed row's cached logits)."""
    req = RowRequest(job_key=job.key)
    d = job.decoding
    if job.kind is JobKind.GENERATE and (index is None or index == len(job.tokens) - 1):
        req.sample = job.sampler
        req.generator_seed = job.seed if not job.progress.generated else None
        req.logit_bias = min_tokens_bias(job, len(job.progress.generated))
        req.allowed, req.matcher = d.allowed, d.matcher
        req.top_logprobs = d.top_logprobs
        req.entropy = bool(d.top_logprobs)
        return req
    v = job.verify
    if v is not None and index is not None and index >= job.verify_start:
        req.logit_bias, req.allowed = d.logit_bias, d.allowed
        req.top_logprobs, req.entropy = d.top_logprobs, bool(d.top_logprobs)
        if index == job.verify_start:  # the group's first row
            req.verify, req.stops, req.sample = list(v.draft), v.stops, v.sampler
            req.generator_seed = v.seed
        return req
    for s in job.sample:
        if s.index == index:
            req.sample = s.sampler
            req.logit_bias, req.allowed = s.logit_bias, s.allowed_tokens
            # Seeded per row (seed + index), so every sampled row is reproducible.
            req.generator_seed = None if s.sampler.seed is None else s.sampler.seed + index
    req.raw_logits = index in job.logits
    req.entropy = index in job.entropy
    req.hidden = index in job.hidden
    for t in job.top_logprobs:
        if t.index == index:
            req.top_logprobs = max(req.top_logprobs, t.k)
    for d in job.distributions:
        if d.index == index:
            req.top_k = max(req.top_k, d.top_k)
    for lp in job.logprobs:
        if lp.index == index:
            req.logprob_ids = (req.logprob_ids or []) + list(lp.token_ids)
    return req

def draft_row(job: Job, num_generated: int) -> RowRequest:
    """A row judging one draft token of a generation, after ``num_generated`` tokens
    (its constraint's mask comes from the group's first row: ``decoding.adjust``)."""
    d = job.decoding
    return RowRequest(job_key=job.key, logit_bias=min_tokens_bias(job, num_generated),
                      allowed=d.allowed, top_logprobs=d.top_logprobs,
                      entropy=bool(d.top_logprobs))


def fill_forward_outputs(job: Job) -> None:
    """Answer a forward's probes in the order they were requested."""
    rows: dict[int, RowResult] = job.progress.out.rows
    for spec in job.sample:
        job.progress.out.sampled.append(_need(rows, spec.index).sampled)
    for index in job.logits:
        job.progress.out.logits.append(_need(rows, index).logits)
    for d in job.distributions:
        r = _need(rows, d.index)
        job.progress.out.distributions.append(
            Distribution(token_ids=r.top_ids[: d.top_k], probs=r.top_probs[: d.top_k])
        )
    for lp in job.logprobs:
        r = _need(rows, lp.index)
        by_id = dict(zip(r.logprob_ids, r.logprobs, strict=True))
        job.progress.out.logprobs.append([by_id[t] for t in lp.token_ids])
    for index in job.entropy:
        job.progress.out.entropy.append(_need(rows, index).entropy)
    for t in job.top_logprobs:
        top = _need(rows, t.index).top_logprobs
        job.progress.out.top_logprobs.append(TopLogprobs(token_ids=top.token_ids[: t.k],
                                                logprobs=top.logprobs[: t.k]))
    for index in job.hidden:
        job.progress.out.hidden.append(_need(rows, index).hidden)
    v = job.verify
    if v is not None:
        first = job.verify_start
        v.accepted = _need(rows, first).accepted
        emitted = [_need(rows, first + j) for j in range(len(v.draft) + 1)]
        emitted = [r for r in emitted if r.sampled is not None]
        v.rows = emitted
        v.token = emitted[-1].sampled if len(emitted) > v.accepted else None


def _need(rows: dict[int, RowResult], index: int) -> RowResult:
    if index not in rows:
        raise RuntimeError(f"probe row for token index {index} was never computed")
    return rows[index]


def min_tokens_bias(job: Job, num_generated: int) -> dict[int, float] | None:
    """The logit bias of a generation's row after ``num_generated`` tokens: its own, plus
    the stop tokens masked while ``min_tokens`` is not reached."""
    bias = job.decoding.logit_bias
    if num_generated >= job.min_tokens or not job.stop_token_ids:
        return bias
    return {**(bias or {}), **{t: -math.inf for t in job.stop_token_ids}}
