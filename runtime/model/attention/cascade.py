"""Cascade attention for decodes that share a prefix (forks, best-of-N, beams).

Owner: the torch backend, which builds one :class:`CascadeGroup` per cluster of decoding
sequences whose page tables start with the same committed pages. Decoding N forks of a long
prompt otherwise reads the prompt's K/V N times per layer; here the shared pages are read
once and attended by all N queries in one matmul, each fork's own tail is attended
separately, and the two halves are merged exactly through their log-sum-exp:

    out = out_shared * exp(lse_shared - lse) + out_tail * exp(lse_tail - lse),
    lse = logaddexp(lse_shared, lse_tail)

Shared pages are committed (full, immutable) and precede every sequence's tail, so with
causal decoding every query sees all of them: no mask is needed on the shared half.

Numerics: whatever the storage dtype (fp32, bf16, fp16), scores, softmax statistics, the
log-sum-exps and the merge are fp32, as in flash-attn; only the result is cast back. Merge
weights from a bf16 log-sum-exp would be off by several percent.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from runtime.kv.layout import decode
from runtime.model.attention.base import AttentionMetadata, consecutive_run

__all__ = ["CascadeGroup", "merge_lse", "run_prefix_len", "shared_prefix_clusters"]


def shared_prefix_clusters(meta: AttentionMetadata, decodes: list[int],
                           min_pages: int = 1) -> tuple[list[tuple[list[int], int]], list[int]]:
    """Split decoding sequences into clusters sharing leading pages, and the rest.

    Args:
        meta: the forward's metadata.
        decodes: indices of single-token, causal sequences.
        min_pages: smallest shared prefix worth a cascade.

    Returns:
        ``([(sequences, num_shared_pages), ...], remaining sequences)``.
    """
    by_first: dict[int, list[int]] = {}
    for i in decodes:
        table = meta.page_tables[i]
        if table:
            by_first.setdefault(table[0], []).append(i)
    clusters: list[tuple[list[int], int]] = []
    rest = [i for i in decodes if not meta.page_tables[i]]
    for seqs in by_first.values():
        if len(seqs) < 2:
            rest.extend(seqs)
            continue
        first = meta.page_tables[seqs[0]]
        shared = len(first)
        for i in seqs[1:]:
            table = meta.page_tables[i]
            n = 0
            limit = min(shared, len(table))
            while n < limit and table[n] == first[n]:
                n += 1
            shared = n
        # Only full pages strictly before every sequence's newest token can be shared.
        full = min(meta.num_cached[i] // meta.page_size for i in seqs)
        shared = min(shared, full)
        if shared >= min_pages:
            clusters.append((seqs, shared))
        else:
            rest.extend(seqs)
    return clusters, sorted(rest)


def run_prefix_len(pages: list[int], limit: int) -> int:
    """How many leading pages are consecutive ids (at most ``limit``)."""
    n = 0
    while n < min(limit, len(pages)) and pages[n] == pages[0] + n:
        n += 1
    return n


@dataclass(slots=True)
class CascadeGroup:
    """One cluster: its token rows, the shared pages and each sequence's tail pages."""

    rows: torch.Tensor  # [n] rows of the cluster's tokens in the flat batch
    shared_pages: torch.Tensor  # [ns] page ids read once for the whole cluster
    tail_pages: torch.Tensor  # [n * mt] page ids of each tail, padded with page 0
    tail_len: int  # longest tail, in KV entries
    tail_bias: torch.Tensor | None  # [n, 1, 1, tail_len] float: 0 real entry, -inf padding
    shared_run: int | None = None  # first page id when the shared pages are a run

    @classmethod
    def build(cls, meta: AttentionMetadata, seqs: list[int], shared: int,
              rows: torch.Tensor) -> CascadeGroup:
        device = meta.write_pages.device
        ps = meta.page_size
        tails = [meta.page_tables[i][shared:] for i in seqs]
        lens = [meta.kv_lens[i] - shared * ps for i in seqs]
        mt = max(len(t) for t in tails)
        tail_pages = torch.tensor([t + [0] * (mt - len(t)) for t in tails], dtype=torch.int64,
                                  device=device).view(-1)
        tail_len = max(lens)
        bias = None
        if any(n != tail_len for n in lens):
            cols = torch.arange(tail_len, device=device)
            real = (cols[None, :] < torch.tensor(lens, device=device)[:, None]).view(
                len(seqs), 1, 1, tail_len)
            bias = torch.zeros(real.shape, device=device).masked_fill_(~real, float("-inf"))
        shared_pages = torch.tensor(meta.page_tables[seqs[0]][:shared], dtype=torch.int64,
                                    device=device)
        run = consecutive_run(meta.page_tables[seqs[0]][:shared])
        return cls(rows, shared_pages, tail_pages, tail_len, bias, run)

    def attend(self, layer: int, q: torch.Tensor, pool_kv: torch.Tensor,
               page_size: int) -> torch.Tensor:
        """Attention of the cluster's queries ``[n, H, D]`` -> ``[n, H * D]``."""
        n, h, d = q.shape
        kvh = pool_kv.shape[4]
        g = h // kvh
        scale = 1.0 / math.sqrt(d)
        layer_k, layer_v = pool_kv[:, :, layer, 0], pool_kv[:, :, layer, 1]  # [P, S, KVH, W]

        # Shared half: every query of the cluster against the shared pages, read once (and,
        # for an int8 pool, dequantized once).
        if self.shared_run is not None:  # consecutive pages: read in place, no copy
            a, ns = self.shared_run, self.shared_pages.numel()
            ks = decode(layer_k[a : a + ns], q.dtype).reshape(-1, kvh, d).transpose(0, 1)
            vs = decode(layer_v[a : a + ns], q.dtype).reshape(-1, kvh, d).transpose(0, 1)
        else:
            ks = decode(layer_k.index_select(0, self.shared_pages), q.dtype)
            vs = decode(layer_v.index_select(0, self.shared_pages), q.dtype)
            ks, vs = ks.view(-1, kvh, d).transpose(0, 1), vs.view(-1, kvh, d).transpose(0, 1)
        # ks, vs: [KVH, Ls, D]; query head j uses kv head j // g
        qs = q.view(n, kvh, g, d).transpose(0, 1).reshape(kvh, 1, n * g, d)  # [KVH, 1, nG, D]
        o1, lse1 = _attend_lse(qs, ks[:, None], vs[:, None], scale, None)
        o1 = o1.view(kvh, n, g, d).transpose(0, 1)  # [n, KVH, G, D]
        lse1 = lse1.view(kvh, n, g).transpose(0, 1)  # [n, KVH, G]

        # Tail half: each sequence against its own pages.
        mt_tokens = self.tail_pages.numel() // n * page_size
        kt = decode(layer_k.index_select(0, self.tail_pages), q.dtype)
        vt = decode(layer_v.index_select(0, self.tail_pages), q.dtype)
        kt = kt.view(n, mt_tokens, kvh, d)[:, : self.tail_len]
        vt = vt.view(n, mt_tokens, kvh, d)[:, : self.tail_len]
        qt = q.view(n, kvh, g, d)  # [n, KVH, G, D]
        o2, lse2 = _attend_lse(qt, kt.transpose(1, 2), vt.transpose(1, 2), scale, self.tail_bias)

        out = merge_lse(o1, lse1, o2, lse2).to(q.dtype)  # [n, KVH, G, D]
        return out.reshape(n, h * d)  # [n, H*D], head j = kv_head * G + g


