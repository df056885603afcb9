"""The scheduler: which tokens of which jobs go into the next model call.

Owns: the job queues, admission and preemption, and every mutation of context state at run
time (through the page store). Plain Python over plain data: it never touches tensors, so
tests drive it with a fake executor. What each row of a step computes is ``rows.py``'s.

A step is ``plan() -> StepPlan`` (sync), the model call (off the event loop, by the engine),
then ``complete(plan, output)`` (sync). Policy, in order (see docs/scheduling.md):

1. Admission, FIFO: a waiting job gets a shadow fork of its context, attaches any cached
   prefix pages and reserves pages for the rest of its prompt; a job that cannot get them
   waits, and everyone behind it too, so a large request is never starved by small ones.
2. Every decoding job contributes one token per step: a 10,000-token generation gets the
   same one token per step as everyone else.
3. Prefill chunks fill the remaining token budget, round-robin from a rotating start, so
   long prompts are chunked and cannot starve decodes or each other. With a decode share,
   the prompt chunks of a step that also decodes are bounded further, each by its depth,
   so that the decodes keep that share of the step's time (``step_share.py``; off by
   default).
4. Decode growth reserves a page when a generation needs one. If nothing can run because
   the pool is full, the most recently admitted job is preempted: its shadow is released
   (its committed pages stay cached, so re-admission mostly re-attaches them) and it goes
   back to the queue front. A lone job that cannot run is ``stalled``; the engine fails it
   with ``OutOfPages`` if no release frees pages in time.
   Before any of this, an allocation that finds the pool full has the engine suspend
   idle contexts, then the contexts of jobs still waiting for admission, last in the
   queue first (docs/pages.md, "Suspend and resume"); a waiting job whose context was
   suspended gets its pages back at admission (``resume``), or keeps waiting.
5. Shares: with ``max_pages_per_owner`` set, a job whose owner already holds its share of
   the pool does not get more pages. It waits (it never blocks other owners' jobs behind
   it in the queue), its owner's own most recent job is the one preempted for it, and if
   it is still held back by its share after the stall timeout it fails with an
   ``OutOfPages`` that names its owner's usage (``fail_over_share``).
"""

from __future__ import annotations

import enum
import math
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pie_ctx.proto.errors import InvalidArgument, OutOfPages, PieError
from runtime.engine.jobs import Job, JobKind, JobStatus
from runtime.engine.rows import (
    Entry,
    EntryKind,
    RowRequest,
    RowResult,
    StepPlan,
    draft_row,
    fill_forward_outputs,
    row_request,
)
from runtime.engine.step_share import DEFAULT_DECODE_SHARE, StepShare
from runtime.engine.tenants import Tenants, fair_split
from runtime.model.batch import SeqInput

if TYPE_CHECKING:
    from runtime.kv.store import PageStore


class Room(enum.Enum):
    """Whether a job got the pages it asked for."""

    OK = "ok"
    NO_PAGES = "no_pages"  # the pool is full (of other jobs', contexts' or snapshots' pages)
    OVER_SHARE = "over_share"  # its owner already holds its share of the pool


