"""A CPU model of flash-attn's ``flash_attn_with_kvcache``, to test our flash backend's glue.

Owner: tests/model. It follows the documented contract of flash-attn 2.6-2.8
(flash_attn_interface.py's docstring and the checks of csrc/flash_attn/flash_api.cpp
``mha_fwd_kvcache``) and refuses what the real kernel refuses: non-half dtypes, a last
dim that is not contiguous, paged blocks not a multiple of 256, non-int32 lengths or
block tables, mis-shaped inputs. It computes in fp32 with plain torch, so on CPU the
flash backend's grouping, page gathers, block tables, causal alignment and log-sum-exp
layout are all checked against the torch backend; the kernel itself is checked by the
CUDA-marked tests in test_flash_backend.py.
"""

from __future__ import annotations

import math

import torch

HALF = (torch.float16, torch.bfloat16)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None,
                            rotary_sin=None, cache_seqlens=None, cache_batch_idx=None,
                            cache_leftpad=None, block_table=None, softmax_scale=None,
                            causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0,
                            return_softmax_lse=False):
    assert k is None and v is None and rotary_cos is None and cache_batch_idx is None
    assert cache_leftpad is None and alibi_slopes is None and softcap == 0.0
    assert q.dtype in HALF, "FlashAttention only support fp16 and bf16 data type"
    assert k_cache.dtype == q.dtype and v_cache.dtype == q.dtype
    for x in (q, k_cache, v_cache):
        assert x.stride(-1) == 1, "Input tensor must have contiguous last dimension"
    b, sq, h, d = q.shape
    assert d <= 256 and d % 8 == 0  # the real kernel pads other dims (a copy); we refuse
    kvh = k_cache.shape[2]
    assert h % kvh == 0, "Number of heads in key/value must divide number of heads in query"
    assert isinstance(cache_seqlens, torch.Tensor) and cache_seqlens.dtype == torch.int32
    assert tuple(cache_seqlens.shape) == (b,)
    if block_table is not None:
        assert block_table.dtype == torch.int32 and block_table.stride(-1) == 1
        num_blocks, block, _, _ = k_cache.shape
        assert block % 256 == 0, "Paged KV cache block size must be divisible by 256"
        assert block_table.shape[0] == b
        assert int(block_table.max()) < num_blocks
        seqlen_k = block_table.shape[1] * block
        index = block_table.long()
        keys = k_cache[index].reshape(b, seqlen_k, kvh, d)
        values = v_cache[index].reshape(b, seqlen_k, kvh, d)
    else:
        assert k_cache.shape[0] == b and v_cache.shape == k_cache.shape
        seqlen_k = k_cache.shape[1]
        keys, values = k_cache, v_cache
    assert int(cache_seqlens.max()) <= seqlen_k
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    out = torch.zeros(b, sq, h, d, dtype=q.dtype)
    lse = torch.full((b, h, sq), float("inf"), dtype=torch.float32)
    causal = causal and sq > 1  # as in the kernel: one query sees every key either way
    for i in range(b):
        n = int(cache_seqlens[i])
        kk = keys[i, :n].float().repeat_interleave(h // kvh, dim=1)  # [n, H, D]
        vv = values[i, :n].float().repeat_interleave(h // kvh, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[i].float(), kk) * scale  # [H, Sq, n]
        if causal:  # bottom-right aligned: query j sees keys <= n - sq + j
            limit = n - sq + torch.arange(sq)[:, None]
            scores = scores.masked_fill(torch.arange(n)[None, :] > limit, float("-inf"))
        row_lse = torch.logsumexp(scores, dim=-1)  # [H, Sq]
        probs = torch.exp(scores - row_lse[..., None])
        out[i] = torch.einsum("hqk,khd->qhd", probs, vv).to(q.dtype)
        lse[i] = row_lse
    return (out, lse) if return_softmax_lse else out
