"""Scheduler unit tests: exact batch composition over a real PageStore, no model."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pie_ctx.proto.errors import InvalidArgument
from pie_ctx.proto.messages import SamplerSpec
from runtime.engine.jobs import Job, JobKind, JobStatus
from runtime.engine.rows import RowResult
from runtime.engine.scheduler import Scheduler
from runtime.engine.step_share import StepShare
from runtime.kv.store import PageStore

PS = 4


def setup(num_pages=64, budget=8):
    store = PageStore(num_pages, PS, num_layers=1, num_kv_heads=1, head_dim=2)
    return store, Scheduler(store, max_step_tokens=budget)


def forward_job(store, n, key=0, start=1):
    handle = SimpleNamespace(cid=store.create_context())
    toks = list(range(start, start + n))
    return Job(JobKind.FORWARD, handle, toks, list(range(n)), [0] * n, key=key)


def gen_job(store, n, max_tokens, key=0):
    job = forward_job(store, n, key, start=1 + 100 * key)  # distinct prompts: no sharing
    job.kind = JobKind.GENERATE
    job.sampler = SamplerSpec()
    job.max_tokens = max_tokens
    job.stop_token_ids = frozenset()
    return job


def step(sched, token=5):
    plan = sched.plan()
    if plan is None:
        return None, []
    shape = [(entry.job.key, entry.length) for entry in plan.entries]
    done = sched.complete(plan, [RowResult(sampled=token, sampled_logprob=0.0) for _ in plan.rows])
    return shape, done


def test_chunked_prefill_respects_the_token_budget():
    store, sched = setup(budget=8)
    job = forward_job(store, 20, key=1)
    sched.submit(job)
    assert step(sched)[0] == [(1, 8)]
    assert step(sched)[0] == [(1, 8)]
    shape, done = step(sched)
    assert shape == [(1, 4)] and done == [job] and job.status is JobStatus.DONE
    assert store.state(job.record.cid).seq_len == 20
    assert step(sched) == (None, [])
    store.check_invariants()


def test_decodes_ride_along_with_prefill_chunks():
    store, sched = setup(budget=8)
    g = gen_job(store, 3, max_tokens=5, key=1)
    sched.submit(g)
    assert step(sched)[0] == [(1, 3)]  # prompt; samples the first token
    f = forward_job(store, 30, key=2)
    sched.submit(f)
    # Every step: the generation's one decode token first, then prefill fills the budget.
    assert step(sched)[0] == [(1, 1), (2, 7)]
    assert step(sched)[0] == [(1, 1), (2, 7)]
    store.check_invariants()


def test_round_robin_between_long_prefills_and_a_late_short_request():
    store, sched = setup(budget=8)
    a, b = forward_job(store, 40, key=1), forward_job(store, 40, key=2)
    sched.submit(a)
    sched.submit(b)
    first = step(sched)[0]
    second = step(sched)[0]
    assert first[0][0] != second[0][0]  # the start rotates: neither prefill starves
    c = forward_job(store, 2, key=3)
    sched.submit(c)
    seen = [step(sched)[0] for _ in range(2)]
    assert any(3 in [k for k, _ in s] for s in seen)  # served within two steps


def test_a_long_generation_gets_one_token_per_step_like_everyone():
    store, sched = setup(budget=16)
    long = gen_job(store, 2, max_tokens=10_000, key=1)
    sched.submit(long)
    step(sched)
    short = gen_job(store, 2, max_tokens=2, key=2)
    sched.submit(short)
    shapes = [step(sched)[0] for _ in range(3)]
    assert shapes[0] == [(1, 1), (2, 2)]
    assert shapes[1] == [(1, 1), (2, 1)]  # short finishes here (2 tokens)
    assert shapes[2] == [(1, 1)]


def test_admission_is_fifo_under_back_pressure():
    store, sched = setup(num_pages=10, budget=64)
    big = forward_job(store, 32, key=1)  # 8 pages
    sched.submit(big)
    plan = sched.plan()  # admitted, in flight
    blocked = forward_job(store, 12, key=2)  # 3 pages: does not fit next to big
    small = forward_job(store, 4, key=3)  # 1 page: would fit, but waits behind `blocked`
    sched.submit(blocked)
    sched.submit(small)
    sched.complete(plan, [])
    assert blocked.status is JobStatus.WAITING and small.status is JobStatus.WAITING
    store.release(big.record.cid)  # the owner releases its context: pages come back
    shape, _ = step(sched)
    assert sorted(shape) == [(2, 12), (3, 4)]
    store.check_invariants()


def test_cancel_waiting_active_and_in_flight():
    store, sched = setup(budget=4)
    a, b = forward_job(store, 12, key=1), forward_job(store, 12, key=2)
    sched.submit(a)
    sched.submit(b)
    free = store.stats().num_pages_free
    plan = sched.plan()  # both admitted; a gets the whole 4-token budget
    assert [e.job.key for e in plan.entries] == [1]
    assert sched.cancel(a) is False  # in flight: dropped when the step completes
    assert sched.cancel(b) is True  # active, not in flight: dropped now
    done = sched.complete(plan, [])
    assert done == [a] and a.status is JobStatus.DONE and b.status is JobStatus.DONE
    stats = store.stats()
    assert stats.num_pages_free + stats.num_pages_cached == free
    assert store.state(a.record.cid).seq_len == 0  # the caller's context never changed
    store.check_invariants()


def test_decode_growth_preempts_the_most_recent_job():
    store, sched = setup(num_pages=6, budget=64)
    a, b = gen_job(store, 8, max_tokens=12, key=1), gen_job(store, 8, max_tokens=12, key=2)
    sched.submit(a)
    sched.submit(b)
    for _ in range(60):
        step(sched)
    assert sched.num_preemptions >= 1 and b.num_preemptions >= 1 and a.num_preemptions == 0
    assert a.status is JobStatus.DONE and len(a.progress.generated) == 12  # the oldest always progresses
    store.release(a.record.cid)
    for _ in range(60):
        step(sched)
    assert b.status is JobStatus.DONE and len(b.progress.generated) == 12
    store.check_invariants()


def test_prefill_progresses_when_decodes_fill_the_budget():
    store, sched = setup(budget=4)
    gens = [gen_job(store, 1, max_tokens=50, key=k) for k in range(1, 6)]
    for g in gens:
        sched.submit(g)
    step(sched)  # prompts (one token each) sample their first tokens
    masked = forward_job(store, 6, key=9)
    masked.mask = __import__("numpy").tril(__import__("numpy").ones((6, 6), dtype=bool))
    plain = forward_job(store, 10, key=10)
    sched.submit(masked)
    sched.submit(plain)
    shapes = [step(sched)[0] for _ in range(4)]
    served = {k for s in shapes for k, _ in s}
    assert {9, 10} <= served  # neither starves behind five decodes and a budget of 4
    assert any((9, 6) in s for s in shapes)  # the masked pass ran whole


def test_decodes_beyond_the_budget_take_turns():
    store, sched = setup(budget=4)
    gens = [gen_job(store, 1, max_tokens=50, key=k) for k in range(1, 7)]
    for g in gens:
        sched.submit(g)
    for _ in range(3):
        step(sched)
    counts = {k: 0 for k in range(1, 7)}
    for _ in range(6):
        for k, _n in step(sched)[0]:
            counts[k] += 1
    assert max(counts.values()) - min(counts.values()) <= 1, counts


def test_prompt_tokens_beside_decodes_keep_the_decodes_share_of_the_step():
    store = PageStore(160, PS, num_layers=1, num_kv_heads=1, head_dim=2)
    sched = Scheduler(store, max_step_tokens=64, decode_share=0.5)
    g = gen_job(store, 3, max_tokens=8, key=1)
    sched.submit(g)
    step(sched)  # the prompt, alone: the whole budget is open
    f = forward_job(store, 400, key=2)
    sched.submit(f)
    # Nothing timed yet: a probe of four pages rides along with the decode.
    assert step(sched)[0] == [(1, 1), (2, 4 * PS)]
    sched.share.observe(1, [], 0.010)  # a decode-only step: 10 ms
    sched.share.observe(1, [(16, 0)], 0.030)  # 16 prompt tokens added 20 ms: 1.25 ms a token
    assert sched.share.cost(16, 0) == pytest.approx(0.020)
    depth = store.state(f.shadow).seq_len  # the probe's tokens
    n = step(sched)[0][1][1]  # the next chunk: as many tokens as add at most 10 ms
    assert sched.share.cost(n, depth) <= 0.010 < sched.share.cost(n + 1, depth)
    assert sched.share.num_bounded == 2
    while g.status is not JobStatus.DONE:  # each step: one decode, a bounded chunk
        shape, _done = step(sched)
        assert shape[0] == (1, 1) and len(shape) == 2 and shape[1][1] < 64
    assert step(sched)[0] == [(2, 64)]  # no decodes left: the prompt fills the budget
    store.check_invariants()


def test_the_prompt_cost_fit_recovers_tokens_keys_and_reads_and_deep_chunks_get_fewer():
    """What a chunk adds is a * tokens + b * keys attended + m * context read: fitted to
    timed steps (non-negative), so a chunk deep in a long context gets fewer tokens than
    one near its start, and a row whose read alone passes the allowance gets none."""
    share = StepShare(0.5, page_size=16)
    share.observe(1, [], 0.010)
    a, b, m = 2e-4, 1e-7, 1e-6
    for n, c in [(64, 0), (8, 4000), (32, 1000), (1, 8000), (128, 300), (16, 6000), (4, 2000)]:
        keys = n * c + n * (n + 1) / 2
        share.observe(1, [(n, c)], 0.010 + a * n + b * keys + m * (c + n))
    assert share.coef == pytest.approx((a, b, m), rel=1e-6)
    allowance = share.allowance(True)
    assert allowance == pytest.approx(0.010)
    shallow, deep = share.tokens_within(allowance, 100), share.tokens_within(allowance, 7000)
    assert shallow > deep >= 1
    for n, c in ((shallow, 100), (deep, 7000)):
        assert share.cost(n, c) <= allowance < share.cost(n + 1, c)
    assert share.tokens_within(allowance, 20000) == 0  # its read alone is over
    assert share.allowance(False) is None  # no decodes: no bound


def test_a_bound_is_never_below_a_token_and_share_zero_turns_it_off():
    store = PageStore(160, PS, num_layers=1, num_kv_heads=1, head_dim=2)
    sched = Scheduler(store, max_step_tokens=64, decode_share=0.5)
    g = gen_job(store, 3, max_tokens=8, key=1)
    sched.submit(g)
    step(sched)
    sched.submit(forward_job(store, 400, key=2))
    sched.share.observe(1, [], 0.001)
    sched.share.observe(1, [(64, 0)], 10.0)  # prompt tokens very dear: the bound is < 1 token
    assert sched.share.tokens_within(sched.share.allowance(True), 0) == 0
    assert step(sched)[0] == [(1, 1), (2, 1)]  # yet the prompt progresses, a token a step
    off = StepShare(0)
    off.observe(1, [], 0.001)
    off.observe(1, [(64, 0)], 1.0)
    assert off.allowance(True) is None


@pytest.mark.parametrize("share", [1, 1.5, -0.1, float("nan"), "0.5", True])
def test_a_bad_decode_share_is_refused(share):
    store = PageStore(8, PS, num_layers=1, num_kv_heads=1, head_dim=2)
    with pytest.raises(InvalidArgument, match="decode_share"):
        Scheduler(store, decode_share=share)
