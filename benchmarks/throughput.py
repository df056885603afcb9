"""Throughput on the default model: 32 concurrent requests (256-token prompts, 64 new tokens).

    python benchmarks/throughput.py [--requests 32] [--hf-sequential 8] [--smoke]

pie-ctx runs all requests at once (continuous batching). HF runs them one by one (measured
on `--hf-sequential` requests and scaled, since all 32 take minutes) and as one padded
batch with `generate`. Also reports the scheduler's own time per step as a fraction of the
model's time.
"""

from __future__ import annotations

import argparse
import time

import anyio
import torch
from common import emit, load_hf, parse_args, prompt_tokens, table

from pie_ctx import Context, Runtime, Sampler, gather


def hf_generate(model, prompts, new_tokens):
    width = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, pad_token_id=0)
    return out.shape[0] * new_tokens


async def main_async(args):
    from runtime.boot import boot_engine
    from runtime.model.loader import resolve_model

    engine = boot_engine(None, page_size=16, kv_memory_gb=1.0)
    tok = engine.tokenizer
    prompts = [prompt_tokens(tok, args.prompt_len - (i % 7) * 8, salt=f"Request {i}. ")
               for i in range(args.requests)]
    async with engine, Runtime.local(engine=engine) as rt:
        warm = Context(rt).append(prompts[0][:32])
        await warm.generate(Sampler.greedy(), max_tokens=2).text()
        await warm.release()
        s0 = await rt.stats()
        t0 = time.perf_counter()

        async def one(p):
            async with Context(rt).append(p) as ctx:
                return await ctx.generate(Sampler.greedy(), max_tokens=args.new_tokens,
                                          ignore_eos=True).tokens()

        outs = await gather(*(one(p) for p in prompts))
        wall = time.perf_counter() - t0
        s1 = await rt.stats()

        # HF runs on the engine's model thread: one thread does all torch work (see Engine).
        on_model = engine.run_on_model_thread
        hf = on_model(load_hf, resolve_model(None, progress=False)[1])
        on_model(hf_generate, hf, [prompts[0][:16]], 2)  # warm up
        t0 = time.perf_counter()
        done = sum(on_model(hf_generate, hf, [p], args.new_tokens)
                   for p in prompts[: args.hf_sequential])
        hf_seq_tps = done / (time.perf_counter() - t0)
        t0 = time.perf_counter()
        done = on_model(hf_generate, hf, prompts, args.new_tokens)
        hf_batch_tps = done / (time.perf_counter() - t0)
    ours_tps = sum(len(o) for o in outs) / wall
    steps = s1.num_steps - s0.num_steps
    sched = s1.scheduler_seconds - s0.scheduler_seconds
    model_s = s1.model_seconds - s0.model_seconds
    table([("pie-ctx tokens/s", f"{ours_tps:.1f} ({steps} steps, {wall:.1f}s)"),
           ("HF one by one tokens/s", f"{hf_seq_tps:.1f} (measured on {args.hf_sequential})"),
           ("HF padded batch tokens/s", f"{hf_batch_tps:.1f}"),
           ("scheduler / model time", f"{sched / model_s:.3%} ({sched / steps * 1e3:.2f} ms/step)")])
    emit({"tokens_per_s": ours_tps, "hf_sequential_tokens_per_s": hf_seq_tps,
          "hf_batched_tokens_per_s": hf_batch_tps, "speedup_vs_hf_sequential": ours_tps / hf_seq_tps,
          "speedup_vs_hf_batched": ours_tps / hf_batch_tps,
          "scheduler_overhead_fraction": sched / model_s, "steps": steps,
          "requests": args.requests, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens})


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--hf-sequential", type=int, default=8)
    anyio.run(main_async, parse_args(ap, requests=3, prompt_len=64, new_tokens=4,
                                     hf_sequential=1))


if __name__ == "__main__":
    main()
