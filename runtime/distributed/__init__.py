"""Tensor parallelism over ``torch.distributed``: pages sharded by KV head.

Owner: the ranks of one engine. Rank 0 is the engine process: it keeps the scheduler, the
page store, the trie and the server, and it is the only rank that decides anything. Ranks
1..N-1 (spawned here, or started by ``torchrun``) hold their Megatron shard of the weights
and their KV heads' slice of every page; per step they receive one broadcast of the batch
and take part in the collectives the math needs. See docs/scale-out.md.

Parts: ``shard`` (which rows and columns a rank holds, the KV-head rule), ``group`` (the
per-step broadcast and the collectives), ``pool`` (rank 0's sharded page pool), ``runner``
(a rank's model runner), ``launch`` (starting ranks, a worker's loop), ``boot`` (rank 0's
part of ``boot_engine(tp=N)``).
"""

from __future__ import annotations

__all__: list[str] = []