def merge_lse(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor,
              lse2: torch.Tensor) -> torch.Tensor:
    """Attention over two disjoint key sets, from each set's output and log-sum-exp.

    Args:
        o1, o2: Tensor[..., D] outputs over each key set (any float dtype).
        lse1, lse2: Tensor[...] their log-sum-exps (natural log).

    Returns:
        Tensor[..., D] in fp32, whatever the inputs (the caller casts back): merge weights
        ``exp(lse_i - lse)`` from a bf16 log-sum-exp would be off by several percent.
    """
    lse1, lse2 = lse1.float(), lse2.float()
    lse = torch.logaddexp(lse1, lse2)
    return (o1.float() * (lse1 - lse).exp_()[..., None]
            + o2.float() * (lse2 - lse).exp_()[..., None])


_FLASH_LSE = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _attend_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention that also returns each query's log-sum-exp.

    Args:
        q: Tensor[B, H, Q, D]; k, v: Tensor[B, H, K, D]; bias: additive float mask
            broadcastable to [B, H, Q, K] (``-inf`` = masked) or None.

    Returns:
        (Tensor[B, H, Q, D], Tensor[B, H, Q]).

    On CPU this is torch's fused flash kernel (the one SDPA uses, which also computes the
    log-sum-exp, in fp32, and accumulates in fp32 for half inputs); elsewhere, or if that
    kernel refuses the inputs, a matmul-softmax-matmul in fp32. The log-sum-exp is fp32
    either way; the output has the inputs' dtype on the fused path, fp32 on the other.
    """
    if _FLASH_LSE is not None and q.device.type == "cpu":
        try:
            out, lse = _FLASH_LSE(q, k, v, 0.0, False, attn_mask=bias, scale=scale)
            return out, lse
        except RuntimeError:
            pass
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)).mul_(scale)  # [B, H, Q, K]
    if bias is not None:
        scores = scores + bias.float()
    return _softmax_attend(scores, v.float())


def _softmax_attend(scores: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``softmax(scores) @ v`` and the rows' log-sum-exp, in one pass over ``scores``.

    Args:
        scores: Tensor[..., Q, K] (overwritten).
        v: Tensor[..., K, D].

    Returns:
        (Tensor[..., Q, D], Tensor[..., Q]).
    """
    peak = scores.amax(dim=-1, keepdim=True)  # [..., Q, 1]; finite: every row sees a key
    weights = scores.sub_(peak).exp_()  # [..., Q, K]
    total = weights.sum(dim=-1, keepdim=True)  # [..., Q, 1]
    out = torch.matmul(weights, v).div_(total)  # [..., Q, D]
    return out, (peak + total.log()).squeeze(-1)
