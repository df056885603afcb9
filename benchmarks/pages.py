"""Page-store micro-benchmarks: pool alloc/free, fork vs committed length, commit with dedup.

Run:  .venv/bin/python benchmarks/pages.py [--quick] [--smoke]

Prints a table, then as its last line one JSON object with at least
``alloc_free_ops_per_s``, ``fork_us_64``, ``fork_us_8192`` and ``commit_dedup_us_per_page``.
Targets: >= 2,000,000 alloc/free pairs per second (measured with one page per call, the
strict case; the batched figure is reported too); ``fork_us_8192 <= 2 * fork_us_64``
(fork is O(1) in the committed length). Each figure is the median of several repeats.
Timings are bookkeeping only (CPU, tiny KV shape); no model runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

from common import parse_args

from runtime.kv import ContextId, PagePool, PageStore, PoolShape

PAGE_SIZE = 16


def _median(samples: list[float]) -> float:
    return statistics.median(samples)


def bench_alloc_free(batch: int, pairs: int, repeats: int) -> float:
    """Page allocate+free pairs per second, ``batch`` pages per call."""
    pool = PagePool(PoolShape(1024, PAGE_SIZE, 1, 1, 1))
    rounds = max(1, pairs // batch)
    rates = []
    for _ in range(repeats):
        allocate, free = pool.allocate, pool.free
        t0 = time.perf_counter()
        for _ in range(rounds):
            free(allocate(batch))  # type: ignore[arg-type]
        rates.append(rounds * batch / (time.perf_counter() - t0))
    return _median(rates)


def _prefilled(store: PageStore, num_tokens: int, tail: int = 0) -> ContextId:
    cid = store.create_context()
    total = num_tokens + tail
    assert store.reserve_working_pages(cid, -(-total // PAGE_SIZE))
    store.write_tokens(cid, list(range(total)), list(range(total)))
    store.commit_working_pages(cid, num_tokens // PAGE_SIZE)
    return cid


def bench_fork(num_tokens: int, forks: int, repeats: int, tail: int = 0) -> float:
    """Microseconds per fork of a context with ``num_tokens`` committed tokens."""
    store = PageStore(num_tokens // PAGE_SIZE + 2 * forks + 8, PAGE_SIZE, 2, 2, 8)
    cid = _prefilled(store, num_tokens, tail)
    store.page_table(cid)  # warm the parent's committed-id cache, as a live engine would
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        children = [store.fork(cid) for _ in range(forks)]
        times.append((time.perf_counter() - t0) / forks * 1e6)
        for child in children:
            store.release(child)
    return _median(times)


def bench_commit(num_pages: int, repeats: int, dedup: bool) -> float:
    """Microseconds per committed page (``dedup``: every page already exists)."""
    store = PageStore(2 * num_pages + 8, PAGE_SIZE, 2, 2, 8)
    n = num_pages * PAGE_SIZE
    tokens, positions = list(range(n)), list(range(n))
    keep = _prefilled(store, n) if dedup else None
    times = []
    for _ in range(repeats):
        cid = store.create_context()
        assert store.reserve_working_pages(cid, num_pages)
        store.write_tokens(cid, tokens, positions)
        t0 = time.perf_counter()
        store.commit_full_pages(cid)
        times.append((time.perf_counter() - t0) / num_pages * 1e6)
        store.release(cid)
        if not dedup:
            store.trie.evict(num_pages)  # next round commits fresh pages again
    del keep
    return _median(times)


def bench_attach(num_pages: int, repeats: int) -> float:
    """Microseconds per page attached by ``attach_prefix`` (all hits)."""
    store = PageStore(num_pages + 8, PAGE_SIZE, 2, 2, 8)
    n = num_pages * PAGE_SIZE
    store.release(_prefilled(store, n))
    tokens, positions = list(range(n)), list(range(n))
    times = []
    for _ in range(repeats):
        cid = store.create_context()
        t0 = time.perf_counter()
        got = store.attach_prefix(cid, tokens, positions)
        times.append((time.perf_counter() - t0) / num_pages * 1e6)
        assert got == num_pages
        store.release(cid)
    return _median(times)


def bench_call(fn: Callable[[], object], calls: int, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls * 1e6)
    return _median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats (noisier)")
    args = parse_args(parser)
    repeats = 1 if args.smoke else 3 if args.quick else 7
    scale = 100 if args.smoke else 1  # --smoke: a hundredth of the calls

    def n(calls: int) -> int:
        return max(1, calls // scale)

    results: dict[str, float] = {}
    # The headline is the strict case: one page per allocate() and per free() call.
    results["alloc_free_ops_per_s"] = bench_alloc_free(1, n(300_000), repeats)
    results["alloc_free_batch64_ops_per_s"] = bench_alloc_free(64, n(2_000_000), repeats)
    results["fork_us_64"] = bench_fork(64, n(500), repeats)
    results["fork_us_8192"] = bench_fork(8192, n(500), repeats)
    results["fork_us_8192_tail15"] = bench_fork(8192, n(200), repeats, tail=15)
    results["commit_dedup_us_per_page"] = bench_commit(256, repeats, dedup=True)
    results["commit_new_us_per_page"] = bench_commit(256, repeats, dedup=False)
    results["attach_prefix_us_per_page"] = bench_attach(256, repeats)
    store = PageStore(600, PAGE_SIZE, 2, 2, 8)
    long = _prefilled(store, 8192)
    results["page_table_us_8192"] = bench_call(lambda: store.page_table(long), n(2000), repeats)
    results["ratio_fork_8192_over_64"] = results["fork_us_8192"] / results["fork_us_64"]

    rows = [
        ("pool alloc+free, 1 page/call", "alloc_free_ops_per_s", "pairs/s", ">= 2,000,000"),
        ("pool alloc+free, 64 pages/call", "alloc_free_batch64_ops_per_s", "pairs/s", ""),
        ("fork, 64 committed tokens", "fork_us_64", "us", ""),
        ("fork, 8192 committed tokens", "fork_us_8192", "us", "<= 2 x fork_us_64"),
        ("fork, 8192 + 15-token working tail", "fork_us_8192_tail15", "us", ""),
        ("fork ratio 8192 / 64", "ratio_fork_8192_over_64", "x", "<= 2"),
        ("commit with dedup", "commit_dedup_us_per_page", "us/page", ""),
        ("commit of new pages", "commit_new_us_per_page", "us/page", ""),
        ("attach_prefix (all hits)", "attach_prefix_us_per_page", "us/page", ""),
        ("page_table, 512 pages", "page_table_us_8192", "us", ""),
    ]
    print(f"page_size={PAGE_SIZE}, median of {repeats} repeats")
    print(f"{'measurement':<38} {'value':>14}  {'unit':<8} target")
    print("-" * 78)
    for label, key, unit, target in rows:
        value = results[key]
        text = f"{value:,.0f}" if value >= 1000 else f"{value:.3f}"
        print(f"{label:<38} {text:>14}  {unit:<8} {target}")
    print(json.dumps({k: round(v, 4) for k, v in results.items()}))


if __name__ == "__main__":
    main()
