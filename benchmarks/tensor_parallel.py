"""What tensor parallelism costs per step: TP=2 against TP=1, side by side, on CPU (gloo).

    python benchmarks/tensor_parallel.py [--batch 8] [--steps 30] [--prompt 64] [--smoke]

On 2 CPU cores TP cannot be faster: both ranks share the cores. What this measures is the
price of being split: per decode step, rank 0's time in the one broadcast of the batch and
in the collectives (an all-reduce after o_proj and after down in every layer, the
lm_head's gather), as a fraction of the step, and the bytes each moves (which decide what
a GPU run would show, docs/scale-out.md). The model is SmolLM2-135M's shape (30 layers,
hidden 576, intermediate 1536, vocab 49152) with 8 q heads and 4 KV heads instead of 9/3 so
that 2 ranks can split it, and random weights (the default model's tokenizer files).

The last line is a JSON object: ``tp_overhead_fraction`` (rank 0's collective seconds over
its step seconds at TP=2), ``tp_logits_max_abs_diff`` (TP=2 vs TP=1 logits over every step
measured), the step times, the broadcast's share and the bytes per step.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from common import emit, parse_args, table

SHAPE = {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
         "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 72,
         "vocab_size": 49152}
SMOKE_SHAPE = SHAPE | {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                       "head_dim": 8}


def write_model(root: Path, shape: dict) -> Path:
    """A random Llama of ``shape`` (trained-like scales) with the default model's tokenizer."""
    from safetensors.torch import save_file

    from runtime.model.loader import resolve_model

    _, default = resolve_model(None, progress=False)
    folder = root / "tp-bench-llama"
    folder.mkdir()
    for f in default.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "generation_config")):
            shutil.copy(f, folder / f.name)
    h, inter, d = shape["hidden_size"], shape["intermediate_size"], shape["head_dim"]
    q, kv = shape["num_attention_heads"] * d, shape["num_key_value_heads"] * d
    gen = torch.Generator().manual_seed(0)

    def r(*s: int) -> torch.Tensor:
        return torch.randn(*s, generator=gen) * (s[-1] ** -0.5 if len(s) == 2 else 1.0)

    w = {"model.embed_tokens.weight": r(shape["vocab_size"], h) * h**0.5,
         "model.norm.weight": torch.ones(h)}
    for i in range(shape["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w |= {p + "input_layernorm.weight": torch.ones(h),
              p + "post_attention_layernorm.weight": torch.ones(h),
              p + "self_attn.q_proj.weight": r(q, h), p + "self_attn.k_proj.weight": r(kv, h),
              p + "self_attn.v_proj.weight": r(kv, h), p + "self_attn.o_proj.weight": r(h, q),
              p + "mlp.gate_proj.weight": r(inter, h), p + "mlp.up_proj.weight": r(inter, h),
              p + "mlp.down_proj.weight": r(h, inter)}
    save_file(w, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
              "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "max_position_embeddings": 8192,
              "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2} | shape
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def run(folder: Path, tp: int, batch: int, prompt: int, steps: int) -> dict:
    """Prefill ``batch`` contexts, then time ``steps`` decode steps of all of them."""
    from runtime.boot import boot_engine
    from runtime.model.batch import SeqInput

    page = 16
    per_seq = -(-(prompt + steps) // page)
    engine = boot_engine(str(folder), page_size=page, num_pages=batch * per_seq + 1,
                         progress=False, tp=tp)
    runner = engine.executor.runner
    tables = [list(range(b * per_seq, (b + 1) * per_seq)) for b in range(batch)]
    logits, times = [], []
    try:
        runner.forward([SeqInput(tokens=[(7 * b + j) % 1000 + 10 for j in range(prompt)],
                                 positions=list(range(prompt)), page_table=tables[b],
                                 num_cached=0, logit_indices=[prompt - 1])
                        for b in range(batch)])
        stats = getattr(runner, "comm", None)
        before = None if stats is None else json.loads(json.dumps(
            {"s": stats.stats.seconds, "b": stats.stats.nbytes}))
        for s in range(steps):
            pos = prompt + s
            seqs = [SeqInput(tokens=[(11 * b + s) % 1000 + 10], positions=[pos],
                             page_table=tables[b], num_cached=pos, logit_indices=[0])
                    for b in range(batch)]
            t0 = time.perf_counter()
            out = runner.forward(seqs)
            times.append(time.perf_counter() - t0)
            logits.append(out)
        result = {"step_s": statistics.median(times), "logits": torch.cat(logits)}
        if stats is not None:
            after = stats.stats
            comm = {k: after.seconds[k] - before["s"].get(k, 0.0) for k in after.seconds}
            nbytes = {k: after.nbytes[k] - before["b"].get(k, 0) for k in after.nbytes}
            result["comm_s"] = {k: v / steps for k, v in comm.items()}
            result["bytes"] = {k: v // steps for k, v in nbytes.items()}
            result["mean_step_s"] = sum(times) / steps
    finally:
        close = getattr(runner, "close", None)
        if close is not None:
            close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=8, help="contexts decoding together")
    parser.add_argument("--steps", type=int, default=30, help="decode steps timed")
    parser.add_argument("--prompt", type=int, default=64, help="tokens prefilled per context")
    parser.add_argument("--small", action="store_true", help="a 2-layer model (smoke)")
    args = parse_args(parser, steps=3, prompt=8, batch=2, small=True)
    shape = SMOKE_SHAPE if args.small else SHAPE
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_model(Path(tmp), shape)
        one = run(folder, 1, args.batch, args.prompt, args.steps)  # first: TP=2 sets threads
        two = run(folder, 2, args.batch, args.prompt, args.steps)
    comm = two["comm_s"]
    collective = sum(comm.values())
    overhead = collective / two["mean_step_s"]
    diff = float((one["logits"] - two["logits"]).abs().max())
    layers = shape["num_hidden_layers"]
    table([
        ("model", f"{layers} layers, hidden {shape['hidden_size']}, 8 q / 4 KV heads, "
                  f"batch {args.batch} decoding"),
        ("TP=1 step", f"{one['step_s'] * 1e3:.2f} ms"),
        ("TP=2 step (rank 0)", f"{two['step_s'] * 1e3:.2f} ms"),
        ("broadcast / step", f"{comm.get('broadcast', 0) * 1e3:.3f} ms, "
                             f"{two['bytes'].get('broadcast', 0)} B"),
        ("all-reduces / step", f"{comm.get('all_reduce', 0) * 1e3:.3f} ms, "
                               f"{two['bytes'].get('all_reduce', 0)} B in {2 * layers} calls"),
        ("lm_head gather / step", f"{comm.get('gather', 0) * 1e3:.3f} ms, "
                                  f"{two['bytes'].get('gather', 0)} B"),
        ("collectives / step", f"{overhead:.1%} of rank 0's step"),
        ("max |logit diff|", f"{diff:.3g}"),
    ])
    emit({"tp_overhead_fraction": overhead, "tp_logits_max_abs_diff": diff,
          "broadcast_fraction": comm.get("broadcast", 0.0) / two["mean_step_s"],
          "tp1_step_ms": one["step_s"] * 1e3, "tp2_step_ms": two["step_s"] * 1e3,
          "tp2_over_tp1": two["step_s"] / one["step_s"],
          "broadcast_bytes_per_step": two["bytes"].get("broadcast", 0),
          "all_reduce_bytes_per_step": two["bytes"].get("all_reduce", 0),
          "gather_bytes_per_step": two["bytes"].get("gather", 0)})


if __name__ == "__main__":
    main()
