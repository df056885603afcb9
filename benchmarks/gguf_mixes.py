"""The GGUF mixes people download, made from the default model by llama.cpp's own quantizer,
run with default options beside llama.cpp on the same file.

Run: ``.venv/bin/python benchmarks/gguf_mixes.py [--mixes Q4_K_M,Q5_K_M,Q6_K,...]
[--tokens 32] [--work-dir DIR] [--smoke]``.

For each mix, ``llama_cpp.llama_model_quantize`` re-quantizes the default model's GGUF
(SmolLM2-135M-Instruct, Q4_1; ``allow_requantize``) into the mix once (kept in
``--work-dir``). Then, on that one file:

* pie-ctx boots as ``pie-ctx run`` / ``serve`` do by default (``weights="auto"``,
  ``kv_dtype="auto"``) and says which formats it computes as stored and which it
  dequantized (the engine's ``weights`` and the tensor types of the file);
* for each of three chat prompts, both engines decode greedily ``--tokens`` tokens from
  the same token ids (pie-ctx's chat template and tokenizer; llama.cpp's vocabulary is the
  same file's), and the length of the leading run where the two agree is counted (a run
  that reaches the end of sequence together counts as whole).

Needs llama-cpp-python (``pip install llama-cpp-python==0.3.36``); ``--smoke`` without it
runs one mix made by the ``gguf`` package's own Q8_0 quantizer, pie-ctx only.

Last line, JSON: ``mix_<MIX>_runs`` (the three leading runs), ``mix_<MIX>_median_run``,
``mix_<MIX>_weights`` (the engine's weights: ``gguf`` when it runs on the file's blocks),
``mix_<MIX>_types`` (tensor type -> count), ``tokens``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import anyio
import gguf
from common import emit, parse_args, table
from scale_models import quantize

from pie_ctx import Context, Runtime, Sampler
from runtime.boot import boot_engine
from runtime.model.loader import gguf_source, resolve_model

PROMPTS = ("What is the capital of France? Answer in one sentence.",
           "Write a haiku about autumn leaves.",
           "Explain what a hash table is to a child.")
MIXES = ("Q4_K_M", "Q4_K_S", "Q5_K_M", "Q5_K_S", "Q6_K", "Q8_0", "Q4_0", "Q5_0", "Q5_1",
         "Q3_K_M", "IQ4_XS")


def gguf_q8_0(source: Path, path: Path) -> None:
    """Without llama.cpp: every 2-D tensor of ``source`` as the ``gguf`` package's Q8_0."""
    if path.is_file():
        return
    import numpy as np

    reader = gguf.GGUFReader(source)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(path), arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        value = field.contents()
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, value, vtype, sub_type=sub)
    for t in reader.tensors:
        values = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        if values.ndim == 2 and values.shape[-1] % 32 == 0:
            writer.add_tensor(t.name, gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q8_0),
                              raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(t.name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def ours(path: Path, prompts: list[list[int]], n: int) -> tuple[str, list[list[int]]]:
    """pie-ctx with the CLI's default options: its weights and each prompt's greedy tokens."""
    engine = boot_engine(str(path), weights="auto", kv_dtype="auto", progress=False)
    out: list[list[int]] = []

    async def run() -> None:
        async with engine, Runtime.local(engine=engine) as rt:
            for ids in prompts:
                ctx = Context(rt).append(ids)
                out.append(await ctx.generate(Sampler.greedy(), max_tokens=n).tokens())
                await ctx.release()

    anyio.run(run)
    return engine.info().weights, out


def theirs(lib: Any, path: Path, prompts: list[list[int]], n: int) -> list[list[int]]:
    """llama.cpp's greedy tokens on the same file (stopping at its end of sequence)."""
    llm = lib.Llama(str(path), n_ctx=512, n_threads=2, verbose=False)
    eos = llm.token_eos()
    out = []
    for ids in prompts:
        got: list[int] = []
        for token in llm.generate(ids, temp=0.0, top_k=1, reset=True):
            got.append(int(token))
            if len(got) == n or token == eos:
                break
        out.append(got)
    llm.close()
    return out


def leading_run(a: list[int], b: list[int], n: int) -> int:
    """Tokens the two agree on from the start; ``n`` when they agree to the end or stop
    together."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):  # (they may stop apart)
        if x != y:
            return i
    return n if len(a) == len(b) else min(len(a), len(b))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mixes", default="Q4_K_M,Q5_K_M,Q6_K",
                    help=f"comma-separated llama.cpp file types (e.g. {', '.join(MIXES)})")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--work-dir", default=str(Path(tempfile.gettempdir()) / "pie-ctx-mixes"))
    args = parse_args(ap, tokens=4)
    try:
        import llama_cpp as lib
    except ImportError:
        if not args.smoke:
            raise SystemExit("needs llama-cpp-python: pip install llama-cpp-python==0.3.36") from None
        lib = None
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    source = gguf_source(resolve_model(None)[1])
    if source is None:
        raise SystemExit("the default model's GGUF is not in the cache: run pie-ctx models pull")
    mixes = ["Q8_0"] if args.smoke and lib is None else (
        args.mixes.split(",")[:1] if args.smoke else args.mixes.split(","))

    from runtime.model.loader import load_model

    tokenizer = load_model(source, progress=False).tokenizer
    prompts = []
    for text in PROMPTS[:1] if args.smoke else PROMPTS:
        chat = tokenizer.render_chat([{"role": "user", "content": text}],
                                     add_generation_prompt=True)
        prompts.append(tokenizer.encode(chat) if isinstance(chat, str) else list(chat))

    result: dict[str, Any] = {"tokens": args.tokens}
    rows = []
    for mix in mixes:
        path = work / f"smol-{mix}.gguf"
        if lib is None:
            gguf_q8_0(source, path)
        else:
            if not path.is_file():
                quantize(lib, source, path, mix, threads=2, requantize=True)
        types = Counter(t.tensor_type.name for t in gguf.GGUFReader(path).tensors)
        # llama.cpp first: once the engine's model thread has run torch's OpenMP team,
        # ggml's parallel regions on another thread crash (the two share libgomp)
        want = None if lib is None else theirs(lib, path, prompts, args.tokens)
        weights, got = ours(path, prompts, args.tokens)
        result[f"mix_{mix}_weights"] = weights
        result[f"mix_{mix}_types"] = dict(sorted(types.items()))
        line = f"weights={weights}  types={dict(types)}"
        if want is not None:
            runs = [leading_run(a, b, args.tokens) for a, b in zip(got, want, strict=True)]
            result[f"mix_{mix}_runs"] = runs
            result[f"mix_{mix}_median_run"] = statistics.median(runs)
            line += f"  leading runs {runs} of {args.tokens}"
        rows.append((mix, line))
    table(rows)
    emit(result)


if __name__ == "__main__":
    main()
