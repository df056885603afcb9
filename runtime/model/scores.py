"""Attention scores: the softmax weights some query rows gave each KV entry, per layer.

Owns the second, exact pass that answers ``ScoreQuery``s (``runtime.model.batch``). Neither
SDPA nor pie-ctx's paged kernel returns its weights, and making them do so would slow
every row; so each layer's rotated queries of the rows that asked are kept
(``Scoring.collect``, one index per layer), and once the forward has written every
layer's K/V, ``Scoring.finish`` recomputes their weights, and only theirs, a group of
layers at a time: the same queries, the same keys read back from the same pages
(dequantized like the pass's), the same scale, the same mask (causal in KV order, or the
pass's own), one fp32 softmax. The weights are the pass's, to rounding (tests/model/test_scores.py holds
them to the dense reference's at 1e-5 in fp32).

Cost per asking sequence: one read of its keys in the layers asked (what a decode's
attention reads anyway) and an ``[layers, R, H, kv_len]`` matmul and softmax, in groups of
layers that hold at most 64 MiB; rows that do not ask pay nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.kv.layout import decode
from runtime.model.attention.base import AttentionMetadata
from runtime.model.batch import ScoreQuery, SeqInput

__all__ = ["Scoring"]

_GROUP_ELEMENTS = 1 << 24  # fp32 elements of scores and keys held at once (64 MiB)


@dataclass(slots=True)
class _Seq:
    start: int  # its first row in the flat batch
    pages: torch.Tensor  # [n_pages] int64: the pages holding its kv_len entries
    kv_len: int
    visible: torch.Tensor  # [R_all, kv_len] bool: what each asked row attends
    rows: torch.Tensor  # [R_all] int64 flat rows of every asked row (union of queries)
    picks: torch.Tensor  # [R_all] int64 where those rows are among all kept query rows
    queries: list[tuple[ScoreQuery, torch.Tensor]]  # each query's positions in ``rows``


class Scoring:
    """The score queries of one forward; ``collect`` runs after each layer's attention."""

    def __init__(self, batch: list[SeqInput], meta: AttentionMetadata) -> None:
        self._seqs: list[_Seq] = []
        self._layers: set[int] = set()
        self._q: dict[int, torch.Tensor] = {}  # layer -> [rows of every seq, H, D]
        flat: list[int] = []
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
                picks = torch.arange(len(flat), len(flat) + len(asked), device=device)
                flat.extend(start + r for r in asked)
                self._seqs.append(_Seq(start, pages, kv_len, visible, rows, picks, queries))
            start += len(seq.tokens)
        self._rows = torch.tensor(flat, dtype=torch.int64, device=device)

    def collect(self, layer: int, q: torch.Tensor) -> None:
        """Keep this layer's rotated queries of the rows that ask (one index per layer;
        the weights are computed once the forward has written every layer: ``finish``).

        Args:
            layer: the layer whose attention just ran.
            q: Tensor[T, H, D] the layer's rotated queries (flat batch).
        """
        if layer in self._layers:
            self._q[layer] = q.index_select(0, self._rows)

    def finish(self, pool_kv: torch.Tensor) -> None:
        """Compute every query's weights from the kept queries and the pool's keys, a
        group of layers at a time (a few ops a group, not a few per layer and row)."""
        layers = sorted(self._q)
        if not layers:
            return
        q0 = self._q[layers[0]]
        h, d = q0.shape[1], q0.shape[2]
        kvh = pool_kv.shape[4]
        for s in self._seqs:
            r = s.rows.shape[0]
            per_layer = r * h * s.kv_len + s.kv_len * kvh * d  # elements held per layer
            size = max(1, min(len(layers), _GROUP_ELEMENTS // max(per_layer, 1)))
            for lo in range(0, len(layers), size):
                group = layers[lo:lo + size]
                self._group(s, group, pool_kv, h, d, kvh)

    def _group(self, s: _Seq, group: list[int], pool_kv: torch.Tensor, h: int, d: int,
               kvh: int) -> None:
        g = len(group)
        if group[-1] - group[0] + 1 == g:  # consecutive layers: one strided read
            k = pool_kv[:, :, group[0]:group[-1] + 1, 0].index_select(0, s.pages)
        else:
            k = torch.stack([pool_kv[:, :, layer, 0].index_select(0, s.pages)
                             for layer in group], dim=2)
        q0 = self._q[group[0]]
        k = decode(k, q0.dtype).float()  # [n, S, g, KVH, D], dequantized as the pass reads
        k = k.reshape(-1, g, kvh, d)[: s.kv_len]  # [kv_len, g, KVH, D]
        q = torch.stack([self._q[layer].index_select(0, s.picks) for layer in group])
        q = q.float().view(g, -1, kvh, h // kvh, d)  # [g, R, KVH, G, D]
        # query head j reads KV head j // G (GQA), with no copy of the keys per head
        logits = torch.einsum("lrngd,klnd->lrngk", q, k).reshape(g, q.shape[1], h, -1)
        logits *= d ** -0.5  # [g, R, H, kv_len]
        logits.masked_fill_(~s.visible[None, :, None, :], float("-inf"))
        weights = torch.softmax(logits, dim=-1)  # [g, R, H, kv_len]
        for query, picks in s.queries:
            wanted = [j for j, layer in enumerate(group) if layer in query.layers]
            if not wanted:
                continue
            w = weights[wanted].index_select(1, picks)  # [l, r, H, kv_len]
            if query.heads == "mean":
                w = w.mean(dim=2)  # [l, r, kv_len]
            w = (w.sum(dim=1) if query.reduce == "sum" else w.amax(dim=1)).cpu()  # [l, ...]
            if query.by_layer:
                if query.out is None:
                    query.out = w.new_zeros((len(query.layers), *w.shape[1:]))
                at = [query.layers.index(group[j]) for j in wanted]
                query.out[at] = w
                continue
            w = w.sum(dim=0) if query.reduce == "sum" else w.amax(dim=0)
            if query.out is None:
                query.out = w
            elif query.reduce == "sum":
                query.out += w
            else:
                torch.maximum(query.out, w, out=query.out)
