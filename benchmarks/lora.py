"""LoRA adapters on the default model: what batching rows of many adapters costs.

    python benchmarks/lora.py [--contexts 8] [--prompt-len 256] [--new-tokens 64] [--smoke]

8 contexts decode 64 tokens each after a 256-token prompt (prefilled first, not timed), in
three cases: no adapter, all on one adapter, each on a different adapter (random rank-16
adapters on all seven projections). Every case is one model call per step, whatever the
mix. Also: the time to load one adapter (``rt.load_adapter``), and the max abs logit
difference of a context on an adapter against peft's PeftModel on transformers.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from common import ROOT, emit, load_hf, parse_args, prompt_tokens, table

from pie_ctx import Context, Runtime, Sampler, gather

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapters(hf, root: Path, n: int, rank: int):
    """``n`` random PEFT adapters of ``hf`` saved under ``root``; returns the first's
    PeftModel (the oracle)."""
    import sys

    sys.path.insert(0, str(ROOT / "tests" / "model"))
    from lora_fixtures import make_adapter

    oracle = None
    for i in range(n):
        model = make_adapter(hf, root / f"a{i}", rank=rank, alpha=2 * rank, seed=i,
                             targets=TARGETS, std=0.02)
        oracle = oracle or model
    return oracle


async def decode_tps(rt, prompts, adapters, new_tokens) -> float:
    """Prefill every context, then time the decode of ``new_tokens`` each, all at once."""
    ctxs = [Context(rt, adapter=a).append(p) for p, a in zip(prompts, adapters, strict=True)]
    await gather(*(c.flush() for c in ctxs))
    t0 = time.perf_counter()
    outs = await gather(*(c.generate(Sampler.greedy(), max_tokens=new_tokens,
                                     ignore_eos=True).tokens() for c in ctxs))
    wall = time.perf_counter() - t0
    await gather(*(c.release() for c in ctxs))
    return sum(len(o) for o in outs) / wall


async def main_async(args):
    from runtime.boot import boot_engine
    from runtime.model.loader import resolve_model

    engine = boot_engine(None, page_size=16, kv_memory_gb=1.0)
    tok = engine.tokenizer
    n = args.contexts
    with tempfile.TemporaryDirectory() as tmp:
        on_model = engine.run_on_model_thread
        hf = on_model(load_hf, resolve_model(None, progress=False)[1])
        oracle = on_model(make_adapters, hf, Path(tmp), n, args.rank)
        async with engine, Runtime.local(engine=engine) as rt:
            load_ms = []
            for i in range(n):
                t0 = time.perf_counter()
                await rt.load_adapter(f"a{i}", str(Path(tmp) / f"a{i}"))
                load_ms.append((time.perf_counter() - t0) * 1e3)
            # accuracy vs peft
            probe = prompt_tokens(tok, 64, salt="Accuracy. ")
            ctx = Context(rt, adapter="a0")
            out = await ctx.forward().input(probe).logits(list(range(len(probe)))).execute()
            await ctx.release()
            ours = torch.from_numpy(np.stack(out.logits))

            def peft_logits():
                with torch.inference_mode():
                    return oracle(torch.tensor([probe])).logits[0].float()

            diff = float((ours - on_model(peft_logits)).abs().max())
            cases = {"base": [None] * n, "same": ["a0"] * n,
                     "mixed": [f"a{i}" for i in range(n)]}
            await decode_tps(rt, [prompt_tokens(tok, 32, salt="Warm. ")], ["a0"], 2)
            best = {k: 0.0 for k in cases}
            for rep in range(args.repeats):
                for name, adapters in cases.items():
                    prompts = [prompt_tokens(tok, args.prompt_len, salt=f"{name} {rep} {i}. ")
                               for i in range(n)]
                    tps = await decode_tps(rt, prompts, adapters, args.new_tokens)
                    best[name] = max(best[name], tps)
    table([("no adapter, tokens/s", f"{best['base']:.1f}"),
           ("all on one adapter", f"{best['same']:.1f} ({best['same'] / best['base']:.3f}x)"),
           (f"{n} different adapters", f"{best['mixed']:.1f} "
                                       f"({best['mixed'] / best['base']:.3f}x)"),
           ("adapter load (ms)", f"{min(load_ms):.1f} min, {max(load_ms):.1f} max"),
           ("max abs logit diff vs peft", f"{diff:.3g}")])
    emit({"lora_same_over_base": best["same"] / best["base"],
          "lora_mixed_over_base": best["mixed"] / best["base"],
          "adapter_load_ms": sorted(load_ms)[len(load_ms) // 2],
          "lora_max_abs_logit_diff": diff,
          "base_tokens_per_s": best["base"], "same_tokens_per_s": best["same"],
          "mixed_tokens_per_s": best["mixed"], "contexts": n, "rank": args.rank})


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--contexts", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--repeats", type=int, default=2)
    args = parse_args(p, contexts=2, prompt_len=32, new_tokens=4, repeats=1)
    import anyio

    anyio.run(main_async, args)


if __name__ == "__main__":
    main()
