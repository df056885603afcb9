"""Do the fork copies the event loop makes cost the one-thread penalty? Measured, not assumed.

    python benchmarks/threads.py [--steps 40] [--repeats 3] [--smoke]

torch's CPU kernels parallelise with OpenMP, and once a second thread has run a parallel
region every model step on the model thread gets slower (~25% on 2 cores, see
docs/performance.md). The engine runs every model step on one model thread, but forks copy
working pages on the event loop's thread (``PagePool.copy_pages``), in slices below
torch's parallel grain so that they never start a thread team there. This script times a
decode step of the default model on a dedicated model thread:

1. before anything else touches torch from the main thread;
2. after the main thread made 2,000 page copies through ``PagePool.copy_pages``;
3. after the main thread ran one parallel torch op (the control: the penalty appears).

The last line is a JSON object with the step times and the two ratios against (1).
"""

from __future__ import annotations

import argparse
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import torch
from common import emit, parse_args, table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=40, help="decode steps per measurement")
    parser.add_argument("--repeats", type=int, default=3)
    args = parse_args(parser, steps=2, repeats=1)

    from runtime.kv.store import PageStore
    from runtime.model.batch import SeqInput
    from runtime.model.loader import load_model
    from runtime.model.runner import ModelRunner

    model_thread = ThreadPoolExecutor(max_workers=1)

    def build() -> tuple[PageStore, ModelRunner]:
        loaded = load_model(None, progress=False)
        c = loaded.config
        store = PageStore(256, 16, c.num_layers, c.num_kv_heads, c.head_dim)
        return store, ModelRunner(c, loaded.weights, store.pool.kv, 16)

    store, runner = model_thread.submit(build).result()
    context = 512
    cid = store.create_context()
    store.reserve_working_pages(cid, context // 16 + 2)
    prompt = [(i * 37) % 1000 + 5 for i in range(context)]
    store.write_tokens(cid, prompt, list(range(context)))

    def prefill() -> None:
        runner.forward([SeqInput(prompt, list(range(context)), store.page_table(cid), 0, [])])

    def step_ms() -> float:
        def run() -> float:
            t0 = time.perf_counter()
            for _ in range(args.steps):
                runner.forward([SeqInput([7], [context], store.page_table(cid), context, [0])])
            return (time.perf_counter() - t0) / args.steps * 1e3
        return model_thread.submit(run).result()

    model_thread.submit(prefill).result()
    step_ms()  # warm up
    baseline = [step_ms() for _ in range(args.repeats)]

    pages = store.page_table(cid)
    spare = store.pool.allocate(8)
    for i in range(2000):  # what forks do on the event loop's thread
        store.pool.copy_pages([spare[i % 8]], [pages[i % len(pages)]])
    after_copies = [step_ms() for _ in range(args.repeats)]

    torch.ones(4_000_000).mul_(2)  # a parallel region on the main thread: the control
    after_parallel = [step_ms() for _ in range(args.repeats)]

    b, c, p = (statistics.median(x) for x in (baseline, after_copies, after_parallel))
    table([
        ("decode step, model thread only", f"{b:.2f} ms ({min(baseline):.2f}-{max(baseline):.2f})"),
        ("after 2,000 page copies on main", f"{c:.2f} ms ({c / b:.2f}x)"),
        ("after one parallel op on main", f"{p:.2f} ms ({p / b:.2f}x)"),
        ("torch threads", str(torch.get_num_threads())),
    ])
    emit({"step_ms": b, "step_ms_after_copies": c, "step_ms_after_parallel_op": p,
          "copies_ratio": c / b, "parallel_op_ratio": p / b, "steps": args.steps,
          "repeats": args.repeats, "context": context})


if __name__ == "__main__":
    main()
