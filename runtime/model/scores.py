"""Attention scores: the softmax weights some query rows gave each KV entry, per layer.

Owns the second, exact pass that answers ``ScoreQuery``s (``runtime.model.batch``). Neither
SDPA nor pie-ctx's paged kernel returns its weights, and making them do so would slow
every row; so after a layer's attention has run (and written the layer's new K/V into the
pool), ``Scoring.collect`` recomputes the weights of the rows that asked, and only those:
the same rotated queries, the same keys read back from the same pages (dequantized like
the pass's), the same scale, the same mask (causal in KV order, or the pass's own), one
fp32 softmax. The weights are the pass's, to rounding (tests/model/test_scores.py holds
them to the dense reference's at 1e-5 in fp32).

Cost per asking sequence and layer: one read of its keys (what a decode's attention reads
anyway) and an ``[R, H, kv_len]`` matmul and softmax; rows that do not ask pay nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.kv.layout import decode
from runtime.model.attention.base import AttentionMetadata
from runtime.model.batch import ScoreQuery, SeqInput

__all__ = ["Scoring"]


@dataclass(slots=True)
class _Seq:
    start: int  # its first row in the flat batch
    pages: torch.Tensor  # [n_pages] int64: the pages holding its kv_len entries
    kv_len: int
    visible: torch.Tensor  # [R_all, kv_len] bool: what each asked row attends
    rows: torch.Tensor  # [R_all] int64 flat rows of every asked row (union of queries)
    queries: list[tuple[ScoreQuery, torch.Tensor]]  # each query's positions in ``rows``


class Scoring:
    """The score queries of one forward; ``collect`` runs after each layer's attention."""

    def __init__(self, batch: list[SeqInput], meta: AttentionMetadata) -> None:
        self._seqs: list[_Seq] = []
        self._layers: set[int] = set()
        device = meta.write_pages.device
        ps = meta.page_size
        start = 0
        for i, seq in enumerate(batch):
            if seq.scores:
                kv_len = meta.kv_lens[i]
                asked = sorted({r for q in seq.scores for r in q.rows})
                where = {r: j for j, r in enumerate(asked)}
                if meta.masks[i] is not None:
                    visible = meta.masks[i][asked].to(device)  # [R, kv_len]
                else:
                    limit = torch.tensor([meta.num_cached[i] + r for r in asked], device=device)
                    visible = torch.arange(kv_len, device=device)[None, :] <= limit[:, None]
                queries = []
                for q in seq.scores:
                    q.out = None
                    queries.append((q, torch.tensor([where[r] for r in q.rows], device=device)))
                    self._layers.update(q.layers)
                pages = torch.tensor(meta.page_tables[i][: -(-kv_len // ps)], dtype=torch.int64,
                                     device=device)
                rows = torch.tensor([start + r for r in asked], dtype=torch.int64, device=device)
                self._seqs.append(_Seq(start, pages, kv_len, visible, rows, queries))
            start += len(seq.tokens)

    def collect(self, layer: int, q: torch.Tensor, pool_kv: torch.Tensor) -> None:
        """Add this layer's weights to every query that reads it.

        Args:
            layer: the layer whose attention just ran (its K/V are in the pool).
            q: Tensor[T, H, D] the layer's rotated queries (flat batch).
            pool_kv: the pool.
        """
        if layer not in self._layers:
            return
        h, d = q.shape[1], q.shape[2]
        for s in self._seqs:
            k = decode(pool_kv[:, :, layer, 0].index_select(0, s.pages), q.dtype).float()
            kvh = k.shape[-2]
            k = k.reshape(-1, kvh, d)[: s.kv_len]  # [kv_len, KVH, D]
            qr = q.index_select(0, s.rows).float().view(-1, kvh, h // kvh, d)  # [R, KVH, G, D]
            # query head j reads KV head j // G (GQA), with no copy of the keys per head
            logits = torch.einsum("rngd,knd->rngk", qr, k).reshape(qr.shape[0], h, -1)
            logits *= d ** -0.5  # [R, H, kv_len]
            logits.masked_fill_(~s.visible[:, None, :], float("-inf"))
            weights = torch.softmax(logits, dim=-1)  # [R, H, kv_len]
            for query, picks in s.queries:
                if layer not in query.layers:
                    continue
                w = weights.index_select(0, picks)  # [r, H, kv_len]
                if query.heads == "mean":
                    w = w.mean(dim=1)  # [r, kv_len]
                w = w.sum(dim=0) if query.reduce == "sum" else w.amax(dim=0)
                w = w.cpu()
                if query.by_layer:
                    if query.out is None:
                        query.out = w.new_zeros((len(query.layers), *w.shape))
                    query.out[query.layers.index(layer)] = w
                elif query.out is None:
                    query.out = w
                elif query.reduce == "sum":
                    query.out += w
                else:
                    torch.maximum(query.out, w, out=query.out)
