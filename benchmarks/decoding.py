"""Programmable decoding on the default model: constraints, speculation, select.

    python benchmarks/decoding.py [--repeats 3] [--smoke]

- json_valid_fraction: 16 JSON-Schema extractions (batched), parsed and validated.
- constrained_tok_s_ratio: 8 concurrent JSON-Schema generations vs the same 8 prompts
  unconstrained (same max_tokens, stops ignored), tokens/s; mask_ms_per_step: the time
  spent building the constraint masks per step that had constrained rows.
- spec_speedup: prompt-lookup speculation vs plain greedy, tokens/s, on a task that copies
  a ~300-token text with a small edit; spec_identical: the two outputs are equal.
- select_cost_ratio: select among 4 options vs scoring 1 (wall time, same context).

``--smoke`` runs each part on 2 people, 8 tokens and one sentence to copy. The last line is
one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import anyio
import jsonschema
from common import emit, parse_args, table

from pie_ctx import Context, Runtime, Sampler, gather
from pie_ctx.constrain import JsonSchema

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 30},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "city": {"type": "string", "maxLength": 30},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 20},
                   "maxItems": 3},
    },
    "required": ["name", "age", "city", "skills"],
    "additionalProperties": False,
}
PEOPLE = ["Ada Lovelace, 36, London, maths and poetry", "Linus, 54, Portland, kernels",
          "Grace Hopper, 85, Arlington, compilers", "Alan Turing, 41, Wilmslow, codebreaking",
          "Marie Curie, 66, Paris, chemistry", "Tim, 69, Geneva, the web",
          "Hedy Lamarr, 85, Vienna, film and radio", "Katherine Johnson, 101, Hampton, orbits",
          "Edsger, 72, Nuenen, algorithms", "Barbara Liskov, 84, Boston, data abstraction",
          "Donald Knuth, 86, Stanford, typesetting", "Margaret Hamilton, 88, Boston, Apollo",
          "Dennis, 70, Murray Hill, C", "Frances Allen, 88, New York, optimisation",
          "John McCarthy, 84, Stanford, Lisp", "Radia Perlman, 72, Seattle, spanning trees"]
EDIT_TEXT = (
    "Paged attention stores the key and value vectors of every token in fixed-size pages, "
    "so contexts that share a prefix can share the pages that hold it. A fork of a context "
    "costs a few counters, not a copy of its cache. Snapshots keep a context's pages under "
    "a name, and opening one later costs no prefill at all. The scheduler batches the "
    "forward passes of every live context into one model call per step, within a token "
    "budget, so long prompts are chunked and never starve the decoding contexts. Under "
    "memory pressure, cached pages nobody holds are evicted first, least recently used "
    "first, and only then does a request wait for pages. ") * 2


def _prompt(rt, text: str) -> Context:
    return Context(rt).system("Reply with JSON only.").user(f"Extract the person: {text}")


async def json_validity(rt, people: list[str], max_tokens: int) -> float:
    gens = [_prompt(rt, p).generate(Sampler.greedy(), max_tokens=max_tokens,
                                    constrain=JsonSchema(SCHEMA)) for p in people]
    valid = 0
    for text in await gather(*(g.text() for g in gens)):
        try:
            jsonschema.validate(json.loads(text), SCHEMA)
            valid += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    return valid / len(people)


async def throughput(rt, people: list[str], max_tokens: int,
                     lengths: list[int] | None) -> tuple[float, list[int]]:
    """Concurrent generations, tokens/s: constrained (``lengths`` None), or unconstrained
    with each generation as long as its constrained twin (the same batch at every step)."""
    prompts = [_prompt(rt, p) for p in people]
    for ctx in prompts:
        await ctx.cue().flush()
    t0 = time.perf_counter()
    if lengths is None:
        gens = [c.generate(Sampler.greedy(), max_tokens=max_tokens, constrain=JsonSchema(SCHEMA))
                for c in prompts]
    else:
        gens = [c.generate(Sampler.greedy(), max_tokens=n, ignore_eos=True)
                for c, n in zip(prompts, lengths, strict=True)]
    outs = await gather(*(g.tokens() for g in gens))
    wall = time.perf_counter() - t0
    for ctx in prompts:
        await ctx.release()
    return sum(len(o) for o in outs) / wall, [len(o) for o in outs]


async def speculation(rt, text: str) -> tuple[float, float, bool]:
    task = f"Repeat this text, replacing 'pages' with 'blocks':\n\n{text}"
    n = len(rt.tokenizer.encode(text))
    results = {}
    for mode in ("plain", "spec"):
        ctx = Context(rt).user(task)
        await ctx.cue().flush()
        kw = dict(speculator="prompt_lookup") if mode == "spec" else {}
        t0 = time.perf_counter()
        toks = await ctx.generate(Sampler.greedy(), max_tokens=n, **kw).tokens()
        results[mode] = (len(toks) / (time.perf_counter() - t0), toks)
        await ctx.release()
    return results["spec"][0], results["plain"][0], results["spec"][1] == results["plain"][1]


async def select_cost(rt) -> float:
    ctx = Context(rt).user(f"Which word best describes this text?\n\n{EDIT_TEXT}").cue()
    await ctx.flush()
    options = [" technical", " poetic", " informal", " humorous"]
    walls = {}
    for name, opts in (("one", options[:1]), ("four", options)):
        await ctx.select(opts)  # warm
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            await ctx.select(opts)
            times.append(time.perf_counter() - t0)
        walls[name] = statistics.median(times)
    await ctx.release()
    return walls["four"] / walls["one"]


async def main_async(args: argparse.Namespace) -> dict:
    people = PEOPLE[:2] if args.smoke else PEOPLE
    json_tokens, tput_tokens = (8, 8) if args.smoke else (200, 64)
    text = EDIT_TEXT.split(". ")[0] + "." if args.smoke else EDIT_TEXT
    async with Runtime.local(None, num_pages=4096) as rt:
        engine = rt.transport.engine
        await _prompt(rt, "warm up").generate(Sampler.greedy(), max_tokens=4,
                                              constrain=JsonSchema(SCHEMA)).text()
        valid = await json_validity(rt, people, json_tokens)
        ratios, masks = [], []
        for _ in range(args.repeats):
            ex = engine.executor
            t, s = ex.mask_seconds, ex.num_masked_steps
            constrained, lengths = await throughput(rt, people[:8], tput_tokens, None)
            masks.append((ex.mask_seconds - t) / max(ex.num_masked_steps - s, 1) * 1e3)
            plain, _ = await throughput(rt, people[:8], tput_tokens, lengths)
            ratios.append(constrained / plain)
        specs = [await speculation(rt, text) for _ in range(args.repeats)]
        select_ratio = await select_cost(rt)
    speedups = [s / p for s, p, _ in specs]
    table([
        ("json valid fraction", f"{valid:.3f} ({len(people)} generations)"),
        ("constrained / plain tok/s", f"{statistics.median(ratios):.3f} "
                                       f"({min(ratios):.3f}-{max(ratios):.3f})"),
        (f"mask ms per step ({len(people[:8])} rows)", f"{statistics.median(masks):.2f}"),
        ("speculation speedup", f"{statistics.median(speedups):.2f}x "
                                f"({min(speedups):.2f}-{max(speedups):.2f}), "
                                f"{statistics.median([s for s, _, _ in specs]):.1f} vs "
                                f"{statistics.median([p for _, p, _ in specs]):.1f} tok/s"),
        ("speculation identical", str(all(i for _, _, i in specs))),
        ("select 4 / select 1", f"{select_ratio:.2f}"),
    ])
    return {"json_valid_fraction": valid, "constrained_tok_s_ratio": statistics.median(ratios),
            "mask_ms_per_step": statistics.median(masks),
            "spec_speedup": statistics.median(speedups),
            "spec_identical": all(i for _, _, i in specs), "select_cost_ratio": select_ratio,
            "repeats": args.repeats}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parse_args(parser, repeats=1)
    emit(anyio.run(main_async, args))


if __name__ == "__main__":
    main()