class Scheduler:
    """Continuous batching over every job of every context, within a token budget."""

    def __init__(self, store: PageStore, *, max_step_tokens: int = 1024,
                 max_pages_per_owner: int | None = None,
                 decode_share: float = DEFAULT_DECODE_SHARE,
                 clock: Callable[[], float] = time.monotonic,
                 tenants: Tenants | None = None) -> None:
        if max_step_tokens < 1:
            raise ValueError("max_step_tokens must be >= 1")
        self.store = store
        self.page_size: int = store.page_size
        self.share = StepShare(decode_share, store.page_size)  # the engine feeds it
        self.max_step_tokens = max_step_tokens
        self.max_pages_per_owner = max_pages_per_owner
        self.tenants = tenants if tenants is not None else Tenants()
        self._clock = clock
        self.waiting: deque[Job] = deque()
        self.active: list[Job] = []
        self._rr = 0  # round-robin cursor over active prefills
        self._rr_decode = 0  # round-robin cursor over decodes, when they exceed the budget
        self._admitted = 0
        self.in_flight: set[Job] = set()
        self.num_steps = 0
        self.num_preemptions = 0
        self.stalled: Job | None = None
        self._held: set[Job] = set()
        self.dropped: list[Job] = []  # jobs plan() dropped or failed; the engine drains it
        # Brings a suspended context back (``ContextTable.resume``; raises ``OutOfPages``
        # without room): a waiting job's context may be suspended to make room for others.
        self.resume: Callable[[Any], Any] = _no_suspends
        self.admitting: Job | None = None  # the job being admitted (its context stays)

    # ----------------------------------------------------------------- queue management

    def submit(self, job: Job) -> None:
        """Queue a job: behind every waiting job of its priority or higher, ahead of the
        lower ones."""
        job.status = JobStatus.WAITING
        mine = _priority(job)
        for i, other in enumerate(self.waiting):
            if _priority(other) < mine:
                self.waiting.insert(i, job)
                return
        self.waiting.append(job)

    def page_limit(self, owner: Any) -> int | None:
        """The most pages ``owner``'s contexts may hold: its tenant's share of the pool, or
        ``max_pages_per_owner`` (None: the whole pool)."""
        tenant = self.tenants.of(owner)
        return tenant.max_pages if tenant is not None else self.max_pages_per_owner

    def cancel(self, job: Job) -> bool:
        """Drop a job, rolling back its shadow.

        Returns:
            True if it was dropped now; False if it is part of the step being computed (then
            ``complete`` drops it and returns it among the finished jobs).
        """
        job.cancelled = True
        if job in self.in_flight:
            return False
        self._drop(job)
        return True

    def queued_records(self) -> list[Any]:
        """The contexts of waiting jobs that may be suspended to make room (their jobs
        resume them at admission): last in the queue first, the job being admitted
        excluded, each once."""
        seen: list[Any] = []
        for job in reversed(self.waiting):
            record = job.record
            if (job is not self.admitting and job.shadow is None and record not in seen
                    and getattr(record, "suspended", None) is None):
                seen.append(record)
        return seen

    def jobs_of(self, owner: Any) -> list[Job]:
        """Every queued or running job on a context of ``owner``."""
        return [j for j in (*self.waiting, *self.active) if _owner(j) == owner]

    def _drop(self, job: Job) -> None:
        if job.status is JobStatus.WAITING and job in self.waiting:
            self.waiting.remove(job)
        if job in self.active:
            self.active.remove(job)
        self._release_shadow(job)
        job.status = JobStatus.DONE

    def _release_shadow(self, job: Job) -> None:
        if job.shadow is not None:
            self.store.release(job.shadow)
            job.shadow = None

    # ------------------------------------------------------------------------ admission

    def _admit(self) -> None:
        """Admit waiting jobs in FIFO order while their whole prompt fits in the pool.

        A job held back by the pool stops admission (so a large request is never starved
        by small ones); a job held back by its owner's share is skipped (it must not hold
        up other owners).
        """
        i = 0
        while i < len(self.waiting):
            job = self.waiting[i]
            if job in self._held:
                return  # preempted during this plan(): let the others run first
            self.admitting = job
            try:
                if getattr(job.record, "suspended", None) is not None:
                    self.resume(job.record)  # suspended while it waited: its pages back
                shadow = self.store.fork(job.record.cid)
            except OutOfPages:
                shadow = None
            except PieError as err:  # a suspended context's page lost on disk
                self._fail(job, err)
                self.dropped.append(job)
                continue
            finally:
                self.admitting = None
            room = Room.NO_PAGES
            if shadow is not None:
                job.shadow = shadow
                job.base_working_pages = self.store.state(shadow).num_working_pages
                if job.reuse_prefix:
                    self._attach_prefix(job)
                    if self._computing_its_prefix(job):
                        # Another job is computing this prompt's next pages right now: wait
                        # and attach them, rather than compute the same pages twice.
                        self.store.release(job.shadow)
                        job.reset_progress()
                        i += 1
                        continue
                # The whole prompt's pages up front: a prompt never stalls half-written.
                extra = 1 if job.kind is JobKind.GENERATE else 0
                room = self._ensure_room(job, job.prompt_remaining + extra)
                if room is Room.OK:
                    del self.waiting[i]
                    job.status = JobStatus.ACTIVE
                    self._admitted += 1
                    job.admitted_order = self._admitted
                    self.active.append(job)
                    continue
                self.store.release(job.shadow)
                job.reset_progress()
            if room is Room.OVER_SHARE:
                i += 1
                continue
            if not self.active:
                self.stalled = job  # only a release elsewhere can help it
            return

    def _computing_its_prefix(self, job: Job) -> Job | None:
        """An active job about to compute the next full page of ``job``'s prompt (both on
        fresh contexts, same tokens, positions and extras up to that page), or None.

        Such a job commits the page (a generation as it goes, a flush when its prompt is
        done); ``job`` then attaches it instead of computing it again, so a burst of requests
        with one new system prompt computes it once. Only prefix-reusing, committing jobs
        qualify, so the page will be shared; ``job`` waits at most until that job ends.
        """
        end = job.progress.num_written + self.page_size  # the end of the next page to attach
        usable = len(job.tokens) - (1 if job.probe_indices() else 0)
        if end > usable or self.store.state(job.record.cid).seq_len != 0:
            return None
        for other in self.active:
            if (other.reuse_prefix and other.commit and len(other.tokens) >= end
                    and other.tokens[:end] == job.tokens[:end]
                    and other.positions[:end] == job.positions[:end]
                    and other.extras[:end] == job.extras[:end]
                    and self.store.adapter_of(other.record.cid)
                    == self.store.adapter_of(job.record.cid)
                    and self.store.state(other.record.cid).seq_len == 0):
                return other
        return None

    def _attach_prefix(self, job: Job) -> None:
        state = self.store.state(job.shadow)
        if state.num_working_tokens != 0:
            return
        # Leave at least one token to compute when its logits are needed.
        usable = len(job.tokens) - (1 if job.probe_indices() else 0)
        if usable < self.page_size:
            return
        loaded = self.store.num_pages_loaded
        num = self.store.attach_prefix(job.shadow, job.tokens[:usable], job.positions[:usable], 0)
        job.progress.num_written = num * self.page_size
        job.progress.report.pages_reused += num
        job.progress.report.pages_from_disk += self.store.num_pages_loaded - loaded
        job.progress.report.tokens_written += job.progress.num_written

    # ------------------------------------------------------------------------- planning

    def plan(self) -> StepPlan | None:
        """Choose the next step's chunks; None when nothing can run now.

        When None is returned while jobs exist, ``stalled`` names the job that waits for
        pages only a release elsewhere can free; the engine fails it with ``fail_stalled``
        if nothing changes for a while.
        """
        self._held = set()
        self.stalled = None
        for job in [j for j in (*self.waiting, *self.active) if j.cancelled]:
            self._drop(job)  # flagged from outside the event loop (a collected stream)
            self.dropped.append(job)
        while True:
            self._admit()
            if not self.active:
                return None
            plan = self._compose()
            if plan.entries:
                self.num_steps += 1
                self.in_flight = {entry.job for entry in plan.entries}
                return plan
            if len(self.active) == 1:
                self.stalled = self.active[0]
                return None
            victim = self._victim()
            if victim is None:
                return None  # held back by their owners' shares only: fail_over_share decides
            self.active.remove(victim)
            self._release_shadow(victim)
            victim.reset_progress()
            victim.num_preemptions += 1
            self.num_preemptions += 1
            self.waiting.appendleft(victim)
            self._held.add(victim)

    def abort_all(self, error: BaseException) -> list[Job]:
        """Fail every job, waiting or active (the engine is stopping); return them."""
        jobs = [*self.waiting, *self.active]
        self.waiting.clear()
        self.active.clear()
        self.in_flight = set()
        for job in jobs:
            self._release_shadow(job)
            job.fail(error)
        return jobs

    def _victim(self) -> Job | None:
        """The job to preempt when nothing can run.

        The pool is full of running jobs' pages: the most recently admitted of the lowest
        priority is preempted (its committed pages stay cached, so re-admission mostly
        re-attaches them). When
        jobs are held back by their owner's share instead, only a job of that owner can
        make room for it.
        """
        over = [j for j in self.active if j.share_blocked_since is not None]
        if over:
            mine = [j for j in self.active if _owner(j) == _owner(over[0])]
            return max(mine, key=_victim_order) if len(mine) > 1 else None
        return max(self.active, key=_victim_order)

    def fail_over_share(self, timeout: float) -> list[Job]:
        """Fail the jobs held back by their owner's share for longer than ``timeout``."""
        now = self._clock()
        failed = []
        for job in [*self.waiting, *self.active]:
            since = job.share_blocked_since
            if since is None or now - since < timeout or job in self.in_flight:
                continue
            self._fail(job, OutOfPages(self._share_message(job)))
            failed.append(job)
        return failed

    def fail_stalled(self) -> Job | None:
        """Fail the stalled job (called when pages did not come back in time)."""
        job = self.stalled
        if job is None or job.status is JobStatus.DONE:
            return None
        self.stalled = None
        self._fail(job, OutOfPages(self._oom_message(job)))
        return job

    def _fail(self, job: Job, error: BaseException) -> None:
        """Take a job out of the queues, roll it back, and fail it."""
        if job in self.waiting:
            self.waiting.remove(job)
        if job in self.active:
            self.active.remove(job)
        self._release_shadow(job)
        job.reset_progress()
        job.fail(error)

    def _compose(self) -> StepPlan:
        plan = StepPlan()
        budget = self.max_step_tokens
        for job in self.active:
            if job.needs_seed_row:
                row = row_request(job, None)
                row.given_logits = job.first_logits
                plan.rows.append(row)
                plan.entries.append(Entry(job, EntryKind.SEED, 0, 0, [(None, len(plan.rows) - 1)]))
        decoding = [j for j in self.active if j.is_decoding]
        prefilling = [j for j in self.active if j.prompt_remaining > 0]
        left = self._tenant_split(decoding, prefilling, budget)
        if len(decoding) > budget or left is not None:  # some decodes wait: rotate who
            start = self._rr_decode % len(decoding) if decoding else 0
            decoding = decoding[start:] + decoding[:start]
            self._rr_decode += budget if left is None else 1
        for job in decoding:
            if budget < 1:
                break
            group = self.tenants.of(_owner(job))
            if left is not None and left[group] < 1:
                continue  # its tenant's part of this step is spent
            used = self._add_decode(plan, job, budget if left is None
                                    else min(budget, left[group]))
            budget -= used
            if left is not None:
                left[group] -= used
        if prefilling:
            decodes = any(e.kind is EntryKind.DECODE for e in plan.entries)
            allowance = self.share.allowance(decodes)  # seconds the chunks may add, or None
            start = self._rr % len(prefilling)
            order = prefilling[start:] + prefilling[:start]
            self._rr += 1
            first, bounded = True, False
            for job in order:
                if budget < 1 and not first:
                    break
                # The first prefill of a step always progresses, even when decodes took the
                # whole budget: at least a page of tokens (one under a decode share), or a
                # custom-masked pass whole.
                group = self.tenants.of(_owner(job))
                if left is not None and left[group] < 1 and not first:
                    continue  # its tenant's part of this step is spent
                if allowance is None:
                    cap = max(budget, self.page_size)
                else:
                    depth = self.store.state(job.shadow).seq_len
                    cap = min(budget, self.share.tokens_within(allowance, depth))
                    bounded |= cap < min(budget, job.prompt_remaining)
                    if cap < 1 and not first:
                        break
                    cap = max(cap, 1)
                if left is not None:
                    cap = min(cap, max(left[group], 1))
                used = self._add_prefill(plan, job, cap, first=first)
                if used:
                    first = False
                    budget -= used
                    if left is not None:
                        left[group] -= used
                    if allowance is not None:
                        cost = self.share.cost(used, depth)
                        allowance = allowance - cost if cost < allowance else 0.0
            self.share.num_bounded += bounded
        return plan

    def _tenant_split(self, decoding: list[Job], prefilling: list[Job],
                      budget: int) -> dict[Any, int] | None:
        """Each tenant's part of this step's tokens when two or more groups (the tenants,
        and the owners with none as one group of weight 1) want more than ``budget`` in
        all: ``fair_split`` of their demand (a decode: one token; a prompt: what is left of
        it) by their shares. None when the step holds everyone's demand, or without two
        groups wanting some."""
        if not self.tenants:
            return None
        demand: dict[Any, int] = {}
        for job in (*decoding, *prefilling):
            group = self.tenants.of(_owner(job))
            demand[group] = demand.get(group, 0) + (
                1 if job.is_decoding else job.prompt_remaining)
        if len(demand) < 2 or sum(demand.values()) <= budget:
            return None
        weight = {g: 1.0 if g is None else g.share for g in demand}
        return fair_split(demand, weight, budget)

    def _ensure_room(self, job: Job, num_tokens: int) -> Room:
        """Reserve working pages in the job's shadow for ``num_tokens`` more tokens."""
        state = self.store.state(job.shadow)
        capacity = state.num_working_pages * self.page_size - state.num_working_tokens
        need = num_tokens - capacity
        if need > 0:
            pages = math.ceil(need / self.page_size)
            share = self.page_limit(_owner(job))
            if share is not None and self.store.owner_pages(_owner(job)) + pages > share:
                if job.share_blocked_since is None:
                    job.share_blocked_since = self._clock()
                return Room.OVER_SHARE
            if not self.store.reserve_working_pages(job.shadow, pages):
                return Room.NO_PAGES
        job.share_blocked_since = None
        return Room.OK

    def _add_prefill(self, plan: StepPlan, job: Job, budget: int, *, first: bool) -> int:
        remaining = job.prompt_remaining
        if job.mask is not None or job.verify is not None:
            # A custom mask may let a token see later tokens of the same pass, and a
            # speculative round is verified in one piece: never split.
            if remaining > budget and not first:
                return 0
            length = remaining
        else:
            length = min(remaining, budget)
        if self._ensure_room(job, length) is not Room.OK:
            return 0
        start = job.progress.num_written
        probes = sorted(i - start for i in job.probe_indices() if start <= i < start + length)
        mask = None
        if job.mask is not None:
            seq_len = self.store.state(job.shadow).seq_len
            mask = job.mask[start : start + length, : seq_len + length]
        self._append(plan, job, EntryKind.PROMPT, start, job.tokens[start : start + length],
                     job.positions[start : start + length], probes, mask)
        return length

    def _add_decode(self, plan: StepPlan, job: Job, budget: int) -> int:
        """One decode step of ``job``: its pending token, then any draft its drafter
        proposes (forced tokens, prompt lookup) as one speculative group; returns how many
        tokens it added (0 when it has no room now)."""
        draft: list[int] = []
        if job.drafter is not None:
            limit = min(budget, job.max_tokens - len(job.progress.generated)) - 1
            draft = job.drafter.propose(job.decoding.matcher, limit)
        if draft and self._ensure_room(job, 1 + len(draft)) is not Room.OK:
            draft = []  # no pages for the draft now: a plain step
        if not draft and self._ensure_room(job, 1) is not Room.OK:
            return 0
        tokens = [job.progress.generated[-1], *draft]
        first = self.store.next_position(job.shadow)
        rows = [row_request(job, None)]
        rows[0].verify = draft or None
        rows[0].stops = job.stop_token_ids
        for j in range(1, len(tokens)):  # the rows judging the draft, one per token
            rows.append(draft_row(job, len(job.progress.generated) + j))
        self._append(plan, job, EntryKind.DECODE, 0, tokens,
                     list(range(first, first + len(tokens))), list(range(len(tokens))), None, rows)
        return len(tokens)

    def _append(self, plan: StepPlan, job: Job, kind: EntryKind, start: int, tokens: list[int],
                positions: list[int], probes: list[int], mask: Any,
                requests: list[RowRequest] | None = None) -> None:
        prompt = kind is EntryKind.PROMPT
        num_cached = self.store.state(job.shadow).seq_len
        tenant = self.tenants.of(_owner(job))
        if tenant is not None:
            tenant.rows += len(tokens)
        extras = job.extras[start : start + len(tokens)] if prompt else [0] * len(tokens)
        self.store.write_tokens(job.shadow, tokens, positions, extras)
        chunk = SeqInput(tokens, positions, self.store.page_table(job.shadow), num_cached,
                         probes, mask, self.store.adapter_of(job.shadow))
        if job.scores is not None:  # attention scores (runtime.engine.scores)
            last = len(job.tokens) - 1 - start  # a generation's prompt row that samples
            sampling = [0] if not prompt else [last] if 0 <= last < len(tokens) else []
            chunk.scores = job.scores.queries(start, len(tokens), sampling)
        rows: list[tuple[int | None, int]] = []
        for i, local in enumerate(probes):
            index = start + local if prompt else None
            rows.append((index, len(plan.rows)))
            plan.rows.append(row_request(job, index) if requests is None
                             else requests[i])
        plan.chunks.append(chunk)
        plan.entries.append(Entry(job, kind, start, len(tokens), rows))

    # ----------------------------------------------------------------------- completion

    def complete(self, plan: StepPlan, results: list[RowResult | None],
                 failed: dict[Job, BaseException] | None = None) -> list[Job]:
        """Apply a step's results; return the jobs that finished (done, failed or cancelled).

        Args:
            plan: the step.
            results: one result per row of the plan (None for the rows of failed jobs).
            failed: jobs whose rows made the step fail, and why; they fail, rolled back.
        """
        finished: list[Job] = []
        self.in_flight = set()
        for entry in plan.entries:
            job, length, rows = entry.job, entry.length, entry.rows
            if job.status is not JobStatus.ACTIVE:
                continue  # preempted meanwhile (cannot happen) or already done
            if failed and job in failed:
                self.active.remove(job)
                self._release_shadow(job)
                job.fail(failed[job])
                finished.append(job)
                continue
            if job.cancelled:
                self._drop(job)
                finished.append(job)
                continue
            job.progress.report.tokens_computed += length
            if job.scores is not None:
                job.scores.absorb()
            if entry.has_chunk:  # a seed row runs no model
                job.progress.report.num_steps += 1
            if entry.kind is EntryKind.PROMPT and length:
                job.progress.num_written += length
                job.progress.report.tokens_written += length
                self._collect_probes(job, rows, results)
            errors = [results[r].error for _, r in rows if results[r].error]
            if errors:  # e.g. a constraint that allows no token: the job cannot go on
                self.active.remove(job)
                self._release_shadow(job)
                job.fail(InvalidArgument(errors[0]))
                finished.append(job)
                continue
            if job.kind is JobKind.GENERATE and rows and job.prompt_remaining == 0:
                if entry.kind is EntryKind.DECODE:
                    self._on_decoded(job, [results[r] for _, r in rows])
                else:
                    self._on_sampled(job, results[rows[-1][1]])
            if job.commit and (job.kind is JobKind.GENERATE or job.prompt_remaining == 0):
                self._commit(job)
            if self._is_finished(job):
                self._finish_ok(job)
                finished.append(job)
        return finished

    def _collect_probes(self, job: Job, rows: list[tuple[int | None, int]],
                        results: list[RowResult]) -> None:
        if job.kind is JobKind.FORWARD:
            for index, row in rows:
                job.progress.out.rows[index] = results[row]

    def _on_decoded(self, job: Job, group: list[RowResult]) -> None:
        """A decode step's tokens: the kept draft tokens, then the one sampled after them,
        up to where the generation ends. The step wrote the pending token and the whole
        draft; what is not kept leaves the shadow, and the last token kept is pending."""
        if job.drafter is not None and len(group) > 1:
            job.drafter.judged(group[0].accepted or 0)
        kept = 0
        for row in group:
            if row.sampled is None:
                break  # a kept stop token ended the draft, or the group is shorter
            self._on_sampled(job, row)
            kept += 1
            if job.finish_reason:
                break
        drop = len(group) - kept
        if drop:
            self.store.truncate_working_page_tokens(job.shadow, drop)

    def _on_sampled(self, job: Job, row: RowResult) -> None:
        token = row.sampled
        if token is None:
            raise RuntimeError("a generation row came back without a sampled token")
        job.progress.generated.append(token)
        if job.drafter is not None:
            job.drafter.accept(token)
        n = len(job.progress.generated)
        matcher = job.decoding.matcher
        if token in job.stop_token_ids:
            job.finish_reason = "stop_token"
            text = job.stop.finish() if job.stop is not None else ""
            self._emit(job, n, token, text, row)
            return
        if matcher is not None and not matcher.consume_token(token):
            raise RuntimeError(f"the constraint refused a token its own mask allowed: "
                               f"{matcher.get_error()}")
        complete = matcher is not None and matcher.is_stopped()
        final = n >= job.max_tokens or complete
        text = job.stop.feed(token, final=final) if job.stop is not None else ""
        if job.stop is not None and job.stop.stopped:
            job.finish_reason = "stop_string"
        elif complete:
            job.finish_reason = "constraint"
        elif n >= job.max_tokens:
            job.finish_reason = "length"
        self._emit(job, n, token, text, row)

    def _emit(self, job: Job, n: int, token: int, text: str, row: RowResult) -> None:
        # After a preemption the job replays deterministically; never stream a token twice.
        if n <= job.num_emitted:
            return
        job.num_emitted = n
        if job.on_chunk is not None:
            job.on_chunk(job, token, text, row)

    def _commit(self, job: Job) -> None:
        before = self.store.state(job.shadow).num_committed_pages
        self.store.commit_full_pages(job.shadow)
        after = self.store.state(job.shadow).num_committed_pages
        job.progress.report.pages_computed += after - before

    def _is_finished(self, job: Job) -> bool:
        if job.kind is JobKind.FORWARD:
            return job.prompt_remaining == 0
        return bool(job.finish_reason)

    def _finish_ok(self, job: Job) -> None:
        """Swap the shadow in for the caller's context: the job's one visible effect."""
        self.active.remove(job)
        shadow = job.shadow
        state = self.store.state(shadow)
        used = math.ceil(state.num_working_tokens / self.page_size)
        spare = state.num_working_pages - max(used, job.base_working_pages)
        if spare > 0:
            self.store.release_working_pages(shadow, spare)
        if job.kind is JobKind.FORWARD:
            fill_forward_outputs(job)
        old = job.record.cid
        job.record.cid = shadow
        job.shadow = None
        self.store.release(old)
        job.status = JobStatus.DONE

    def _oom_message(self, job: Job) -> str:
        total = self.store.num_pages_total
        mine = self.store.owner_pages(_owner(job))
        return (
            f"the KV pool ({total} pages of {self.page_size} tokens) cannot hold this request "
            f"next to the contexts and snapshots that are alive ({mine} of them are held by "
            f"your contexts): release contexts or snapshots you no longer need, lower "
            f"max_tokens, or start the engine with more pages"
        )

    def _share_message(self, job: Job) -> str:
        mine = self.store.owner_pages(_owner(job))
        return (
            f"your contexts hold {mine} pages of your {self.page_limit(_owner(job))}-page share of "
            f"the KV pool, and this request needs more: release contexts you no longer need "
            f"or lower max_tokens (other clients' pages are not yours to free)"
        )


def _no_suspends(record: Any) -> None:
    raise RuntimeError("a suspended context reached a scheduler with no resume")


def _priority(job: Job) -> int:
    return getattr(job.record, "priority", 0)


def _victim_order(job: Job) -> tuple[int, int]:
    """Preempted first: the lowest priority, then the most recently admitted."""
    return (-_priority(job), job.admitted_order)


def _owner(job: Job) -> Any:
    return getattr(job.record, "owner", None)
