"""pie-ctx (fp32, int8 and q4 weights) vs llama.cpp on the same GGUF, side by side in one process.

    .venv/bin/python benchmarks/vs_llamacpp.py [--repeats 3] [--prompt-len 512]
        [--new-tokens 128] [--bon-prompt-len 1024] [--n 8] [--bon-new-tokens 64]
        [--no-int8] [--no-q4] [--skip-bon] [--decode8-n 8] [--decode8-prompt-len 1024]
        [--decode8-new-tokens 32] [--skip-decode8] [--q4-kv-dtype bf16] [--smoke]

llama.cpp runs through llama-cpp-python (``pip install llama-cpp-python==0.3.36``; without it
the script prints how to install it and skips, exit status 0). Both sides read the default
GGUF (SmolLM2-135M-Instruct Q4_1): llama.cpp computes on the Q4_1 blocks as stored, pie-ctx
on its dequantized copy (fp32, or re-quantized to int8 with ``weights="int8"``) or, in the
q4 rows, on the same blocks as stored (``weights="gguf"``). Same token
ids on both sides (pie-ctx's tokenizer; the script checks that llama.cpp's vocab agrees),
same thread count (torch's, for llama.cpp's n_threads and n_threads_batch), flash attention
off in llama.cpp, batch 1 unless stated. KV pages: llama.cpp keeps an f16 KV cache; pie-ctx
fp32 and int8 rows keep fp32 KV pages, the q4 rows --q4-kv-dtype pages (default bf16: the
same bytes a token as llama.cpp's f16, +0.01% perplexity; docs/performance.md), and the
JSON says which (``q4_kv_dtype``).

Rows, for llama.cpp, pie-ctx fp32, pie-ctx int8 and pie-ctx q4:

1. prefill of a --prompt-len prompt, tok/s (including reading the first token's logits);
2. greedy decode after that prompt, tok/s over the --new-tokens - 1 decode steps only;
3. best-of---n: one --bon-prompt-len prompt, --n samples of --bon-new-tokens tokens each
   (temperature 0.8, top-p 0.95, never stopping early), wall seconds from the first prompt
   token to the last sampled token. pie-ctx: the engine flushes the prompt once and forks
   it (``best_of_n.run_ours``). llama.cpp, "shared-prompt" mode: a second context on the
   same model with ``n_seq_max = n`` and ``kv_unified = true``; the prompt is decoded once in
   sequence 0, ``llama_memory_seq_cp(mem, 0, s, -1, -1)`` gives sequences 1..n-1 the same KV
   cells (no recompute, no copy in a unified buffer), then every step is one
   ``llama_decode`` of n tokens (one per sequence) and each sequence draws its next token
   with its own llama.cpp sampler chain (temp 0.8 -> top-p 0.95 -> dist(seed + i), via
   ``llama_sampler_sample``). If the binding lacks any of that, "independent" mode: n
   separate prefill + decode runs (said in the output);
4. decode8: --decode8-n independent contexts of --decode8-prompt-len tokens (distinct
   first tokens, so nothing is shared) decoding greedily together, tok/s over all rows of
   the --decode8-new-tokens - 1 steps after the prefills. llama.cpp: one sequence each in
   a unified KV buffer, one ``llama_decode`` of n tokens per step; pie-ctx: one context
   each, batched by the engine into one model call per step.

All torch and all llama.cpp work runs on one thread, the engine's model thread: torch and
llama.cpp's ggml load the same libgomp (soname libgomp.so.1; torch's copy is loaded first),
whose thread teams are per calling thread, and a second team makes every step slower
(docs/performance.md, "One thread for all torch work"). So the run goes in phases, one per
weights format: boot that engine, build the single-stream driver (``common.Ours``) on its
thread, then alternate llama.cpp and pie-ctx repeat by repeat; the engine's thread ends
(and its team with it) before the next phase boots. llama.cpp is measured in every phase
and its samples are pooled. The phases run int8, q4, then fp32: every phase after an fp32
one ran slower on both sides (measured; cause not found), so fp32 goes last.

The q4 quality keys compare pie-ctx q4 with pie-ctx fp32 (the same file, dequantized) on
the quality benchmark's text (benchmarks/data/alice_chapter_1.txt, teacher-forced, its
first --quality-tokens tokens): ``q4_max_abs_logit_diff_vs_fp32`` and
``q4_greedy_agreement_vs_fp32`` (the fraction of positions whose argmax is the same), both
on fp32 KV pages whatever --q4-kv-dtype (they measure the weights; bf16 pages' own cost is
in docs/performance.md).

Prints a table (best and median over the repeats; ratios pie-ctx / llama.cpp for tok/s and
llama.cpp / pie-ctx for wall seconds, so > 1 means pie-ctx is faster) and, as its last line,
one JSON object. Its numbers are the best repeat (highest tok/s, lowest wall seconds).
"""

