"""Our ModelRunner vs HF transformers on the default model, side by side in one process.

Run: ``.venv/bin/python benchmarks/model.py [--prompt-len 512] [--new-tokens 128]
[--device cpu|cuda] [--dtype float32|bfloat16|float16] [--no-int8] [--no-q4] [--smoke]``.
Prints a table and, as its last line, one JSON object (max_abs_logit_diff,
greedy_tokens_identical, prefill/decode tok/s for both, weight_bytes, mem_bandwidth_gbs,
decode roofline fraction; on CPU also the int8-weights rows: int8_decode_tok_s,
int8_prefill_tok_s, int8_greedy_agreement, int8_ppl_delta, int8_weight_bytes, measured in
the same run; and for each format a profiled decode step: ops_per_layer_decode,
decode_ms_per_step, python_share_decode (the share of the step's wall time outside any
operation Python called: Python itself; goal <= 10%) and decode_profile, int8_ the same
for int8, q4_ for the GGUF's own blocks (weights="gguf": q4_decode_ms_per_step,
q4_decode_tok_s, q4_prefill_tok_s...); each also with the fused decode step off, suffixed
``_eager`` (runtime/model/fused_step.py; see benchmarks/quality.py for the quality
measures); and the cost of deterministic numerics, time with the batch-invariant kernels
over time without: deterministic_prefill_ratio, deterministic_decode_ratio (batch 1) and
deterministic_decode8_ratio (8 unrelated contexts decoding together; docs/performance.md). Both sides run in the same dtype on the same device (default
fp32 on CPU) with the same torch thread count, greedy, batch 1. The HF side loads the same
GGUF through transformers when it can (an independent dequantization), else the converted
folder.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from common import Ours, parse_args
from quality import agreement, perplexity, text_ids

from runtime.model.loader import default_gguf_path, dense_folder, load_model


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def mem_bandwidth_gbs(device: torch.device, num_bytes: int = 256 << 20, repeats: int = 5) -> float:
    """Best-of-n large copy: (bytes read + bytes written) / seconds, in GB/s."""
    src = torch.ones(num_bytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * num_bytes / best / 1e9


class HF:
    """The same loop with transformers and its DynamicCache."""

    def __init__(self, folder: Path, device: torch.device, dtype: torch.dtype) -> None:
        from transformers import AutoModelForCausalLM

        gguf = Path(default_gguf_path())
        try:  # transformers' own GGUF dequantization needs `accelerate`
            self.model = AutoModelForCausalLM.from_pretrained(
                str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
            self.source = "gguf"
        except (ValueError, ImportError, OSError) as e:
            print(f"HF cannot load the GGUF ({e}); using the converted folder", file=sys.stderr)
            self.model = AutoModelForCausalLM.from_pretrained(str(dense_folder(folder)),
                                                              dtype=torch.float32)
            self.source = "converted folder"
        self.model.to(device=device, dtype=dtype).eval()
        self.device = device

    def _ids(self, tokens: list[int] | list[list[int]]) -> torch.Tensor:
        return torch.tensor(tokens, device=self.device)

    @torch.inference_mode()
    def logits(self, tokens: list[int]) -> torch.Tensor:
        return self.model(self._ids([tokens])).logits[0].float()

    @torch.inference_mode()
    def generate(self, prompt: list[int], n: int) -> tuple[list[int], float, float]:
        t0 = time.perf_counter()
        res = self.model(self._ids([prompt]), use_cache=True, logits_to_keep=1)
        out = [int(res.logits[0, -1].argmax())]  # (a device sync)
        t1 = time.perf_counter()
        past = res.past_key_values
        for _ in range(n - 1):
            res = self.model(self._ids([[out[-1]]]), past_key_values=past, use_cache=True)
            past = res.past_key_values
            out.append(int(res.logits[0, -1].argmax()))
        return out, t1 - t0, time.perf_counter() - t1


PROJECTION_OPS = ("aten::_int_mm", "aten::linear", "aten::addmm", "aten::mm", "mkldnn::",
                  "quantized::", "aten::matmul", "pie::block_mm", "pie::proj_",
                  "aten::_weight_int4pack")
STEP_RANGE = "pie::decode_step"  # decode_step.cpp's range around a whole fused step
ATTENTION_OPS = ("aten::scaled_dot_product_attention", "pie::paged_attention")


class _ProfiledKernels:
    """runtime.model.kernels' module with every call wrapped in a profiler range named
    ``pie::<op>`` (pybind calls are otherwise invisible to torch's profiler, and the
    tensors they allocate would show as top-level ``aten::empty``)."""

    def __init__(self, module: object) -> None:
        self.module = module

    def __getattr__(self, name: str) -> object:
        attr = getattr(self.module, name)
        if not callable(attr):
            return attr

        def call(*args: object) -> object:
            with torch.profiler.record_function(f"pie::{name}"):
                return attr(*args)
        return call


def decode_profile(side: Ours, prompt: list[int]) -> dict[str, float]:
    """One decode step after ``prompt``, profiled: the operations it runs per layer (torch's
    top-level ops plus pie-ctx's own kernel calls), their mean microseconds, and the step's
    shares of projections, attention, other ops (glue) and what no op accounts for
    (Python, the dispatcher, the profiler itself)."""
    from torch.profiler import ProfilerActivity, profile

    from runtime.model import kernels

    logits = side.prefill(prompt)
    token, pos = int(logits[0].argmax()), len(prompt)
    side.forward([token], pos, [0])  # warm
    built, blocks = kernels.ops(), kernels.block_ops()
    if built is not None:
        kernels._module = _ProfiledKernels(built)
    if blocks is not None:  # weights="gguf": the block kernels (runtime/model/blocks.py)
        kernels._block_module = _ProfiledKernels(blocks)
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            t0 = time.perf_counter()
            side.forward([token], pos + 1, [0])
            wall = time.perf_counter() - t0
    finally:
        if built is not None:
            kernels._module = built
        if blocks is not None:
            kernels._block_module = blocks
    top = [e for e in prof.events() if e.cpu_parent is None and "::" in e.name]
    # the fused decode step (runtime/model/fused_step.py) is one call from Python: its
    # operations are the ranges it opens, one level down
    ops = [(e.name, e.cpu_time_total / 1e6) for t in top
           for e in (t.cpu_children if t.name == STEP_RANGE else [t])]
    share = {"projections": 0.0, "attention": 0.0, "glue": 0.0}
    for name, t in ops:
        kind = ("projections" if name.startswith(PROJECTION_OPS) else
                "attention" if name.startswith(ATTENTION_OPS) else "glue")
        share[kind] += t
    layers = side.runner.config.num_layers
    # outside any operation Python called: Python itself (and the profiler's own cost);
    # the step's inside is C++ whatever its ranges cover
    outside = 1 - sum(e.cpu_time_total / 1e6 for e in top) / wall
    per: dict[str, float] = {}
    for name, t in ops:
        per[name] = per.get(name, 0.0) + t
    return {"ops_per_layer": len(ops) / layers,
            "us_per_op": sum(t for _, t in ops) / len(ops) * 1e6,
            **{f"{k}_share": v / wall for k, v in share.items()},
            "unaccounted_share": max(0.0, 1 - sum(share.values()) / wall),
            "python_share": max(0.0, outside),
            "fused": STEP_RANGE in {e.name for e in top},
            "us_by_op": {n: round(t * 1e6, 1) for n, t in
                         sorted(per.items(), key=lambda kv: -kv[1])}}


@contextlib.contextmanager
def step_off():
    """The fused decode step off for a while (as ``PIE_CTX_DECODE_STEP=0`` would)."""
    from runtime.model import fused_step

    was, fused_step.ENABLED = fused_step.ENABLED, False
    try:
        yield
    finally:
        fused_step.ENABLED = was


def _rounded(prof: dict) -> dict:
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in prof.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    ap.add_argument("--no-int8", action="store_true", help="skip the int8-weights rows")
    ap.add_argument("--no-q4", action="store_true",
                    help="skip the q4 rows (weights='gguf': the GGUF's own blocks)")
    ap.add_argument("--quality-prompts", type=int, default=20)
    args = parse_args(ap, prompt_len=16, new_tokens=4, repeats=1, quality_prompts=1)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)

    bw_start = mem_bandwidth_gbs(device)  # measured at both ends; the best is the least disturbed
    loaded = load_model(device=device, dtype=dtype)
    tok = loaded.tokenizer
    room = max(4096, 8 * (args.prompt_len + args.new_tokens + 32))  # decode8's 8 contexts
    ours = Ours(loaded, room)
    det = Ours(loaded, room, deterministic=True)  # the engine's default kernels
    hf = HF(loaded.path, device, dtype)
    int8 = None
    if device.type == "cpu" and not args.no_int8:
        int8 = Ours(loaded, 4096, weights="int8")
    q4 = Ours(loaded, 4096, weights="gguf") if device.type == "cpu" and not args.no_q4 else None

    chat = tok.render_chat([{"role": "system", "content": "You are a helpful assistant."},
                            {"role": "user", "content": "Explain paged attention in two sentences."}],
                           add_generation_prompt=True)
    chat_ids = tok.encode(chat) if isinstance(chat, str) else list(chat)
    diff = (ours.prefill(chat_ids, all_logits=True).float() - hf.logits(chat_ids)).abs().max().item()
    checked = 8 if args.smoke else 64  # greedy tokens compared
    g_ours, _, _ = ours.generate(chat_ids, checked)
    g_hf, _, _ = hf.generate(chat_ids, checked)
    identical = next((i for i, (a, b) in enumerate(zip(g_ours, g_hf, strict=True)) if a != b),
                     len(g_ours))  # length of the identical leading run

    text = "The quick brown fox jumps over the lazy dog. " * 200
    prompt = tok.encode(text)[: args.prompt_len]
    sides = {"": ours, "hf_": hf, "det_": det} | ({"int8_": int8} if int8 is not None else {}) | (
        {"q4_": q4} if q4 is not None else {})
    rows: dict[str, list[float]] = {p + k: [] for p in sides for k in ("pf", "dec", "eager_dec")}
    for _ in range(args.repeats):  # interleave so machine noise hits every side alike
        for p, side in sides.items():
            _, pf, dec = side.generate(prompt, args.new_tokens)
            rows[p + "pf"].append(len(prompt) / pf)
            rows[p + "dec"].append((args.new_tokens - 1) / dec)
            if p not in ("hf_", "det_"):  # the same decode with the fused step off (PIE_CTX_DECODE_STEP=0)
                with step_off():
                    _, _, dec = side.generate(prompt, args.new_tokens)
                rows[p + "eager_dec"].append((args.new_tokens - 1) / dec)
    # 8 unrelated contexts decoding together, with and without the invariant kernels
    words = tok.encode(text)
    prompts8 = [words[7 * i: 7 * i + len(prompt)] for i in range(8)]
    rows |= {"dec8": [], "det_dec8": []}
    for _ in range(args.repeats):
        for p, side in (("", ours), ("det_", det)):
            rows[p + "dec8"].append(8 * args.new_tokens / side.decode_batch(prompts8,
                                                                            args.new_tokens))
    best = {k: max(v) for k, v in rows.items() if v}
    med = {k: statistics.median(v) for k, v in rows.items() if v}
    profiles = {p: decode_profile(side, prompt) for p, side in sides.items() if p not in ("hf_", "det_")}
    with step_off():
        profiles |= {p + "eager_": decode_profile(side, prompt)
                     for p, side in sides.items() if p not in ("hf_", "det_")}
    bw = max(bw_start, mem_bandwidth_gbs(device))
    wbytes = ours.runner.weight_bytes
    roofline = bw * 1e9 / wbytes

    print(f"model {loaded.name} {args.dtype} {device}, threads={torch.get_num_threads()}, "
          f"attention {ours.runner.backend.name}, HF from {hf.source}")
    print(f"{'':24}{'ours':>10}{'hf':>10}{'ratio':>8}")
    for label, a, b in (("prefill tok/s (best)", best["pf"], best["hf_pf"]),
                        ("decode tok/s (best)", best["dec"], best["hf_dec"]),
                        ("prefill tok/s (median)", med["pf"], med["hf_pf"]),
                        ("decode tok/s (median)", med["dec"], med["hf_dec"])):
        print(f"{label:24}{a:10.1f}{b:10.1f}{a / b:8.2f}")
    print(f"decode step, profiled ({args.prompt_len} tokens of context; shares of one "
          "step's wall time, the profiler's own cost counted as unaccounted):")
    for p, prof in profiles.items():
        print(f"  {p.rstrip('_') or 'fp32':11} {1e3 / best[p + 'dec']:6.1f} ms/step "
              f"{prof['ops_per_layer']:5.1f} ops/layer {prof['us_per_op']:6.1f} us/op  "
              + "  ".join(f"{k.removesuffix('_share')} {v:.0%}" for k, v in prof.items()
                          if k.endswith("_share")))
    extra: dict[str, object] = {}
    for p in [p for p in sides if p not in ("hf_", "det_")]:  # fp32, int8, q4
        extra |= {f"{p}ops_per_layer_decode": round(profiles[p]["ops_per_layer"], 2),
                  f"{p}decode_ms_per_step": round(1e3 / best[p + "dec"], 3),
                  f"{p}python_share_decode": round(profiles[p]["python_share"], 3),
                  f"{p}decode_profile": _rounded(profiles[p]),
                  f"{p}ops_per_layer_decode_eager":
                      round(profiles[p + "eager_"]["ops_per_layer"], 2),
                  f"{p}decode_ms_per_step_eager": round(1e3 / best[p + "eager_dec"], 3),
                  f"{p}python_share_decode_eager":
                      round(profiles[p + "eager_"]["python_share"], 3)}
    if q4 is not None:  # the file's own blocks (docs/performance.md)
        extra |= {"q4_decode_tok_s": round(best["q4_dec"], 2),
                  "q4_prefill_tok_s": round(best["q4_pf"], 2),
                  "q4_weight_bytes": q4.runner.weight_bytes}
    extra |= {  # time with the invariant kernels / time without (rates the other way round)
        "deterministic_prefill_ratio": round(best["pf"] / best["det_pf"], 3),
        "deterministic_decode_ratio": round(best["dec"] / best["det_dec"], 3),
        "deterministic_decode8_ratio": round(best["dec8"] / best["det_dec8"], 3),
        "decode8_tok_s": round(best["dec8"], 2),
        "deterministic_kernels": det.runner.model.kernel_report}
    if int8 is not None:
        ids = text_ids(tok)[:256 if args.smoke else None]
        quality = agreement(ours, int8, tok, args.quality_prompts, checked)
        ppl_delta = perplexity(int8, ids) / perplexity(ours, ids) - 1
        extra |= {"int8_decode_tok_s": round(best["int8_dec"], 2),
                 "int8_prefill_tok_s": round(best["int8_pf"], 2),
                 "int8_decode_speedup": round(best["int8_dec"] / best["dec"], 3),
                 "int8_prefill_speedup": round(best["int8_pf"] / best["pf"], 3),
                 "int8_greedy_agreement": round(quality["greedy_agreement"], 4),
                 "int8_ppl_delta": round(ppl_delta, 4),
                 "int8_weight_bytes": int8.runner.weight_bytes,
                 "int8_weight_fraction": round(int8.runner.weight_bytes / ours.runner.weight_bytes, 3)}
        print(f"int8 weights: prefill {best['int8_pf']:.1f} tok/s ({extra['int8_prefill_speedup']:.2f}x "
              f"fp32), decode {best['int8_dec']:.1f} tok/s ({extra['int8_decode_speedup']:.2f}x), "
              f"greedy agreement {quality['greedy_agreement']:.3f} ({args.quality_prompts}x{checked}), "
              f"ppl {ppl_delta:+.2%}, weights {extra['int8_weight_bytes'] / 1e6:.0f} MB "
              f"({extra['int8_weight_fraction']:.2f}x)")
    print(f"max abs logit diff {diff:.3g}; greedy identical {identical}/{checked}; "
          f"weights {wbytes / 1e6:.0f} MB; bandwidth {bw:.1f} GB/s; roofline {roofline:.1f} tok/s; "
          f"decode at {best['dec'] / roofline:.0%} of roofline")
    print(json.dumps({
        "max_abs_logit_diff": diff, "greedy_tokens_identical": identical,
        "prefill_tok_s": round(best["pf"], 2), "hf_prefill_tok_s": round(best["hf_pf"], 2),
        "decode_tok_s": round(best["dec"], 2), "hf_decode_tok_s": round(best["hf_dec"], 2),
        "prefill_ratio": round(best["pf"] / best["hf_pf"], 3),
        "decode_ratio": round(best["dec"] / best["hf_dec"], 3),
        "weight_bytes": wbytes, "mem_bandwidth_gbs": round(bw, 2),
        "decode_roofline_tok_s": round(roofline, 2),
        "decode_roofline_fraction": round(best["dec"] / roofline, 3),
        "threads": torch.get_num_threads(), "prompt_len": len(prompt),
        "device": str(device), "dtype": args.dtype, "attention": ours.runner.backend.name,
        "new_tokens": args.new_tokens, **extra,
    }))


if __name__ == "__main__":
    main()
