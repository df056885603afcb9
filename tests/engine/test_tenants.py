"""Tenants and priorities in the scheduler, over a real PageStore and no model: the weighted
split of a step's tokens, a flooding tenant kept to its share of the rows, each tenant's
share of the pool, and priorities in admission and preemption."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from runtime.engine.jobs import Job, JobKind
from runtime.engine.rows import RowResult
from runtime.engine.scheduler import Scheduler
from runtime.engine.tenants import Tenant, Tenants, fair_split
from runtime.kv.store import PageStore

PS = 4


def make(num_pages: int = 256, budget: int = 16) -> tuple[PageStore, Scheduler, Tenants]:
    store = PageStore(num_pages, PS, num_layers=1, num_kv_heads=1, head_dim=2)
    tenants = Tenants()
    return store, Scheduler(store, max_step_tokens=budget, tenants=tenants), tenants


def job(store: PageStore, owner: object, n: int, key: int, priority: int = 0) -> Job:
    record = SimpleNamespace(cid=store.create_context(owner), owner=owner, priority=priority)
    tokens = list(range(1000 * key, 1000 * key + n))  # distinct prompts: no sharing
    return Job(JobKind.FORWARD, record, tokens, list(range(n)), [0] * n, key=key)


def run_step(sched: Scheduler) -> list:
    plan = sched.plan()
    if plan is None:
        return []
    sched.complete(plan, [RowResult(sampled=1, sampled_logprob=0.0) for _ in plan.rows])
    return plan.entries


@pytest.mark.parametrize(("demand", "weight", "budget", "want"), [
    ({"a": 100, "b": 100}, {"a": 1, "b": 1}, 16, {"a": 8, "b": 8}),
    ({"a": 100, "b": 3}, {"a": 1, "b": 1}, 16, {"a": 13, "b": 3}),  # b gives its rest back
    ({"a": 100, "b": 100}, {"a": 3, "b": 1}, 16, {"a": 12, "b": 4}),
    ({"a": 5, "b": 5}, {"a": 1, "b": 1}, 16, {"a": 5, "b": 5}),
    ({"a": 100, "b": 100, "c": 100}, {"a": 1, "b": 1, "c": 1}, 2, {"a": 1, "b": 1, "c": 0}),
])
def test_fair_split_is_weighted_max_min(demand, weight, budget, want):
    got = fair_split(demand, weight, budget)
    assert got == want
    assert sum(got.values()) == min(budget, sum(demand.values()))


def test_a_flooding_tenant_gets_its_share_of_the_rows_not_more():
    store, sched, tenants = make(budget=16)
    a, b = object(), object()
    tenants.add(a, Tenant("a", 1.0), store.num_pages_total)
    tenants.add(b, Tenant("b", 1.0), store.num_pages_total)
    for i in range(8):  # a floods: eight long prompts against b's two
        sched.submit(job(store, a, 64, key=i))
    for i in range(2):
        sched.submit(job(store, b, 64, key=100 + i))
    rows = {"a": 0, "b": 0}
    for _ in range(6):  # while both still want more than a step holds
        for entry in run_step(sched):
            rows[tenants.of(entry.job.record.owner).name] += entry.length
    assert rows["a"] == rows["b"] == 48  # 8 + 8 a step
    assert tenants.of(a).rows == 48 and tenants.of(b).rows == 48
    store.check_invariants()


def test_shares_weigh_the_split_and_untenanted_owners_are_one_group():
    store, sched, tenants = make(budget=16)
    a, b, plain = object(), object(), object()
    tenants.add(a, Tenant("a", 2.0), store.num_pages_total)
    tenants.add(b, Tenant("b", 1.0), store.num_pages_total)
    for i, owner in enumerate((a, a, b, b, plain, plain)):
        sched.submit(job(store, owner, 64, key=i))
    got = {id(a): 0, id(b): 0, id(plain): 0}
    for _ in range(4):
        for entry in run_step(sched):
            got[id(entry.job.record.owner)] += entry.length
    assert (got[id(a)], got[id(b)], got[id(plain)]) == (32, 16, 16)  # 2 : 1 : 1


def test_without_tenants_or_with_room_for_all_nothing_changes():
    store, sched, tenants = make(budget=64)
    a, b = object(), object()
    tenants.add(a, Tenant("a", 1.0), store.num_pages_total)
    tenants.add(b, Tenant("b", 1.0), store.num_pages_total)
    sched.submit(job(store, a, 40, key=1))
    sched.submit(job(store, b, 8, key=2))
    entries = run_step(sched)  # 48 tokens fit the 64-token step: nobody is held back
    assert [(e.job.key, e.length) for e in entries] == [(1, 40), (2, 8)]


def test_each_tenant_holds_at_most_its_share_of_the_pool():
    store, sched, tenants = make(num_pages=40, budget=256)
    a, b = object(), object()
    tenants.add(a, Tenant("a", 3.0), store.num_pages_total)
    tenants.add(b, Tenant("b", 1.0), store.num_pages_total)
    assert (tenants.of(a).max_pages, tenants.of(b).max_pages) == (30, 10)
    assert sched.page_limit(a) == 30 and sched.page_limit(object()) is None
    big = job(store, b, 12 * PS, key=1)  # 12 pages: over b's 10
    sched.submit(big)
    assert run_step(sched) == []
    assert big.share_blocked_since is not None
    small = job(store, a, 12 * PS, key=2)  # a's share holds it: it is not held up by b's
    sched.submit(small)
    assert [e.job.key for e in run_step(sched)] == [2]


def test_higher_priority_is_admitted_first_and_preempted_last():
    store, sched, _ = make(num_pages=6, budget=64)
    owner = object()
    low = job(store, owner, 4 * PS, key=1, priority=0)
    high = job(store, owner, 4 * PS, key=2, priority=5)
    sched.submit(low)
    sched.submit(high)  # queued behind low, but ahead of it by priority
    assert [j.key for j in sched.waiting] == [2, 1]
    assert [e.job.key for e in run_step(sched)] == [2]  # only one fits the pool


def test_the_lowest_priority_is_preempted_even_if_admitted_first():
    store, sched, _ = make(num_pages=64, budget=8)
    owner = object()
    low = job(store, owner, 8 * PS, key=1, priority=0)
    high = job(store, owner, 8 * PS, key=2, priority=5)
    sched.submit(low)
    run_step(sched)  # low is admitted first
    sched.submit(high)
    run_step(sched)
    assert {j.key for j in sched.active} == {1, 2}
    assert sched._victim() is low  # most recently admitted is high: priority comes first