from __future__ import annotations

import argparse
import gc
import inspect
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import torch
from best_of_n import run_ours
from common import TEXT, Ours, emit, parse_args, prompt_tokens

from pie_ctx import Context, Runtime, Sampler, gather
from runtime.kv.layout import KV_DTYPES

INSTALL = ".venv/bin/pip install llama-cpp-python==0.3.36"
PAGE_SIZE = 16
WEIGHTS = {"q4": "gguf"}  # row label -> boot_engine's weights (others: the same name)
QUALITY_TEXT = Path(__file__).resolve().parent / "data" / "alice_chapter_1.txt"
TEMPERATURE, TOP_P = 0.8, 0.95  # as best_of_n.run_ours samples


class Batch:
    """A ``llama_batch`` we own, filled from (token, position, sequence, wants logits) rows."""

    def __init__(self, lib: Any, capacity: int) -> None:
        self.lib, self.capacity = lib, capacity
        self.raw = lib.llama_batch_init(capacity, 0, 1)  # token ids, one seq id per token

    def fill(self, rows: list[tuple[int, int, int, bool]]) -> None:
        assert len(rows) <= self.capacity
        b = self.raw
        for i, (token, pos, seq, out) in enumerate(rows):
            b.token[i] = token
            b.pos[i] = pos
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = seq
            b.logits[i] = out
        b.n_tokens = len(rows)

    def free(self) -> None:
        self.lib.llama_batch_free(self.raw)


