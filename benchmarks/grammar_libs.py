"""llguidance vs xgrammar on the default model's vocabulary: the measurement behind the choice.

    pip install xgrammar            # llguidance is a dependency already
    python benchmarks/grammar_libs.py [--smoke]

For each library: the time to prepare the tokenizer, to compile a JSON Schema, a regex and
a small grammar, and the time to compute one token mask, replaying valid outputs token by
token (the model is not run: this isolates the mask cost). Also checks that every replayed
token was allowed (``--smoke``: each output replayed once). Without xgrammar its row is
skipped (said in the table). The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from common import emit, parse_args, table

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.[a-z]{2,3}$"},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]},
                 "maxItems": 4},
        "address": {"type": "object", "properties": {
            "city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"]},
    },
    "required": ["name", "age", "email", "address"],
}
JSON_OUTPUTS = [
    {"name": "Ada Lovelace", "age": 36, "email": "ada@math.org", "tags": ["a", "c"],
     "address": {"city": "London", "zip": "12345"}},
    {"name": "Alan", "age": 41, "email": "alan@bletchley.uk",
     "address": {"city": "Wilmslow", "zip": "54321"}},
]
REGEX = r"[0-9]{3}-[0-9]{4}"
REGEX_OUTPUTS = ["555-1234", "123-4567"]


def _mask_times(step: Any, tokens: list[list[int]]) -> tuple[list[float], bool]:
    times, ok = [], True
    for seq in tokens:
        ok &= step(seq, times)
    return times, ok


def run_llguidance(tok: Any, vocab: int, stops: list[int]) -> dict[str, Any]:
    import llguidance
    import llguidance.numpy
    import numpy as np

    t0 = time.perf_counter()
    lltok = llguidance.LLTokenizer(tok.backend.to_str(), n_vocab=vocab, eos_token=stops)
    init = time.perf_counter() - t0

    def compile_(grammar: str) -> tuple[Any, float]:
        t = time.perf_counter()
        m = llguidance.LLMatcher(lltok, grammar)
        m.compute_bitmask()  # the first mask finishes any lazy work
        if m.is_error():
            raise RuntimeError(m.get_error())
        m.reset()
        return m, time.perf_counter() - t

    json_m, json_compile = compile_(llguidance.LLMatcher.grammar_from_json_schema(SCHEMA))
    re_m, re_compile = compile_(llguidance.LLMatcher.grammar_from_regex(REGEX))
    bitmask = llguidance.numpy.allocate_token_bitmask(1, vocab)

    def step_with(template: Any) -> Any:
        def step(seq: list[int], times: list[float]) -> bool:
            m = template.deep_copy()
            ok = True
            for t in seq:
                a = time.perf_counter()
                llguidance.numpy.fill_next_token_bitmask(m, bitmask, 0)
                times.append(time.perf_counter() - a)
                ok &= bool((bitmask[0, t // 32] >> (t % 32)) & 1)
                ok &= m.consume_token(t)
            return ok
        return step

    return {"init": init, "json_compile": json_compile, "regex_compile": re_compile,
            "step_json": step_with(json_m), "step_regex": step_with(re_m), "np": np}


def run_xgrammar(tok: Any, vocab: int, stops: list[int]) -> dict[str, Any]:
    import torch
    import transformers
    import xgrammar as xgr

    t0 = time.perf_counter()
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok.backend)
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=stops)
    compiler = xgr.GrammarCompiler(info)
    init = time.perf_counter() - t0
    t = time.perf_counter()
    json_g = compiler.compile_json_schema(json.dumps(SCHEMA))
    json_compile = time.perf_counter() - t
    t = time.perf_counter()
    re_g = compiler.compile_regex(REGEX)
    re_compile = time.perf_counter() - t
    bitmask = xgr.allocate_token_bitmask(1, vocab)

    def step_with(compiled: Any) -> Any:
        def step(seq: list[int], times: list[float]) -> bool:
            m = xgr.GrammarMatcher(compiled)
            ok = True
            for tkn in seq:
                a = time.perf_counter()
                m.fill_next_token_bitmask(bitmask)
                times.append(time.perf_counter() - a)
                ok &= bool((int(bitmask[0, tkn // 32]) >> (tkn % 32)) & 1)
                ok &= m.accept_token(tkn)
            return ok
        return step

    del torch
    return {"init": init, "json_compile": json_compile, "regex_compile": re_compile,
            "step_json": step_with(json_g), "step_regex": step_with(re_g)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replays", type=int, default=5,
                    help="times each JSON output is replayed (regex outputs: 4x that)")
    args = parse_args(ap, replays=1)

    from runtime.model.loader import load_model

    loaded = load_model(None, progress=False)
    tok, vocab = loaded.tokenizer, loaded.config.vocab_size
    stops = list(tok.stop_token_ids)
    json_tokens = [tok.encode(json.dumps(o)) for o in JSON_OUTPUTS]
    regex_tokens = [tok.encode(s) for s in REGEX_OUTPUTS]
    results: dict[str, Any] = {}
    rows = []
    for name, run in (("llguidance", run_llguidance), ("xgrammar", run_xgrammar)):
        try:
            r = run(tok, vocab, stops)
        except ImportError as err:
            rows.append((name, f"skipped: {err.name} is not installed (pip install {name})"))
            continue
        jt, jok = _mask_times(r["step_json"], json_tokens * args.replays)
        rt, rok = _mask_times(r["step_regex"], regex_tokens * 4 * args.replays)
        res = {"init_ms": r["init"] * 1e3, "json_compile_ms": r["json_compile"] * 1e3,
               "regex_compile_ms": r["regex_compile"] * 1e3,
               "json_mask_us_median": statistics.median(jt) * 1e6,
               "json_mask_us_p99": sorted(jt)[int(0.99 * len(jt))] * 1e6,
               "regex_mask_us_median": statistics.median(rt) * 1e6, "all_allowed": jok and rok}
        results[name] = res
        rows.append((name, ", ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}"
                                     for k, v in res.items())))
    table(rows)
    emit({f"{lib}_{k}": v for lib, res in results.items() for k, v in res.items()})


if __name__ == "__main__":
    main()
