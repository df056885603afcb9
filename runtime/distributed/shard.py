"""Megatron-style shards of a checkpoint, and the KV-head rule that decides which N work.

Owner: nothing at run time; these are pure functions of a config and HF-named weights.

Rank ``r`` of ``N`` holds (H q heads, KVH kv heads, D head dim, I intermediate, V vocab):

* q/k/v **column-parallel by heads**: q heads ``[r*H/N, (r+1)*H/N)`` and kv heads
  ``[r*KVH/N, (r+1)*KVH/N)``. Contiguous blocks keep GQA groups whole: q head ``i`` reads kv
  head ``i // (H/KVH)``, which lands on the same rank;
* gate/up column-parallel (rows ``[r*I/N, (r+1)*I/N)``), o and down **row-parallel** (the
  matching input columns); their outputs are partial sums, all-reduced by the runner. An
  o_proj bias is kept on rank 0 only, so the sum adds it once;
* the lm_head **vocab-parallel**: rows ``[r*Vs, (r+1)*Vs)`` with ``Vs = ceil(V/N)`` (the last
  shard zero-padded), gathered on rank 0;
* the embedding, the norms and q/k norms replicated.

The rule (docs/scale-out.md): N must divide H, KVH and I. KV heads are not replicated:
a model with fewer KV heads than N (Llama-70B at N=16) is refused, as is one whose head
counts do not divide (SmolLM2-135M, 9 q and 3 kv heads, at N=2).
"""

from __future__ import annotations

import dataclasses
from math import gcd

import torch

from pie_ctx.proto.errors import InvalidArgument
from runtime.model.config import ModelConfig

__all__ = ["check_tensor_parallel", "shard_config", "shard_weights", "vocab_shard_rows",
           "valid_sizes"]


def valid_sizes(config: ModelConfig) -> list[int]:
    """Every tensor-parallel size this model can be split into (1 included)."""
    g = gcd(gcd(config.num_heads, config.num_kv_heads), config.intermediate_size)
    return [n for n in range(1, g + 1) if g % n == 0]


def check_tensor_parallel(config: ModelConfig, tp: int, model_name: str) -> None:
    """Refuse a size this model cannot be split into.

    Raises:
        InvalidArgument: ``tp`` is not a positive int, or it does not divide the model's
            q heads, kv heads and intermediate size (the message names the sizes that do).
    """
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise InvalidArgument(f"tensor_parallel must be a positive int, got {tp!r}")
    c = config
    if c.num_heads % tp or c.num_kv_heads % tp or c.intermediate_size % tp:
        sizes = ", ".join(map(str, valid_sizes(c)))
        raise InvalidArgument(
            f"{model_name} cannot be split over {tp} ranks: it has {c.num_heads} query heads, "
            f"{c.num_kv_heads} KV heads and an intermediate size of {c.intermediate_size}, "
            f"and pie-ctx shards whole heads (KV heads are not replicated; see "
            f"docs/scale-out.md). Use --tensor-parallel {sizes}")


def shard_config(config: ModelConfig, tp: int) -> ModelConfig:
    """The config one rank's layers see: H/N q heads, KVH/N kv heads, I/N intermediate."""
    return dataclasses.replace(config, num_heads=config.num_heads // tp,
                               num_kv_heads=config.num_kv_heads // tp,
                               intermediate_size=config.intermediate_size // tp)


def vocab_shard_rows(vocab_size: int, tp: int) -> int:
    """Rows of the lm_head each rank holds (the last shard is zero-padded)."""
    return -(-vocab_size // tp)


def shard_weights(config: ModelConfig, weights: dict[str, torch.Tensor], rank: int,
                  tp: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Rank ``rank``'s layer weights (HF names, sharded shapes) and its lm_head rows.

    The returned dict keeps the full embedding and, for an untied head, the full
    ``lm_head.weight`` (the Transformer checks its shape); the runner swaps in the
    returned ``Tensor[ceil(V/N), hidden]`` head shard.
    """
    c = config
    d = c.head_dim
    q_rows = c.num_heads // tp * d
    kv_rows = c.num_kv_heads // tp * d
    inter = c.intermediate_size // tp

    def rows(t: torch.Tensor, n: int) -> torch.Tensor:
        return t[rank * n: (rank + 1) * n].contiguous()

    def cols(t: torch.Tensor, n: int) -> torch.Tensor:
        return t[:, rank * n: (rank + 1) * n].contiguous()

    out: dict[str, torch.Tensor] = {}
    for name, t in weights.items():
        if not name.startswith("model.layers."):
            out[name] = t
            continue
        kind = name.split(".", 3)[3]  # e.g. self_attn.q_proj.weight
        if kind in ("self_attn.q_proj.weight", "self_attn.q_proj.bias"):
            out[name] = rows(t, q_rows)
        elif kind in ("self_attn.k_proj.weight", "self_attn.k_proj.bias",
                      "self_attn.v_proj.weight", "self_attn.v_proj.bias"):
            out[name] = rows(t, kv_rows)
        elif kind == "self_attn.o_proj.weight":
            out[name] = cols(t, q_rows)
        elif kind == "self_attn.o_proj.bias":
            if rank == 0:  # the all-reduce sums the ranks' outputs: add the bias once
                out[name] = t
        elif kind in ("mlp.gate_proj.weight", "mlp.up_proj.weight"):
            out[name] = rows(t, inter)
        elif kind == "mlp.down_proj.weight":
            out[name] = cols(t, inter)
        else:  # norms (input, post-attention, q/k)
            out[name] = t
    head = weights.get("lm_head.weight")
    if head is None or c.tie_word_embeddings:
        head = weights["model.embed_tokens.weight"]
    vs = vocab_shard_rows(c.vocab_size, tp)
    shard = head[rank * vs: (rank + 1) * vs]
    if shard.shape[0] < vs:
        pad = shard.new_zeros((vs - shard.shape[0], shard.shape[1]))
        shard = torch.cat([shard, pad])
    return out, shard.contiguous()