class LlamaCpp:
    """llama.cpp on the GGUF. ``Llama`` loads the model and owns the single-stream context;
    everything else goes through the binding's low-level calls (our own batches,
    ``llama_decode``, logits by batch index), so that no high-level bookkeeping is timed."""

    def __init__(self, lib: Any, gguf: Path, threads: int, n_ctx: int, n_batch: int) -> None:
        self.lib, self.threads, self.n_batch = lib, threads, n_batch
        kw: dict[str, Any] = {"n_ctx": n_ctx, "n_batch": n_batch, "n_ubatch": 512,
                              "n_threads": threads, "n_threads_batch": threads,
                              "verbose": False}
        if "flash_attn" in inspect.signature(lib.Llama.__init__).parameters:
            kw["flash_attn"] = False
        self.llm = lib.Llama(str(gguf), **kw)
        self.n_vocab = self.llm.n_vocab()
        self.batch = Batch(lib, n_batch)
        self.bon_ctx: Any = None
        self.bon_batch: Batch | None = None
        self.many_ctx: Any = None
        self.many_batch: Batch | None = None

    # ---------------------------------------------------------------- low-level helpers

    def _decode(self, ctx: Any, batch: Batch, rows: list[tuple[int, int, int, bool]]) -> None:
        batch.fill(rows)
        rc = self.lib.llama_decode(ctx, batch.raw)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def _prefill(self, ctx: Any, batch: Batch, prompt: list[int], seq: int = 0) -> int:
        """Decode ``prompt`` into sequence ``seq`` in n_batch chunks, logits for the last
        token only; returns that token's index in the last batch."""
        for a in range(0, len(prompt), batch.capacity):
            chunk = prompt[a:a + batch.capacity]
            last = a + len(chunk) == len(prompt)
            self._decode(ctx, batch, [(t, a + i, seq, last and i == len(chunk) - 1)
                                      for i, t in enumerate(chunk)])
        return (len(prompt) - 1) % batch.capacity

    def _argmax(self, ctx: Any, idx: int) -> int:
        logits = np.ctypeslib.as_array(self.lib.llama_get_logits_ith(ctx, idx),
                                       shape=(self.n_vocab,))
        return int(logits.argmax())

    def _sampler(self, seed: int) -> Any:
        lib = self.lib
        chain = lib.llama_sampler_chain_init(lib.llama_sampler_chain_default_params())
        lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_temp(TEMPERATURE))
        lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_top_p(TOP_P, 1))
        lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_dist(seed))
        return chain  # the chain owns (and frees) the three samplers

    def _clear(self, ctx: Any) -> None:
        self.lib.llama_memory_clear(self.lib.llama_get_memory(ctx), False)  # metadata only

    # ------------------------------------------------------------------ single stream

    def generate(self, prompt: list[int], n: int) -> tuple[list[int], float, float]:
        """Greedy n tokens (numpy argmax of the logits); returns (tokens, prefill seconds,
        decode seconds for n-1 steps), like ``common.Ours.generate``."""
        ctx = self.llm.ctx
        self._clear(ctx)
        t0 = time.perf_counter()
        out = [self._argmax(ctx, self._prefill(ctx, self.batch, prompt))]
        t1 = time.perf_counter()
        for pos in range(len(prompt), len(prompt) + n - 1):
            self._decode(ctx, self.batch, [(out[-1], pos, 0, True)])
            out.append(self._argmax(ctx, 0))
        return out, t1 - t0, time.perf_counter() - t1

    # -------------------------------------------------------------------- best of n

    def open_shared(self, n_seq: int, n_ctx: int) -> str | None:
        """A second context on the same model for the shared-prompt best-of-n: ``n_seq``
        sequences in one unified KV buffer, where ``llama_memory_seq_cp`` only tags the
        prompt's cells with more sequence ids. Returns why it cannot, or None."""
        opened = self._multi_context(n_seq, n_ctx)
        if isinstance(opened, str):
            return opened
        self.bon_ctx, self.bon_batch = opened
        return None

    def open_many(self, n_seq: int, n_ctx: int) -> str | None:
        """A third context for independent sequences decoding together; why not, or None."""
        opened = self._multi_context(n_seq, n_ctx)
        if isinstance(opened, str):
            return opened
        self.many_ctx, self.many_batch = opened
        return None

    def _multi_context(self, n_seq: int, n_ctx: int) -> tuple[Any, Batch] | str:
        """A context of ``n_seq`` sequences in one unified KV buffer of ``n_ctx`` cells, and
        a batch for it; or why the binding cannot make one."""
        lib = self.lib
        need = ("llama_init_from_model", "llama_get_memory", "llama_memory_seq_cp",
                "llama_memory_clear", "llama_sampler_sample", "llama_context_default_params")
        missing = [f for f in need if not hasattr(lib, f)]
        if missing:
            return f"the binding lacks {', '.join(missing)}"
        if "kv_unified" not in dict(lib.llama_context_params._fields_):
            return "llama_context_params has no kv_unified"
        if n_seq > lib.llama_max_parallel_sequences():
            return f"n={n_seq} exceeds llama_max_parallel_sequences()"
        p = lib.llama_context_default_params()
        p.n_ctx, p.n_batch, p.n_ubatch = n_ctx, self.n_batch, min(512, self.n_batch)
        p.n_seq_max, p.kv_unified = n_seq, True
        p.n_threads = p.n_threads_batch = self.threads
        p.flash_attn_type = lib.LLAMA_FLASH_ATTN_TYPE_DISABLED
        ctx = lib.llama_init_from_model(self.llm.model, p)
        if not ctx:
            return "llama_init_from_model failed for the multi-sequence context"
        return ctx, Batch(lib, max(self.n_batch, n_seq))

    def decode_many(self, prompts: list[list[int]], new_tokens: int) -> float:
        """Independent prompts (one sequence each, no cells shared), then greedy decoding of
        all of them together, one ``llama_decode`` per step. Returns the decode tok/s over
        the ``new_tokens - 1`` steps (every sequence's first token comes from its prefill)."""
        lib, ctx, batch = self.lib, self.many_ctx, self.many_batch
        assert batch is not None and len({len(p) for p in prompts}) == 1
        lib.llama_memory_clear(lib.llama_get_memory(ctx), False)
        tokens = [self._argmax(ctx, self._prefill(ctx, batch, p, seq=s))
                  for s, p in enumerate(prompts)]
        t0 = time.perf_counter()
        for pos in range(len(prompts[0]), len(prompts[0]) + new_tokens - 1):
            self._decode(ctx, batch, [(t, pos, s, True) for s, t in enumerate(tokens)])
            tokens = [self._argmax(ctx, s) for s in range(len(prompts))]
        return len(prompts) * (new_tokens - 1) / (time.perf_counter() - t0)

    def best_of(self, prompt: list[int], n: int, new_tokens: int, seed: int) -> float:
        """Wall seconds for n samples of ``new_tokens`` tokens after ``prompt``."""
        samplers = [self._sampler(seed + i) for i in range(n)]
        try:
            if self.bon_ctx is not None:
                outs, wall = self._best_of_shared(prompt, new_tokens, samplers)
            else:
                outs, wall = self._best_of_independent(prompt, new_tokens, samplers)
        finally:
            for s in samplers:
                self.lib.llama_sampler_free(s)
        assert all(len(o) == new_tokens for o in outs)
        return wall

    def _best_of_shared(self, prompt: list[int], new_tokens: int,
                        samplers: list[Any]) -> tuple[list[list[int]], float]:
        lib, ctx, batch = self.lib, self.bon_ctx, self.bon_batch
        assert batch is not None
        mem = lib.llama_get_memory(ctx)
        lib.llama_memory_clear(mem, False)
        t0 = time.perf_counter()
        last = self._prefill(ctx, batch, prompt, seq=0)
        for s in range(1, len(samplers)):  # share the prompt's KV cells: nothing recomputed
            lib.llama_memory_seq_cp(mem, 0, s, -1, -1)
        tokens = [lib.llama_sampler_sample(smp, ctx, last) for smp in samplers]
        outs = [[t] for t in tokens]
        for pos in range(len(prompt), len(prompt) + new_tokens - 1):
            # one llama_decode per step: token s of the batch extends sequence s
            self._decode(ctx, batch, [(t, pos, s, True) for s, t in enumerate(tokens)])
            tokens = [lib.llama_sampler_sample(smp, ctx, s) for s, smp in enumerate(samplers)]
            for o, t in zip(outs, tokens, strict=True):
                o.append(t)
        return outs, time.perf_counter() - t0

    def _best_of_independent(self, prompt: list[int], new_tokens: int,
                             samplers: list[Any]) -> tuple[list[list[int]], float]:
        ctx, outs = self.llm.ctx, []
        t0 = time.perf_counter()
        for smp in samplers:  # each sample prefills the prompt again
            self._clear(ctx)
            out = [self.lib.llama_sampler_sample(smp, ctx, self._prefill(ctx, self.batch, prompt))]
            for pos in range(len(prompt), len(prompt) + new_tokens - 1):
                self._decode(ctx, self.batch, [(out[-1], pos, 0, True)])
                out.append(self.lib.llama_sampler_sample(smp, ctx, 0))
            outs.append(out)
        return outs, time.perf_counter() - t0

    def close(self) -> None:
        for ctx in (self.bon_ctx, self.many_ctx):
            if ctx is not None:
                self.lib.llama_free(ctx)
        self.bon_ctx = self.many_ctx = None
        for batch in (self.bon_batch, self.many_batch):
            if batch is not None:
                batch.free()
        self.batch.free()
        self.llm.close()


