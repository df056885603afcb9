"""How far a cheaper variant of the default model (half precision, int8 weights, int8 KV
pages) is from fp32.

    python benchmarks/quality.py [--dtype bfloat16|float16|float32] [--weights fp32|int8|gguf]
                                 [--kv-dtype fp32|int8|bf16] [--prompts 20] [--tokens 64] [--smoke]

Two measures, the quality gate of every such variant (docs/models.md, docs/forward.md):

* ``greedy_agreement``: for each of ``--prompts`` chat prompts fp32 greedily continues
  ``--tokens`` tokens; the variant scores the same sequence in one pass (teacher forcing)
  and we count the positions where its greedy choice equals fp32's. Also the largest logit
  error relative to its row's max |logit| (``max_rel_logit_diff``), and how long the
  free-running greedy generations stay identical (``free_run_identical_mean``).
* ``ppl_delta``: perplexity on benchmarks/data/alice_chapter_1.txt (public-domain prose,
  ~2,700 tokens), relative to fp32's: ``ppl / fp32_ppl - 1``.

For a dtype variant, transformers' own forward in that dtype is scored beside ours
(``hf_...``): the part of the error that belongs to the dtype. The last line is one JSON
object.
"""

from __future__ import annotations

import argparse
import math
import statistics
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from common import Ours, emit, load_hf, parse_args, table

PROMPTS = [
    "What is the capital of France?", "Write a haiku about the sea.",
    "Explain gravity to a child.", "List three prime numbers and say why they are prime.",
    "How do I reverse a list in Python?", "Summarise the plot of Romeo and Juliet.",
    "What causes the seasons on Earth?", "Give me a recipe for pancakes.",
    "Translate 'good morning' into Spanish and French.", "Why is the sky blue?",
    "Describe a cat to someone who has never seen one.", "What is photosynthesis?",
    "Write a short poem about autumn leaves.", "How does a bicycle stay upright?",
    "What are the benefits of regular exercise?", "Explain what a database index is.",
    "Tell me a fun fact about octopuses.", "How do vaccines work?",
    "What is the difference between weather and climate?", "Suggest a name for a bakery.",
]
TEXT = Path(__file__).resolve().parent / "data" / "alice_chapter_1.txt"


def chat_ids(tokenizer: Any, text: str) -> list[int]:
    chat = tokenizer.render_chat([{"role": "user", "content": text}], add_generation_prompt=True)
    return tokenizer.encode(chat) if isinstance(chat, str) else list(chat)


def compare(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """(fraction of rows with ``want``'s argmax, max |got - want| / max |want| over rows)."""
    agree = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    rel = ((got - want).abs().amax(-1) / want.abs().amax(-1)).max().item()
    return agree, rel


def identical_run(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))


def agreement(ref: Ours, var: Ours, tokenizer: Any, prompts: int = 20, tokens: int = 64,
              hf: tuple[Any, Any] | None = None) -> dict[str, float]:
    """Greedy agreement and logit error of ``var`` against ``ref`` (see the module doc);
    with ``hf = (reference model, variant model)`` the same for transformers."""
    ours, theirs, free = [], [], []
    for text in PROMPTS[:prompts]:
        prompt = chat_ids(tokenizer, text)
        cont, _, _ = ref.generate(prompt, tokens)
        seq = prompt + cont
        rows = slice(len(prompt) - 1, len(seq) - 1)  # the rows that chose each continuation
        want = ref.logits(seq)[rows]
        ours.append(compare(var.logits(seq)[rows], want))
        if hf is not None:
            with torch.inference_mode():
                ids = torch.tensor([seq])
                hf_want = hf[0](ids).logits[0, rows].float()
                theirs.append(compare(hf[1](ids).logits[0, rows].float(), hf_want))
        free.append(identical_run(cont, var.generate(prompt, tokens)[0]))
    out = {"greedy_agreement": statistics.mean(a for a, _ in ours),
           "max_rel_logit_diff": max(r for _, r in ours),
           "free_run_identical_mean": statistics.mean(free),
           "free_run_identical_min": min(free)}
    if theirs:
        out["hf_greedy_agreement"] = statistics.mean(a for a, _ in theirs)
        out["hf_max_rel_logit_diff"] = max(r for _, r in theirs)
    return out


def perplexity(model: Ours, ids: list[int]) -> float:
    """exp(mean next-token NLL) over ``ids``, scored in 512-token passes."""
    logits = model.logits(ids)[:-1]
    return math.exp(F.cross_entropy(logits, torch.tensor(ids[1:])).item())


def text_ids(tokenizer: Any) -> list[int]:
    return tokenizer.encode(TEXT.read_text())


def main() -> None:
    from runtime.model.loader import load_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    ap.add_argument("--weights", default="fp32", choices=("fp32", "int8", "gguf"))
    ap.add_argument("--kv-dtype", default="fp32", choices=("fp32", "int8", "bf16"))
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=64)
    args = parse_args(ap, prompts=1, tokens=8)
    if args.smoke and (args.dtype, args.weights, args.kv_dtype) == ("float32", "fp32", "fp32"):
        args.weights = "int8"  # a variant to compare
    if args.dtype == "float32" and args.weights == "fp32" and args.kv_dtype == "fp32":
        ap.error("that is the reference itself: pass --dtype, --weights or --kv-dtype")

    base = load_model(None, progress=False)
    variant = base if args.dtype == "float32" else load_model(None, dtype=args.dtype,
                                                              progress=False)
    ids = text_ids(base.tokenizer)[:256 if args.smoke else None]
    ref = Ours(base, 4096)
    var = Ours(variant, 4096, weights=args.weights, kv_dtype=args.kv_dtype)
    hf = None
    if args.weights == "fp32" and args.kv_dtype == "fp32":  # a dtype variant: transformers' own in that dtype beside ours
        hf = (load_hf(base.path), load_hf(base.path, dtype=getattr(torch, args.dtype)))
    result = agreement(ref, var, base.tokenizer, args.prompts, args.tokens, hf)
    ppl_ref, ppl_var = perplexity(ref, ids), perplexity(var, ids)
    result |= {"ppl": ppl_var, "fp32_ppl": ppl_ref, "ppl_delta": ppl_var / ppl_ref - 1}
    label = f"{args.dtype}, {args.weights} weights, {args.kv_dtype} KV pages"
    hf_note = (lambda k: f"   transformers {result[k]:.4f}") if hf else (lambda k: "")
    table([("variant", f"{label} vs float32, {args.prompts} prompts x {args.tokens} tokens"),
           ("greedy agreement (teacher forced)",
            f"ours {result['greedy_agreement']:.4f}{hf_note('hf_greedy_agreement')}"),
           ("max |logit error| / max |logit|",
            f"ours {result['max_rel_logit_diff']:.4f}{hf_note('hf_max_rel_logit_diff')}"),
           ("free-running identical run", f"{result['free_run_identical_mean']:.1f} of "
                                          f"{args.tokens} (min {result['free_run_identical_min']})"),
           ("perplexity", f"{ppl_var:.3f} vs fp32 {ppl_ref:.3f} ({result['ppl_delta']:+.2%}, "
                          f"{len(ids)} tokens)")])
    emit({"dtype": args.dtype, "weights": args.weights, "kv_dtype": args.kv_dtype, **result, "prompts": args.prompts,
          "tokens": args.tokens})


if __name__ == "__main__":
    main()
