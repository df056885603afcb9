"""The native runner vs the transformers backend vs plain HF, on the default model, in one process.

    python benchmarks/backends.py [--prompt-len 1024] [--n 8] [--new-tokens 64]
                                  [--decode-prompt 128] [--decode-tokens 64] [--repeats 3]
                                  [--smoke]

Best-of-8 (one prompt, eight forks sampling 64 tokens each, never stopping early) and
batch-1 greedy decode, through: pie-ctx on the native runner, pie-ctx on the transformers
backend (transformers' own SmolLM2 layers with pie-ctx's paged attention) and plain
transformers ``generate`` (best-of-8 as ``num_return_sequences=8``). Everything runs on
one thread (one OpenMP team), fp32, repeats interleaved. The JSON line carries
``transformers_backend_over_hf_bon`` (HF's best-of-8 wall over the transformers
backend's), ``native_over_transformers_backend_decode`` (native decode tokens/s over the
transformers backend's) and ``backend_max_abs_logit_diff`` (the two backends' logits over
the decode prompt).
"""

from __future__ import annotations

import argparse
import time
from concurrent.futures import ThreadPoolExecutor

import anyio
import torch
from best_of_n import run_hf, run_ours
from common import emit, load_hf, parse_args, prompt_tokens, summary, table

from pie_ctx import Context, Runtime, Sampler

BACKENDS = ("native", "transformers")


async def decode_ours(engine, prompt: list[int], new_tokens: int) -> tuple[float, list[int]]:
    """Seconds per decoded token (the prompt flushed first, untimed) and the tokens."""
    async with Runtime.local(engine=engine) as rt:
        ctx = Context(rt).append(prompt)
        await ctx.flush()
        t0 = time.perf_counter()
        out = await ctx.generate(Sampler.greedy(), max_tokens=new_tokens,
                                 ignore_eos=True).tokens()
        wall = time.perf_counter() - t0
        await ctx.release()
    return wall / new_tokens, out


def decode_hf(model, prompt: list[int], new_tokens: int) -> float:
    """Seconds per decoded token of HF greedy generate, its prefill subtracted."""
    ids = torch.tensor([prompt])

    def run(k: int) -> float:
        t0 = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, do_sample=False, max_new_tokens=k, min_new_tokens=k,
                           pad_token_id=0)
        return time.perf_counter() - t0

    return (run(new_tokens + 1) - run(1)) / new_tokens


def logit_diff(engines: dict, prompt: list[int]) -> float:
    """Max abs difference of the two backends' logits over every prompt position."""
    from runtime.model.batch import SeqInput

    logits = []
    for engine in engines.values():
        runner, store = engine.executor.runner, engine.store
        pages = list(range(-(-len(prompt) // store.page_size)))  # free pages of a fresh pool
        logits.append(runner.forward([SeqInput(prompt, list(range(len(prompt))), pages, 0,
                                               list(range(len(prompt))))]))
    return float((logits[0] - logits[1]).abs().max())


async def main_async(args: argparse.Namespace) -> None:
    from runtime.boot import boot_engine
    from runtime.model.loader import resolve_model

    thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pie-ctx-model")
    engines = {b: boot_engine(None, backend=b, page_size=16, kv_memory_gb=1.0,
                              model_thread=thread) for b in BACKENDS}
    native = engines["native"]
    hf = native.run_on_model_thread(load_hf, resolve_model(None, progress=False)[1])
    prompt = prompt_tokens(native.tokenizer, args.prompt_len)
    short = prompt_tokens(native.tokenizer, args.decode_prompt, salt="Decode: ")
    # before the engines start: they have touched no page yet
    diff = native.run_on_model_thread(logit_diff, engines, short)
    bon = {k: [] for k in (*BACKENDS, "hf")}
    per_token = {k: [] for k in (*BACKENDS, "hf")}
    greedy = {}
    async with native, engines["transformers"]:
        for b in BACKENDS:  # warm up
            await run_ours(engines[b], prompt[:64], 2, 4, 0)
        native.run_on_model_thread(run_hf, hf, prompt[:64], 2, 4, 0)
        for r in range(args.repeats):  # interleaved, so machine noise hits every side alike
            salted = [1000 + r] + prompt[1:]  # a fresh prompt each repeat: no prefix reuse
            for b in BACKENDS:
                wall, _, _ = await run_ours(engines[b], salted, args.n, args.new_tokens, r)
                bon[b].append(wall)
                step, greedy[b] = await decode_ours(engines[b], [2000 + r] + short[1:],
                                                    args.decode_tokens)
                per_token[b].append(step)
            bon["hf"].append(native.run_on_model_thread(run_hf, hf, salted, args.n,
                                                        args.new_tokens, r))
            per_token["hf"].append(native.run_on_model_thread(decode_hf, hf,
                                                              [2000 + r] + short[1:],
                                                              args.decode_tokens))
    thread.shutdown()
    s_bon = {k: summary(v) for k, v in bon.items()}
    s_tok = {k: summary(v) for k, v in per_token.items()}
    names = {"native": "pie-ctx native", "transformers": "pie-ctx transformers backend",
             "hf": "HF generate"}
    rows = [("threads", str(torch.get_num_threads())),
            ("backends' max abs logit diff", f"{diff:.3g}"),
            ("greedy tokens identical", str(greedy["native"] == greedy["transformers"]))]
    for k, name in names.items():
        b, t = s_bon[k], s_tok[k]
        rows.append((f"{name}: best-of-{args.n} s",
                     f"{b['median']:.2f} (range {b['min']:.2f}-{b['max']:.2f})"))
        rows.append((f"{name}: decode ms/token",
                     f"{1e3 * t['median']:.1f} (range {1e3 * t['min']:.1f}-{1e3 * t['max']:.1f})"))
    table(rows)
    emit({"transformers_backend_over_hf_bon": s_bon["hf"]["median"] / s_bon["transformers"]["median"],
          "native_over_hf_bon": s_bon["hf"]["median"] / s_bon["native"]["median"],
          "native_over_transformers_backend_decode":
              s_tok["transformers"]["median"] / s_tok["native"]["median"],
          "transformers_backend_over_hf_decode":
              s_tok["hf"]["median"] / s_tok["transformers"]["median"],
          "backend_max_abs_logit_diff": diff,
          "greedy_identical": greedy["native"] == greedy["transformers"],
          "bon_s": {k: v["median"] for k, v in s_bon.items()},
          "decode_ms_per_token": {k: 1e3 * v["median"] for k, v in s_tok.items()},
          "prompt_len": args.prompt_len, "n": args.n, "new_tokens": args.new_tokens,
          "decode_prompt": args.decode_prompt, "decode_tokens": args.decode_tokens,
          "repeats": args.repeats})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--decode-prompt", type=int, default=128)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    anyio.run(main_async, parse_args(ap, prompt_len=32, n=2, new_tokens=4, decode_prompt=16,
                                     decode_tokens=4, repeats=1))


if __name__ == "__main__":
    main()