def vocab_agrees(llm: Any, tokenizer: Any) -> bool:
    """Do llama.cpp's tokenizer and ours give the same ids (plain text and specials)?"""
    samples = ["<|im_start|>user\nHello, wörld! 12345 tokens?<|im_end|>\n", TEXT[:2000]]
    return all(llm.tokenize(s.encode(), add_bos=False, special=True) == tokenizer.encode(s)
               for s in samples)


def make_ours(weights: str, max_tokens: int, kv_dtype: str = "fp32") -> Ours:
    """The single-stream driver (its own copy of the model); call on the model thread."""
    from runtime.model.loader import load_model

    return Ours(load_model(None, progress=False), max_tokens, page_size=PAGE_SIZE,
                weights=weights, kv_dtype=kv_dtype)


async def decode_many_ours(engine: Any, prompts: list[list[int]], new_tokens: int) -> float:
    """``LlamaCpp.decode_many`` on the engine: one context per prompt, prefilled, then all
    decoding greedily together (the engine batches them into one model call per step)."""
    async with Runtime.local(engine=engine) as rt:
        contexts = [Context(rt).append(p) for p in prompts]
        await gather(*(c.flush() for c in contexts))
        t0 = time.perf_counter()
        outs = await gather(*(c.generate(Sampler.greedy(), max_tokens=new_tokens,
                                         ignore_eos=True).tokens() for c in contexts))
        wall = time.perf_counter() - t0
    assert all(len(o) == new_tokens for o in outs)
    return len(prompts) * (new_tokens - 1) / wall


