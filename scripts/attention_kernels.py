"""Which attention kernel each path of a forward uses, on this machine.

    python scripts/attention_kernels.py [--device cuda] [--dtype bfloat16] [--model PATH]
                                        [--page-size 16] [--backend auto|torch|flex|flash]

Runs one forward per path through the real model runner (a fresh prefill, a chunk over a
cached prefix, a batch of decodes of unequal lengths, forks decoding together, a pass
with a custom mask) under torch's profiler, and prints, per path, the backend's groups
(flash-attn or torch, cascade or not) and the attention kernels the profiler saw (SDPA's
flash / memory-efficient / cuDNN / math kernel, flash-attn's kernels). The last line is
one JSON object. ``make gpu-check`` runs it on the GPU; on CPU it shows the CPU kernels.

``--backend`` asks for one backend (``select_backend``'s choices) and the script fails,
exit status 1, if another one ran: a run that silently fell back to another backend
would otherwise report the wrong kernels as the asked one's.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pie_ctx.errors import InvalidArgument  # noqa: E402
from runtime.model.attention import CHOICES, select_backend  # noqa: E402
from runtime.model.loader import load_model  # noqa: E402
from runtime.model.runner import ModelRunner, SeqInput  # noqa: E402

KERNEL = re.compile(r"(?i)flash|fmha|attention|efficient|cudnn|sdp|_math|softmax|kvcache|splitkv")


class Seqs:
    """Page tables handed out from one free list (shuffled, as in a busy engine)."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.free = list(range(runner.num_pages))[::-1]
        self.free = self.free[1::2] + self.free[::2]  # non-consecutive tables: real gathers

    def new(self, n: int) -> list[int]:
        return [self.free.pop() for _ in range(-(-n // self.runner.page_size))]


def paths(runner: ModelRunner) -> dict[str, Callable[[], object]]:
    ps, vocab = runner.page_size, runner.config.vocab_size
    seqs = Seqs(runner)
    g = torch.Generator().manual_seed(0)

    def toks(n: int) -> list[int]:
        return torch.randint(3, vocab, (n,), generator=g).tolist()

    def run(batch: list[SeqInput]) -> object:
        return runner.forward(batch)

    prompt = toks(4 * ps + 5)
    base = seqs.new(len(prompt) + 8)
    run([SeqInput(prompt, list(range(len(prompt))), base, 0, [0])])  # the cached prefix
    others = [(toks(n), seqs.new(n + 1)) for n in (7, 3 * ps, 5 * ps + 3)]
    for t, pages in others:
        run([SeqInput(t, list(range(len(t))), pages, 0, [0])])
    fork_tails = [seqs.new(ps) for _ in range(3)]
    n = len(prompt)
    shared = base[: n // ps]
    forks = [SeqInput([5], [n], shared + tail, n, [0]) for tail in fork_tails]
    for f in forks:  # each fork's partial tail page holds a copy of the prompt's tail
        runner.pool_kv[f.page_table[-1]] = runner.pool_kv[base[n // ps]]
    chunk = toks(2 * ps)
    mask = torch.ones(6, n + 6, dtype=torch.bool).numpy()
    mask[:, n:] = torch.eye(6, dtype=torch.bool).numpy()  # each new token sees the prefix and itself
    return {
        "prefill": lambda: run([SeqInput(prompt, list(range(n)), seqs.new(n), 0, [0])]),
        "chunk over a cached prefix": lambda: run([SeqInput(chunk, list(range(n, n + len(chunk))),
                                                            base + seqs.new(len(chunk)), n, [0])]),
        "decodes, unequal lengths": lambda: run([SeqInput([4], [len(t)], pages, len(t), [0])
                                                 for t, pages in others]),
        "forks decoding together": lambda: run(forks),
        "custom mask": lambda: run([SeqInput(toks(6), list(range(n, n + 6)), base + seqs.new(6),
                                             n, [0], mask)]),
    }


def groups(runner: ModelRunner) -> list[str]:
    """The group kinds of the last forward's plan."""
    state = getattr(runner, "_last_state", None)
    if state is None:
        return []
    flash = getattr(state, "flash", None)
    if flash is not None:  # the flash backend's plan
        kinds = [type(x).__name__.strip("_") for x in flash]
        kinds += ["torch (custom mask)"] * len(state.torch_state or [])
        return kinds or ["torch (whole forward)"]
    calls = getattr(state, "calls", None)
    if calls is not None:  # the flex backend's plan
        return ([f"flex {type(x).__name__.strip('_')}" for x in calls]
                or ["torch (whole forward)"])
    return [type(x).__name__.strip("_") for x in state]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--model", default=None, help="model reference (default: the default model)")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--backend", default="auto", choices=CHOICES,
                    help="ask for this attention backend; exit 1 if another one ran")
    args = ap.parse_args()

    loaded = load_model(args.model, device=args.device, dtype=args.dtype, progress=False)
    c = loaded.config
    weight = loaded.weights["model.embed_tokens.weight"]
    pool = torch.zeros(256 * 16 // args.page_size + 64, args.page_size, c.num_layers, 2,
                       c.num_kv_heads, c.head_dim, dtype=weight.dtype, device=weight.device)
    try:
        backend = select_backend(weight.device, weight.dtype, args.page_size, c.head_dim,
                                 heads=(c.num_heads, c.num_kv_heads), choice=args.backend)
    except InvalidArgument as e:
        sys.exit(f"attention_kernels: {e}")
    runner = ModelRunner(c, loaded.weights, pool, args.page_size, backend=backend)
    prepare = runner.backend.prepare

    def keep(meta, pool_kv):  # noqa: ANN001
        prepare(meta, pool_kv)
        runner._last_state = meta.backend_state  # type: ignore[attr-defined]
    runner.backend.prepare = keep  # type: ignore[method-assign]

    activities = [ProfilerActivity.CPU]
    if weight.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    report = {"device": str(weight.device), "dtype": str(weight.dtype).removeprefix("torch."),
              "backend": runner.backend.name, "page_size": args.page_size, "paths": {}}
    print(f"{loaded.name} on {report['device']}, {report['dtype']}, attention backend "
          f"{report['backend']}, page size {args.page_size}")
    for name, step in paths(runner).items():
        step()  # warm up (and let lazy kernels load)
        with profile(activities=activities) as prof:
            step()
            if weight.device.type == "cuda":
                torch.cuda.synchronize()
        kernels = sorted({e.key for e in prof.key_averages() if KERNEL.search(e.key)})
        report["paths"][name] = {"groups": groups(runner), "kernels": kernels}
        print(f"  {name:28} groups {', '.join(groups(runner))}")
        for k in kernels:
            print(f"  {'':28}   {k[:110]}")
    ran = runner.backend.name
    asked = args.backend
    report["ok"] = asked in ("auto", "measure") or ran == asked or ran.startswith(asked + "-")
    print(json.dumps(report))
    if not report["ok"]:
        sys.exit(f"attention_kernels: asked for the {asked} backend, but {ran} ran")


if __name__ == "__main__":
    main()
