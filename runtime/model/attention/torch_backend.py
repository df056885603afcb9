"""Torch attention backend (CPU and CUDA): ragged batches over the paged pool.

Owner: the model runner (stateless across forwards). Strategy: ``prepare`` lays the batch
out once as a padded ``[B, Qmax]`` queries x ``[B, Lmax]`` keys problem and precomputes,
as tensors, the padded page table of every sequence (keys are gathered a whole page at a
time, then cut to ``Lmax``), the flat index of every real query in the padded layout, and
one bool mask ``[B, 1, Qmax, Lmax]`` covering causality, custom masks
and padding. Each layer then runs a fixed handful of ops and no Python per sequence:
write new K/V, one page gather each of K and V, one ``scaled_dot_product_attention``.

Common cases skip the mask entirely: a single decoding sequence (all keys visible), a
batch of decodes with equal context lengths, and a single fresh causal prefill
(``is_causal``). Padded query rows attend to real, finite pool data and are dropped, so
no NaN can appear in rows that are kept.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from runtime.model.attention import AttentionMetadata, write_kv

__all__ = ["TorchAttention"]

_HAS_ENABLE_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)


@dataclass(slots=True)
class _State:
    batch: int
    max_q: int
    max_kv: int
    max_pages: int
    page_index: torch.Tensor  # [B * max_pages] int64 page ids, padded with page 0
    q_index: torch.Tensor | None  # [T] flat row in the padded [B * Qmax] layout; None = dense
    mask: torch.Tensor | None  # [B, 1, Qmax, Lmax] bool, True = attend
    is_causal: bool


class TorchAttention:
    """``AttentionBackend`` built on ``F.scaled_dot_product_attention``."""

    name = "torch"

    def prepare(self, meta: AttentionMetadata, pool_kv: torch.Tensor) -> None:
        """Precompute gather indices, query layout and mask for this forward."""
        device = meta.write_pages.device
        q_lens, kv_lens, cached = meta.query_lens, meta.kv_lens, meta.num_cached
        b, max_q, max_kv = len(q_lens), max(q_lens), max(kv_lens)

        max_pages = max(len(pt) for pt in meta.page_tables)
        # Pad with page 0: padded keys are always masked out (or belong to dropped rows).
        table = torch.tensor([pt + [0] * (max_pages - len(pt)) for pt in meta.page_tables],
                             dtype=torch.int64, device=device)  # [B, max_pages]
        kv_idx = torch.arange(max_kv, device=device)  # [Lmax]

        q_index = None
        if any(n != max_q for n in q_lens):
            rows = [i * max_q + j for i, n in enumerate(q_lens) for j in range(n)]
            q_index = torch.tensor(rows, dtype=torch.int64, device=device)  # [T]

        mask, is_causal = None, False
        if not meta.has_custom_masks and max_q == 1:
            if any(n != max_kv for n in kv_lens):
                lens = torch.tensor(kv_lens, device=device)
                mask = (kv_idx[None, :] < lens[:, None]).view(b, 1, 1, max_kv)
        elif not meta.has_custom_masks and b == 1 and cached[0] == 0:
            is_causal = True
        else:
            mask = self._general_mask(meta, max_q, max_kv, device)
        meta.backend_state = _State(b, max_q, max_kv, max_pages, table.view(-1), q_index,
                                    mask, is_causal)

    @staticmethod
    def _general_mask(meta: AttentionMetadata, max_q: int, max_kv: int,
                      device: torch.device) -> torch.Tensor:
        """Causal-in-KV-order mask for every sequence, overridden by custom masks."""
        b = meta.num_seqs
        cached = torch.tensor(meta.num_cached, device=device)  # [B]
        limit = cached[:, None] + torch.arange(max_q, device=device)[None, :]  # [B, Qmax]
        cols = torch.arange(max_kv, device=device)  # [Lmax]
        mask = cols[None, None, :] <= limit[:, :, None]  # [B, Qmax, Lmax]
        for i, custom in enumerate(meta.masks):
            if custom is not None:
                q_len, kv_len = custom.shape
                mask[i, :q_len, :kv_len] = custom.to(device)
                mask[i, :q_len, kv_len:] = False
        return mask.view(b, 1, max_q, max_kv)

    def forward(self, layer: int, q: torch.Tensor, kv: torch.Tensor, pool_kv: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """Write K/V, gather the batch's keys and values, attend. See the Protocol."""
        st: _State = meta.backend_state
        write_kv(pool_kv, layer, kv, meta)
        t, h, d = q.shape
        kvh = kv.shape[2]
        b, max_q, max_kv = st.batch, st.max_q, st.max_kv

        # Whole pages: one page's K (or V) of one layer is a contiguous [S, KVH, D] block, so a
        # page-granular index_select copies at memcpy speed straight into the [B, L, KVH, D]
        # layout SDPA wants (a per-token advanced index was ~20x slower on CPU).
        mp, s = st.max_pages, meta.page_size
        k = pool_kv[:, layer, 0].index_select(0, st.page_index)  # [B*mp, S, KVH, D]
        v = pool_kv[:, layer, 1].index_select(0, st.page_index)  # [B*mp, S, KVH, D]
        k = k.view(b, mp * s, kvh, d)[:, :max_kv].transpose(1, 2)  # [B, KVH, Lmax, D]
        v = v.view(b, mp * s, kvh, d)[:, :max_kv].transpose(1, 2)  # [B, KVH, Lmax, D]

        if st.q_index is None:
            qb = q.view(b, max_q, h, d).transpose(1, 2)  # [B, H, Qmax, D]
        else:
            padded = q.new_zeros(b * max_q, h, d)
            padded.index_copy_(0, st.q_index, q)
            qb = padded.view(b, max_q, h, d).transpose(1, 2)  # [B, H, Qmax, D]

        if h != kvh and not _HAS_ENABLE_GQA:
            k = k.repeat_interleave(h // kvh, dim=1)  # [B, H, Lmax, D]
            v = v.repeat_interleave(h // kvh, dim=1)
        extra = {"enable_gqa": True} if (h != kvh and _HAS_ENABLE_GQA) else {}
        out = F.scaled_dot_product_attention(
            qb, k, v, attn_mask=st.mask, is_causal=st.is_causal, **extra
        )  # [B, H, Qmax, D]
        out = out.transpose(1, 2).reshape(b * max_q, h * d)  # [B*Qmax, H*D]
        if st.q_index is not None:
            out = out.index_select(0, st.q_index)  # [T, H*D]
        return out
