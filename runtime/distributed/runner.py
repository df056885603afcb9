"""One rank's model runner: its Megatron shard of the weights over its KV heads' pool.

Owner: each rank's :class:`ShardedRunner` owns its shard (``runtime.distributed.shard``)
and runs the same layer code as ``ModelRunner`` with two additions: an all-reduce after
each row-parallel projection (``Transformer.reduce``) and a vocab-parallel lm_head
gathered on rank 0 (:class:`VocabParallelHead`). Rank 0's runner also broadcasts the
batch first, so the engine calls it exactly like a single-device runner; the workers call
:meth:`ShardedRunner.forward_shard` with the batch they received.

Every rank validates the batch alike before any collective (the checks are the same pure
function of the batch), so a batch rank 0 rejects is rejected everywhere and leaves the
ranks in step.
"""

from __future__ import annotations

from typing import Any

import torch

from pie_ctx.proto.errors import InvalidArgument
from runtime.distributed.group import RankGroup, _Collectives
from runtime.distributed.shard import shard_config, shard_weights
from runtime.model.batch import SeqInput
from runtime.model.config import ModelConfig
from runtime.model.matmul import Projection
from runtime.model.model import Transformer
from runtime.model.runner import ModelRunner

__all__ = ["ShardedRunner", "VocabParallelHead"]


class VocabParallelHead:
    """The lm_head over this rank's vocab rows; rank 0 gathers the full logits.

    Returns ``Tensor[N, vocab]`` on rank 0 and this rank's ``Tensor[N, ceil(V/N)]``
    elsewhere (the workers' logits are not used).
    """

    def __init__(self, proj: Projection, vocab_size: int, comm: _Collectives) -> None:
        self.proj = proj  # ``Transformer.projections`` finds it here
        self.vocab_size = vocab_size
        self.comm = comm

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        local = self.proj(x).contiguous()  # [N, ceil(V/N)]
        if self.comm.rank != 0:
            self.comm.gather(local, None)
            return local
        parts = [torch.empty_like(local) for _ in range(self.comm.world)]
        self.comm.gather(local, parts)
        return torch.cat(parts, dim=1)[:, : self.vocab_size]  # [N, V]


class ShardedRunner(ModelRunner):
    """A ``ModelRunner`` over rank ``comm.rank``'s shard (see the module docstring).

    Args:
        config: the whole model's config.
        weights: the whole model's HF-named tensors (sharded here).
        pool_kv: this rank's pool tensor, ``num_kv_heads / N`` heads wide.
        page_size: tokens per page.
        comm: the rank's collectives (rank 0: its ``RankGroup``).
        dtype: the compute dtype.

    Raises:
        InvalidArgument: as ``ModelRunner`` (the pool must have this rank's heads).
    """

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor],
                 pool_kv: torch.Tensor, page_size: int, comm: _Collectives, *,
                 dtype: torch.dtype | None = None) -> None:
        tp = comm.world
        local, head = shard_weights(config, weights, comm.rank, tp)
        # read by _final_head, which the base class calls before it chooses the kernels
        self.full_config = config
        self.comm = comm
        self._head_rows: torch.Tensor | None = head
        super().__init__(shard_config(config, tp), local, pool_kv, page_size, dtype=dtype)
        self.score_layers = 0  # rank 0 holds a share of the heads: no attention scores
        self.model.reduce = comm.all_reduce

    def _final_head(self, model: Transformer) -> None:
        """This rank's vocab rows of the lm_head (:class:`VocabParallelHead`), in place of
        the full one the model was built with, before any kernel is chosen."""
        head, self._head_rows = self._head_rows, None
        if head is None:
            raise RuntimeError("the vocab-parallel lm_head is put in place once, at load")
        proj = Projection(head.to(device=model.device, dtype=model.dtype), pack=model.packed,
                          buckets=2)
        model.lm_head = VocabParallelHead(proj, self.full_config.vocab_size, self.comm)

    def forward(self, batch: list[SeqInput], *,
                return_hidden: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Rank 0: broadcast the batch, then run its shard of it (see ``ModelRunner``).

        Raises:
            InvalidArgument: a malformed batch (every rank rejects it; nothing is written).
            RunnerLost: a rank died, hung or failed; the engine cannot step any more.
        """
        group = self.comm
        if not isinstance(group, RankGroup):
            raise RuntimeError("only rank 0 takes batches from the engine")
        with group.command("step", (batch, return_hidden)):
            out = self.forward_shard(batch, return_hidden=return_hidden)
        group.num_steps += 1
        return out

    def forward_shard(self, batch: list[SeqInput], *,
                      return_hidden: bool = False) -> Any:
        """This rank's share of one step (every rank calls it with the same batch)."""
        return super().forward(batch, return_hidden=return_hidden)

    def close(self) -> None:
        """Rank 0: stop the workers (the engine is stopping)."""
        if isinstance(self.comm, RankGroup):
            self.comm.close()

    def load_adapter(self, name: str, path: str, model_name: str = "") -> Any:
        raise InvalidArgument("LoRA adapters are not supported with tensor parallelism yet; "
                              "boot without --tensor-parallel to use them")
