"""How far a lower-precision variant of the default model is from fp32, ours beside HF's.

    python benchmarks/quality.py [--dtype bfloat16] [--prompts 20] [--tokens 64]

For each of ``--prompts`` chat prompts, fp32 greedily continues ``--tokens`` tokens; then
the variant (``--dtype``) scores the same sequence in one pass (teacher forcing) and we
count the positions where its greedy choice equals fp32's (``greedy_agreement``), and the
largest logit error relative to the row's max |logit| (``max_rel_logit_diff``). The same
figures for transformers' own forward in that dtype sit beside ours (``hf_...``): the part
of the error that is the dtype's, not ours. Also the free-running greedy generations'
identical leading run (``free_run_identical_mean``). The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from common import emit, load_hf, table

from runtime.model.loader import load_model
from runtime.model.runner import ModelRunner, SeqInput

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


class Scorer:
    """Our runner with a private pool: greedy generation and one-pass scoring."""

    def __init__(self, dtype: str, max_tokens: int, page_size: int = 16) -> None:
        self.loaded = load_model(None, dtype=dtype, progress=False)
        c = self.loaded.config
        w = self.loaded.weights["model.embed_tokens.weight"]
        pages = max_tokens // page_size + 2
        pool = torch.zeros(pages, page_size, c.num_layers, 2, c.num_kv_heads, c.head_dim,
                           dtype=w.dtype, device=w.device)
        self.runner = ModelRunner(c, self.loaded.weights, pool, page_size)
        self.pages = list(range(pages))

    def logits(self, tokens: list[int]) -> torch.Tensor:
        """[len(tokens), V] fp32 logits of one pass."""
        n = len(tokens)
        return self.runner.forward([SeqInput(tokens, list(range(n)), self.pages, 0,
                                             list(range(n)))]).float()

    def greedy(self, prompt: list[int], k: int) -> list[int]:
        row = self.runner.forward([SeqInput(prompt, list(range(len(prompt))), self.pages, 0,
                                            [len(prompt) - 1])])
        out = [int(row[0].argmax())]
        for _ in range(k - 1):
            pos = len(prompt) + len(out) - 1
            row = self.runner.forward([SeqInput([out[-1]], [pos], self.pages, pos, [0])])
            out.append(int(row[0].argmax()))
        return out


def compare(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """(fraction of rows with fp32's argmax, max |got - want| / max |want| over rows)."""
    agree = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    rel = ((got - want).abs().amax(-1) / want.abs().amax(-1)).max().item()
    return agree, rel


def identical_run(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()

    ref, var = Scorer("float32", 512), Scorer(args.dtype, 512)
    tok = ref.loaded.tokenizer
    hf_ref = load_hf(ref.loaded.path)
    hf_var = load_hf(ref.loaded.path, dtype=getattr(torch, args.dtype))
    ours, theirs, free = [], [], []
    for text in PROMPTS[: args.prompts]:
        chat = tok.render_chat([{"role": "user", "content": text}], add_generation_prompt=True)
        prompt = tok.encode(chat) if isinstance(chat, str) else list(chat)
        cont = ref.greedy(prompt, args.tokens)
        seq = prompt + cont
        rows = slice(len(prompt) - 1, len(seq) - 1)  # the rows that chose each continuation
        want = ref.logits(seq)[rows]
        ours.append(compare(var.logits(seq)[rows], want))
        with torch.inference_mode():
            hf_want = hf_ref(torch.tensor([seq])).logits[0, rows].float()
            hf_got = hf_var(torch.tensor([seq])).logits[0, rows].float()
        theirs.append(compare(hf_got, hf_want))
        free.append(identical_run(cont, var.greedy(prompt, args.tokens)))
    agree = statistics.mean(a for a, _ in ours)
    hf_agree = statistics.mean(a for a, _ in theirs)
    rel, hf_rel = max(r for _, r in ours), max(r for _, r in theirs)
    table([("variant", f"{args.dtype} vs float32, {args.prompts} prompts x {args.tokens} tokens"),
           ("greedy agreement (teacher forced)", f"ours {agree:.3f}   transformers {hf_agree:.3f}"),
           ("max |logit error| / max |logit|", f"ours {rel:.4f}   transformers {hf_rel:.4f}"),
           ("free-running identical run", f"{statistics.mean(free):.1f} of {args.tokens} "
                                          f"(min {min(free)})")])
    emit({"dtype": args.dtype, "greedy_agreement": agree, "hf_greedy_agreement": hf_agree,
          "max_rel_logit_diff": rel, "hf_max_rel_logit_diff": hf_rel,
          "free_run_identical_mean": statistics.mean(free), "free_run_identical_min": min(free),
          "prompts": args.prompts, "tokens": args.tokens})


if __name__ == "__main__":
    main()
