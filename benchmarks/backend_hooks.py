"""The two hooks into transformers, measured: a registered attention function vs a paged cache object.

    python benchmarks/backend_hooks.py [--contexts 128,1024] [--tokens 32] [--repeats 3] [--smoke]

How the transformers backend plugs pie-ctx's pages into transformers' own model classes
was chosen by measuring. Both hooks here run the default model
(SmolLM2, fp32) over the same kind of page pool, one context, greedy decode:

* ``attention``: what pie-ctx ships (``runtime.model.transformers_backend``): the model is
  loaded with ``attn_implementation="pie_ctx"``; each layer's attention writes its K/V
  into the pages and attends with the engine's paged backend;
* ``cache``: the cache-API route (PageForge's): a ``transformers`` ``Cache`` whose layers
  write the new K/V into the same pages and hand back the context's whole K/V, gathered
  from its pages, for transformers' SDPA attention (this prototype is in this file only);
* ``dynamic``: plain transformers with its ``DynamicCache``, for reference.

A cache object gets one ``[batch, kv_heads, T, head_dim]`` tensor per layer, so a step of
contexts of different lengths would need padding; this measures its best case, batch 1.
The JSON line carries ``cache_over_attention_ms`` per context length (a cache step's time
over the attention-function step's) and the logits' agreement.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
from common import emit, parse_args, prompt_tokens, table

from runtime.kv.pool import PagePool, PoolShape
from runtime.model.batch import SeqInput

PAGE = 16


def paged_cache(pool: torch.Tensor, num_layers: int) -> Any:
    """A transformers ``Cache`` over one context's pages of ``pool`` (the cache route)."""
    from transformers.cache_utils import Cache, CacheLayerMixin

    class Seq:
        num_cached = 0
        table = torch.arange(pool.shape[0])  # the context's pages: all of them, in order

    class PagedLayer(CacheLayerMixin):
        is_sliding = False
        is_compileable = False

        def __init__(self, layer: int) -> None:
            super().__init__()
            self.layer = layer
            self.is_initialized = True

        def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
            pass

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
                   **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
            t, nc = key_states.shape[2], Seq.num_cached
            idx = torch.arange(nc, nc + t)
            pages, slots = Seq.table[idx // PAGE], idx % PAGE
            new = torch.stack((key_states[0].transpose(0, 1), value_states[0].transpose(0, 1)), 1)
            pool[pages, slots, self.layer] = new  # [t, 2, KVH, D]
            n = nc + t
            kv = pool[:, :, self.layer].index_select(0, Seq.table[: -(-n // PAGE)])
            kv = kv.reshape(-1, *kv.shape[2:])[:n]  # [n, 2, KVH, D]
            return kv[:, 0].transpose(0, 1)[None], kv[:, 1].transpose(0, 1)[None]

        def get_mask_sizes(self, query_length: int, *args: Any) -> tuple[int, int]:
            return Seq.num_cached + query_length, 0

        def get_seq_length(self) -> int:
            return Seq.num_cached

        def get_max_length(self) -> int:
            return -1

    cache = Cache(layers=[PagedLayer(i) for i in range(num_layers)])
    cache.seq = Seq
    return cache


def decode_cache(model: Any, pool: torch.Tensor, prompt: list[int], n: int,
                 ) -> tuple[float, list[int], torch.Tensor]:
    cache = paged_cache(pool, model.config.num_hidden_layers)

    def step(tokens: list[int]) -> torch.Tensor:
        nc = cache.seq.num_cached
        out = model(input_ids=torch.tensor([tokens]), cache=cache, use_cache=True,
                    position_ids=torch.arange(nc, nc + len(tokens))[None], logits_to_keep=1)
        cache.seq.num_cached += len(tokens)
        return out.logits[0, -1]

    first = step(prompt)
    return _timed(step, first, n)


def decode_attention(runner: Any, prompt: list[int], n: int,
                     ) -> tuple[float, list[int], torch.Tensor]:
    pages = list(range(runner.num_pages))
    state = {"num_cached": 0}

    def step(tokens: list[int]) -> torch.Tensor:
        nc = state["num_cached"]
        logits = runner.forward([SeqInput(tokens, list(range(nc, nc + len(tokens))), pages, nc,
                                          [len(tokens) - 1])])
        state["num_cached"] += len(tokens)
        return logits[0]

    first = step(prompt)
    return _timed(step, first, n)


def decode_dynamic(model: Any, prompt: list[int], n: int) -> tuple[float, list[int], torch.Tensor]:
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    state = {"num_cached": 0}

    def step(tokens: list[int]) -> torch.Tensor:
        nc = state["num_cached"]
        out = model(input_ids=torch.tensor([tokens]), cache=cache, use_cache=True,
                    position_ids=torch.arange(nc, nc + len(tokens))[None], logits_to_keep=1)
        state["num_cached"] += len(tokens)
        return out.logits[0, -1]

    first = step(prompt)
    return _timed(step, first, n)


def _timed(step: Any, first: torch.Tensor, n: int) -> tuple[float, list[int], torch.Tensor]:
    """Greedy ``n`` tokens after the prompt's logits ``first``: seconds a token, tokens."""
    tokens = [int(first.argmax())]
    t0 = time.perf_counter()
    for _ in range(n - 1):
        tokens.append(int(step([tokens[-1]]).argmax()))
    return (time.perf_counter() - t0) / (n - 1), tokens, first


def main_async(args: argparse.Namespace) -> None:
    from transformers import AutoModelForCausalLM

    from runtime.model.loader import dense_folder, load_tokenizer, resolve_model
    from runtime.model.transformers_backend import TransformersRunner, load_transformers_model

    torch.set_grad_enabled(False)
    folder = resolve_model(None, progress=False)[1]
    tokenizer = load_tokenizer(folder)
    hooked = load_transformers_model(None, dtype=torch.float32, progress=False)
    plain = AutoModelForCausalLM.from_pretrained(dense_folder(folder), dtype=torch.float32,
                                                 attn_implementation="sdpa").eval()
    contexts = [int(c) for c in args.contexts.split(",")]
    pages = -(-(max(contexts) + args.tokens) // PAGE)

    def new_pool() -> torch.Tensor:
        return PagePool(PoolShape(pages, PAGE, hooked.num_layers, hooked.num_kv_heads, hooked.head_dim)).kv

    rows, result = [], {}
    for ctx in contexts:
        prompt = prompt_tokens(tokenizer, ctx)
        times: dict[str, list[float]] = {"attention": [], "cache": [], "dynamic": []}
        outs: dict[str, tuple[list[int], torch.Tensor]] = {}
        for _ in range(args.repeats):  # interleaved
            runner = TransformersRunner(hooked, new_pool(), PAGE)
            s, toks, first = decode_attention(runner, prompt, args.tokens)
            times["attention"].append(s)
            outs["attention"] = toks, first
            s, toks, first = decode_cache(plain, new_pool(), prompt, args.tokens)
            times["cache"].append(s)
            outs["cache"] = toks, first
            s, toks, first = decode_dynamic(plain, prompt, args.tokens)
            times["dynamic"].append(s)
            outs["dynamic"] = toks, first
        ms = {k: 1e3 * statistics.median(v) for k, v in times.items()}
        diff = float((outs["cache"][1] - outs["attention"][1]).abs().max())
        same = outs["cache"][0] == outs["attention"][0] == outs["dynamic"][0]
        rows += [(f"context {ctx}: ms a token", ", ".join(f"{k} {v:.1f}" for k, v in ms.items())),
                 (f"context {ctx}: cache / attention", f"{ms['cache'] / ms['attention']:.2f}"),
                 (f"context {ctx}: logits diff, tokens equal", f"{diff:.2g}, {same}")]
        result[str(ctx)] = {"ms_per_token": ms, "cache_over_attention_ms":
                            ms["cache"] / ms["attention"], "logits_max_abs_diff": diff,
                            "tokens_identical": same}
    table([("threads", str(torch.get_num_threads())), *rows])
    emit({"cache_over_attention_ms": {c: r["cache_over_attention_ms"] for c, r in result.items()},
          "contexts": result, "tokens": args.tokens, "repeats": args.repeats})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="128,1024")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    main_async(parse_args(ap, contexts="16", tokens=3, repeats=1))


if __name__ == "__main__":
    main()
