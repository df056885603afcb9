"""Attention scores: the softmax weights some query rows gave each KV entry, per layer.

Owns the answers to ``ScoreQuery``s (``runtime.model.batch``), taken one of two ways:

* **In the pass** (:class:`ScoreCapture`): a sequence that pie-ctx's paged kernel attends
  (every causal sequence under deterministic numerics, the engine's default; decodes and
  drafts otherwise) has its asking rows' scaled logits written by the kernel itself as it
  scores them (``paged_attention_scored``); their softmax and the reductions run once a
  group of layers is held (all of a decode's: ``Scoring.collect``). No key is read twice.
* **A second pass** for the others (SDPA, the cascade, flash or flex, custom masks): each
  layer's rotated queries of the rows that asked are kept (``Scoring.collect``, one index
  per layer), and once the forward has written every layer's K/V, ``Scoring.finish``
  recomputes their weights, and only theirs, a group of layers at a time: the same
  queries, the same keys read back from the same pages (dequantized like the pass's), the
  same scale, the same mask (causal in KV order, or the pass's own), one fp32 softmax.
  It stays the oracle of the first way in tests.

Either way the weights are the pass's, to rounding (tests/decoding/test_attention_scores.py
holds them to the dense reference's at 1e-5 in fp32). Cost per asking sequence: in the
pass, writing ``[R, H, kv_len]`` logits a layer and their softmax; by the second pass, one
more read of its keys in the layers asked and an ``[layers, R, H, kv_len]`` matmul and
softmax, in groups of layers that hold at most 64 MiB. Rows that do not ask pay nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.kv.layout import decode
from runtime.model.attention.base import AttentionMetadata
from runtime.model.batch import ScoreQuery, SeqInput

__all__ = ["ScoreCapture", "Scoring"]

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
    index: int = 0  # its place in the batch


class ScoreCapture:
    """What the paged kernel writes scores into for one forward (``AttentionMetadata.
    scores``): the torch backend calls :meth:`take` with the sequences its kernel attends
    (while preparing), then :meth:`buffers` for each layer's call. Slots number the asking
    rows of the sequences taken; other rows have slot -1. The buffers hold as many layers
    as fit in 64 MiB (all of a decode's), so the weights are made for a group of layers in
    a few ops (:meth:`weights`), not a few per layer."""

    def __init__(self, asked: dict[int, list[int]], kv_lens: dict[int, int], layers: set[int],
                 num_rows: int, device: torch.device) -> None:
        self._asked = asked  # sequence index -> its asking rows' flat indices
        self._kv_lens = kv_lens
        self._layers = layers
        self._num_rows = num_rows
        self._device = device
        self.slot: torch.Tensor | None = None  # [T] int64
        # the sequences the kernel scores (in slot order) -> each one's first slot
        self.first: dict[int, int] = {}
        self.held: list[int] = []  # the layers in the buffers, in order
        self.room = 0  # layers the buffers hold
        self.scores: torch.Tensor | None = None  # [room, R, H, L] float32, -inf if unwritten

    def take(self, seqs: list[int]) -> None:
        """The kernel attends ``seqs`` (every layer); those that ask are scored in it."""
        slot = torch.full((self._num_rows,), -1, dtype=torch.int64)
        n = 0
        self.first = {}
        for i in seqs:
            rows = self._asked.get(i)
            if rows:
                self.first[i] = n
                slot[rows] = torch.arange(n, n + len(rows))
                n += len(rows)
        self.slot = slot.to(self._device) if self.first else None

    def buffers(self, layer: int, heads: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(slot, scores) for the kernel's call of ``layer``, or None (not asked)."""
        if self.slot is None or layer not in self._layers:
            return None
        if self.scores is None:
            rows = sum(len(self._asked[i]) for i in self.first)
            length = max(self._kv_lens[i] for i in self.first)
            self.room = max(1, min(len(self._layers), _GROUP_ELEMENTS // (rows * heads * length)))
            self.scores = torch.full((self.room, rows, heads, length), float("-inf"),
                                     device=self._device)
        assert len(self.held) < self.room  # (Scoring.collect empties full buffers)
        self.held.append(layer)
        return self.slot, self.scores[len(self.held) - 1]

    @property
    def full(self) -> bool:
        return bool(self.held) and len(self.held) == self.room

    def weights(self, i: int, kv_len: int) -> torch.Tensor:
        """Sequence ``i``'s softmax weights in the held layers: [len(held), R, H, kv_len]
        (its asking rows in order)."""
        assert self.scores is not None
        a = self.first[i]
        return torch.softmax(self.scores[: len(self.held), a: a + len(self._asked[i]), :,
                                         :kv_len], dim=-1)

    def clear(self) -> None:
        """Empty the buffers for the next layers."""
        if self.scores is not None:
            self.scores[: len(self.held)].fill_(float("-inf"))
        self.held = []


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
                self._seqs.append(_Seq(start, pages, kv_len, visible, rows, picks, queries, i))
            start += len(seq.tokens)
        self._rows = torch.tensor(flat, dtype=torch.int64, device=device)
        # what the paged kernel can score in the pass: causal sequences (the backend takes
        # those it attends, ScoreCapture.take)
        self.capture = ScoreCapture(
            {s.index: s.rows.tolist() for s in self._seqs if meta.masks[s.index] is None},
            {s.index: s.kv_len for s in self._seqs}, self._layers, start, device)

    def collect(self, layer: int, q: torch.Tensor) -> None:
        """Keep this layer's rotated queries of the rows that ask (one index per layer;
        the weights are computed once the forward has written every layer: ``finish``).

        Args:
            layer: the layer whose attention just ran.
            q: Tensor[T, H, D] the layer's rotated queries (flat batch).
        """
        if layer not in self._layers:
            return
        if self.capture.full:  # scored in the pass: the weights of the layers held
            self._flush()
        if self.capture.scores is None or len(self.capture.first) < len(self._seqs):
            self._q[layer] = q.index_select(0, self._rows)  # for the second pass

    def _flush(self) -> None:
        """Fold the layers the kernel scored (the capture's buffers) into the answers."""
        c = self.capture
        for s in self._seqs:
            if s.index in c.first:
                self._reduce(s, c.held, c.weights(s.index, s.kv_len))
        c.clear()

    def finish(self, pool_kv: torch.Tensor) -> None:
        """Compute every query's weights from the kept queries and the pool's keys, a
        group of layers at a time (a few ops a group, not a few per layer and row)."""
        if self.capture.held:
            self._flush()
        layers = sorted(self._q)
        if not layers:
            return
        q0 = self._q[layers[0]]
        h, d = q0.shape[1], q0.shape[2]
        kvh = pool_kv.shape[4]
        scored = self.capture.first if self.capture.scores is not None else {}
        for s in self._seqs:
            if s.index in scored:  # scored in the pass (_flush)
                continue
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
        self._reduce(s, group, torch.softmax(logits, dim=-1))  # [g, R, H, kv_len]

    @staticmethod
    def _reduce(s: _Seq, group: list[int], weights: torch.Tensor) -> None:
        """Fold the weights of layers ``group`` (``[g, R, H, kv_len]``, R: every asking row
        of ``s``) into each of its queries' answers."""
        for query, picks in s.queries:
            wanted = [j for j, layer in enumerate(group) if layer in query.layers]
            if not wanted:
                continue
            w = weights if len(wanted) == len(group) else weights[wanted]
            if picks.shape[0] != w.shape[1] or not torch.equal(
                    picks, torch.arange(w.shape[1], device=picks.device)):
                w = w.index_select(1, picks)  # [l, r, H, kv_len]
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