def quality_ids(tokenizer: Any, n: int) -> list[int]:
    """The first ``n`` tokens of the quality benchmark's text."""
    return tokenizer.encode(QUALITY_TEXT.read_text())[:n]


def compare_logits(q4: torch.Tensor, fp32: torch.Tensor) -> dict[str, float]:
    """The q4 quality keys: q4 logits against fp32's over the same teacher-forced text."""
    return {"q4_max_abs_logit_diff_vs_fp32": float((q4 - fp32).abs().max()),
            "q4_greedy_agreement_vs_fp32": float((q4.argmax(-1) == fp32.argmax(-1))
                                                 .float().mean())}


def leading_run(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                min(len(a), len(b)))


async def measure(args: argparse.Namespace, lib: Any, gguf: Path,
                  formats: list[str]) -> tuple[dict[str, dict[str, list[float]]], dict[str, Any]]:
    from runtime.boot import boot_engine

    threads = torch.get_num_threads()
    rows = {k: {"pf": [], "dec": [], "bon": [], "d8": []} for k in ("llamacpp", *formats)}
    info: dict[str, Any] = {"bon_mode": "skipped" if args.skip_bon else None,
                            "decode8": "skipped" if args.skip_decode8 else None}
    llama: LlamaCpp | None = None
    try:
        for fmt in formats:
            weights = WEIGHTS.get(fmt, fmt)
            kv_dtype = args.q4_kv_dtype if fmt == "q4" else "fp32"
            engine = boot_engine(None, page_size=PAGE_SIZE, kv_memory_gb=1.0, weights=weights,
                                 kv_dtype=kv_dtype, progress=False)
            on_model = engine.run_on_model_thread  # every torch and llama.cpp call goes here
            model_thread = on_model(threading.current_thread)
            tok = engine.tokenizer
            prompt = prompt_tokens(tok, args.prompt_len)
            bon_prompt = prompt_tokens(tok, args.bon_prompt_len)
            many_prompt = prompt_tokens(tok, args.decode8_prompt_len)
            if llama is None:
                n_ctx = max(2048, args.prompt_len + args.new_tokens,
                            args.bon_prompt_len + args.bon_new_tokens)
                llama = on_model(LlamaCpp, lib, gguf, threads, n_ctx, 512)
                info["vocab_agrees"] = vocab_agrees(llama.llm, tok)
                if llama.n_vocab != engine.info().vocab_size:
                    info["vocab_agrees"] = False
                if not args.skip_bon:
                    # unified KV: the prompt's cells once plus n private tails
                    need = args.bon_prompt_len + args.n * args.bon_new_tokens
                    why = on_model(llama.open_shared, args.n, -(-need // 256) * 256)
                    info["bon_mode"] = "independent" if why else "shared-prompt"
                    if why:
                        print(f"llama.cpp best-of-{args.n}: {why}; falling back to {args.n} "
                              "independent runs")
                if not args.skip_decode8:
                    need = args.decode8_n * (args.decode8_prompt_len + args.decode8_new_tokens)
                    why = on_model(llama.open_many, args.decode8_n, -(-need // 256) * 256)
                    info["decode8"] = why or "one llama_decode per step"
                    if why:
                        print(f"llama.cpp: {args.decode8_n} sequences together: {why}; "
                              "skipping that row")
            ours = on_model(make_ours, weights, max(args.prompt_len + args.new_tokens + PAGE_SIZE,
                                                    args.quality_tokens + PAGE_SIZE), kv_dtype)
            if fmt in ("fp32", "q4") and "fp32" in formats and "q4" in formats:
                # the weights' fidelity alone: both sides on fp32 KV pages
                judge = ours if kv_dtype == "fp32" else on_model(
                    make_ours, weights, args.quality_tokens + PAGE_SIZE)
                info[f"logits_{fmt}"] = on_model(judge.logits,
                                                 quality_ids(tok, args.quality_tokens))
                del judge
                if "logits_q4" in info and "logits_fp32" in info:
                    info.update(compare_logits(info.pop("logits_q4"), info.pop("logits_fp32")))
            async with engine:
                warm = prompt[:64]  # warm both sides (and this thread's OpenMP team)
                on_model(llama.generate, warm, 4)
                on_model(ours.generate, warm, 4)
                if not args.skip_bon:
                    on_model(llama.best_of, bon_prompt[:64], 2, 4, 0)
                    await run_ours(engine, bon_prompt[:64], 2, 4, 0)
                many = llama.many_ctx is not None
                if many:
                    on_model(llama.decode_many, [warm, warm], 4)
                    await decode_many_ours(engine, [warm, [7] + warm[1:]], 4)
                for r in range(args.repeats):  # interleaved: machine noise hits both alike
                    for name, side in (("llamacpp", llama), (fmt, ours)):
                        out, pf, dec = on_model(side.generate, prompt, args.new_tokens)
                        rows[name]["pf"].append(len(prompt) / pf)
                        rows[name]["dec"].append((args.new_tokens - 1) / dec)
                        info.setdefault(f"greedy_{name}", out)
                    if not args.skip_bon:
                        salted = [1000 + r] + bon_prompt[1:]  # a fresh prompt each repeat
                        rows["llamacpp"]["bon"].append(
                            on_model(llama.best_of, salted, args.n, args.bon_new_tokens, r))
                        wall, _, _ = await run_ours(engine, salted, args.n, args.bon_new_tokens, r)
                        rows[fmt]["bon"].append(wall)
                    if many:  # distinct first tokens: no page shared between them or repeats
                        prompts = [[2000 + 64 * r + s] + many_prompt[1:]
                                   for s in range(args.decode8_n)]
                        rows["llamacpp"]["d8"].append(
                            on_model(llama.decode_many, prompts, args.decode8_new_tokens))
                        rows[fmt]["d8"].append(
                            await decode_many_ours(engine, prompts, args.decode8_new_tokens))
            # The engine shut its thread down on exit; wait for it, so that its OpenMP team
            # is gone before the next engine's thread starts one.
            del ours, engine, on_model
            gc.collect()
            model_thread.join(timeout=60)
    finally:
        if llama is not None:
            llama.close()
    return rows, info


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--bon-prompt-len", type=int, default=1024)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--bon-new-tokens", type=int, default=64)
    ap.add_argument("--no-int8", action="store_true", help="skip the pie-ctx int8 rows")
    ap.add_argument("--no-q4", action="store_true",
                    help="skip the pie-ctx q4 rows (weights='gguf': the file's own blocks)")
    ap.add_argument("--quality-tokens", type=int, default=1024,
                    help="tokens of the quality text the q4 quality keys are measured on")
    ap.add_argument("--skip-bon", action="store_true", help="skip the best-of-n rows")
    ap.add_argument("--decode8-n", type=int, default=8,
                    help="independent contexts decoding together (the decode8 row)")
    ap.add_argument("--decode8-prompt-len", type=int, default=1024)
    ap.add_argument("--decode8-new-tokens", type=int, default=32)
    ap.add_argument("--skip-decode8", action="store_true", help="skip the decode8 row")
    ap.add_argument("--q4-kv-dtype", default="bf16", choices=KV_DTYPES,
                    help="the q4 rows' KV pages (llama.cpp keeps an f16 KV; default bf16)")
    args = parse_args(ap, repeats=1, prompt_len=16, new_tokens=4, bon_prompt_len=32, n=2,
                      bon_new_tokens=4, decode8_n=2, decode8_prompt_len=32,
                      decode8_new_tokens=4, quality_tokens=64)
    assert args.new_tokens >= 2 and args.bon_new_tokens >= 1 and args.n >= 1

    try:
        import llama_cpp
    except ImportError:
        print(f"llama-cpp-python is not installed; skipping. Install it with `{INSTALL}` "
              "(builds llama.cpp from source: several minutes on 2 cores).")
        emit({"skipped": "llama-cpp-python not installed"})
        return
    except OSError as err:  # installed, but its libllama cannot be found or loaded
        print(f"llama-cpp-python cannot load llama.cpp ({err}); skipping. Point "
              "LLAMA_CPP_LIB_PATH at the folder of a libllama.so, or reinstall it with "
              f"`{INSTALL}`.")
        emit({"skipped": f"llama-cpp-python cannot load llama.cpp: {err}"})
        return

    from runtime.model.loader import default_gguf_path

    gguf = Path(default_gguf_path())
    if not gguf.is_file():  # boot_engine fetches it; llama.cpp needs it first
        from runtime.model.loader import resolve_model

        resolve_model(None, progress=True)
    # fp32 runs last: after an fp32 phase every later phase of the process ran slower, on
    # both sides (llama.cpp's decode 101 -> 50-70 tok/s, ours on q4 150 -> 75; int8 first
    # changed nothing; cause not found), so it would bias the rows that follow it
    formats = ([] if args.no_int8 else ["int8"]) + ([] if args.no_q4 else ["q4"]) + ["fp32"]
    rows, info = anyio.run(measure, args, llama_cpp, gguf, formats)

    def best(side: str, key: str) -> float | None:
        v = rows.get(side, {}).get(key)
        return None if not v else (min(v) if key == "bon" else max(v))

    def med(side: str, key: str) -> float | None:
        v = rows.get(side, {}).get(key)
        return statistics.median(v) if v else None

    def ratio(ours: float | None, theirs: float | None, wall: bool) -> float | None:
        if ours is None or theirs is None:
            return None
        return theirs / ours if wall else ours / theirs

    sides = ["llamacpp", *formats]
    print(f"{gguf.name}, threads={torch.get_num_threads()}, llama-cpp-python "
          f"{llama_cpp.__version__}, vocab agrees: {info['vocab_agrees']}, "
          f"best-of-{args.n} llama.cpp mode: {info['bon_mode']}; KV pages: llama.cpp f16, "
          f"pie-ctx fp32 and int8 fp32, q4 {args.q4_kv_dtype}")
    head = "".join(f"{s:>11}" for s in ["llama.cpp", *formats])
    head += "".join(f"{s + '/llama':>13}" for s in formats)
    print(f"{'':30}{head}   (ratios > 1: pie-ctx faster)")
    labels = [("pf", f"prefill {args.prompt_len} tok/s"),
              ("dec", f"decode @{args.prompt_len} tok/s")]
    if not args.skip_bon:
        labels.append(("bon", f"best-of-{args.n} wall s"))
    if rows["llamacpp"]["d8"]:
        labels.append(("d8", f"{args.decode8_n}x decode @{args.decode8_prompt_len} tok/s"))
    for key, label in labels:
        for stat, fn in (("best", best), ("median", med)):
            vals = [fn(s, key) for s in sides]
            line = "".join(f"{v:11.2f}" for v in vals)
            line += "".join(f"{ratio(v, vals[0], key == 'bon'):13.2f}" for v in vals[1:])
            print(f"{label + f' ({stat})':30}{line}")
    agree = leading_run(info["greedy_llamacpp"], info["greedy_fp32"])
    print(f"greedy tokens: llama.cpp and pie-ctx fp32 agree on the first {agree}/"
          f"{args.new_tokens} (llama.cpp computes on Q4_1 blocks, pie-ctx on their fp32 copy)")

    result: dict[str, Any] = {"q4_kv_dtype": None if args.no_q4 else args.q4_kv_dtype}
    for side in sides:
        result[f"{side}_prefill_tok_s"] = best(side, "pf")
        result[f"{side}_decode_tok_s"] = best(side, "dec")
        result[f"{side}_bon_wall_s"] = best(side, "bon")
        result[f"{side}_decode8_tok_s"] = best(side, "d8")
    for fmt in ("q4", "int8", "fp32"):
        for key, name, wall in (("dec", "decode", False), ("pf", "prefill", False),
                                ("bon", "bon", True), ("d8", "decode8", False)):
            result[f"{fmt}_{name}_vs_llamacpp"] = ratio(best(fmt, key), best("llamacpp", key),
                                                       wall)
    result["q4_max_abs_logit_diff_vs_fp32"] = info.get("q4_max_abs_logit_diff_vs_fp32")
    result["q4_greedy_agreement_vs_fp32"] = info.get("q4_greedy_agreement_vs_fp32")
    for fmt in ("int8", "q4"):  # absent when --no-int8 / --no-q4: keep the keys, as null
        for name in ("prefill_tok_s", "decode_tok_s", "bon_wall_s", "decode8_tok_s"):
            result.setdefault(f"{fmt}_{name}", None)
    result.update({"threads": torch.get_num_threads(), "gguf": gguf.name,
                   "llamacpp_version": llama_cpp.__version__, "bon_mode": info["bon_mode"],
                   "decode8_mode": info["decode8"], "decode8_n": args.decode8_n,
                   "decode8_prompt_len": args.decode8_prompt_len,
                   "decode8_new_tokens": args.decode8_new_tokens,
                   "vocab_agrees": info["vocab_agrees"], "greedy_identical_vs_fp32": agree,
                   "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
                   "bon_prompt_len": args.bon_prompt_len, "n": args.n,
                   "bon_new_tokens": args.bon_new_tokens, "repeats": args.repeats})
    emit(result)


if __name__ == "__main__":
    main()
