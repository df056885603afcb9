"""pie-ctx's CPU kernels (runtime/model/kernels) against their eager twins and against
SDPA over gathered pages: the same results, whatever the batch, the pool's strides or the
threads; and the model with kernels against the model without."""

from __future__ import annotations

import fnmatch
import re
import tomllib
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from attention_oracle import paged_tables, sdpa_over_pages
from tiny_models import PagedSeq, free_list, make_hf_model, make_runner, random_tokens

from runtime.model import kernels
from runtime.model.layers import rms_norm
from runtime.model.matmul import _quantize_rows

P, S, L, KVH, D, H = 160, 16, 3, 2, 32, 6


def _pool(order: str) -> torch.Tensor:
    """A pool with the logical dims [P, S, L, 2, KVH, D] stored in ``order``."""
    torch.manual_seed(0)
    if order == "token-major":
        return torch.randn(P, S, L, 2, KVH, D)
    return torch.randn(P, L, 2, S, KVH, D).permute(0, 3, 1, 2, 4, 5)  # layer-major pages


def _reference(pool, q, layer, tables, starts, cached):
    """SDPA over each sequence's gathered pages, causal, GQA by repeating KV heads."""
    return sdpa_over_pages(pool, q, layer, tables, starts, cached)


def _call(ops, pool, case, *, shared_pages=0, seed=0):
    """Attention of a batch of (num_cached, new tokens) sequences; the first
    ``shared_pages`` pages of every table are the same (forks of one prompt)."""
    tables, padded, starts = paged_tables(case, S, P, shared_pages=shared_pages, seed=seed)
    cached = [nc for nc, _ in case]
    torch.manual_seed(seed + 1)
    q = torch.randn(starts[-1], H + 2 * KVH, D)[:, :H]  # a strided view, as the model's
    out = ops.paged_attention(q, pool, 1, padded, torch.tensor(starts, dtype=torch.int32),
                              torch.tensor(cached, dtype=torch.int32), D ** -0.5)
    return out, q, tables, starts, cached


CASES = {
    "one decode": [(0, 1)],
    "long decode (split keys)": [(1300, 1)],
    "mixed: decodes, drafts, a fresh chunk": [(50, 1), (700, 5), (0, 3), (15, 16), (300, 2)],
}


@pytest.mark.parametrize("order", ["token-major", "layer-major"])
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_paged_attention_equals_sdpa_over_gathered_pages(ops, order, case):
    pool = _pool(order)
    out, q, tables, starts, cached = _call(ops, pool, CASES[case])
    ref = _reference(pool, q, 1, tables, starts, cached)
    assert out.shape == ref.shape
    assert (out - ref).abs().max().item() < 2e-6


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_paged_attention_over_a_bf16_pool_is_the_fp32_kernel_over_its_widened_copy(ops, case):
    """kv_dtype="bf16": entries are widened to fp32 as read, every sum stays fp32, so the
    result is bit for bit the fp32 kernel's over the same values held in fp32."""
    pool = _pool("token-major").to(torch.bfloat16)
    out, q, *_ = _call(ops, pool, CASES[case])
    same, *_ = _call(ops, pool.float(), CASES[case])
    assert torch.equal(out, same)


def test_a_row_gets_the_same_bits_in_any_batch_and_on_any_threads(ops):
    """Forks sharing a prompt, each alone, all together, and on one thread: the same bits
    (keys are cut into splits at fixed positions, whatever the batch)."""
    pool = _pool("token-major")
    case = [(600, 1), (610, 1), (650, 3), (700, 1)]
    together, q, tables, starts, cached = _call(ops, pool, case, shared_pages=36)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single, *_ = _call(ops, pool, case, shared_pages=36)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(together, single)
    for i, one in enumerate(case):
        rows = slice(starts[i], starts[i + 1])
        ref = ops.paged_attention(q[rows], pool, 1, torch.tensor([tables[i]], dtype=torch.int32),
                                  torch.tensor([0, one[1]], dtype=torch.int32),
                                  torch.tensor([one[0]], dtype=torch.int32), D ** -0.5)
        assert torch.equal(together[rows], ref)
    ref = _reference(pool, q, 1, tables, starts, cached)
    assert (together - ref).abs().max().item() < 2e-6


def test_rms_norm_and_quantize_rows_match_the_eager_ops(ops, monkeypatch):
    torch.manual_seed(3)
    x = torch.randn(7, 96) * 3
    w = torch.randn(96)
    fast_norm, (fast_q, fast_s) = rms_norm(x, w, 1e-5), _quantize_rows(x)
    monkeypatch.setattr(kernels, "ENABLED", False)
    slow_norm, (slow_q, slow_s) = rms_norm(x, w, 1e-5), _quantize_rows(x)
    assert (fast_norm - slow_norm).abs().max().item() < 1e-6
    assert torch.equal(fast_q, slow_q) and torch.equal(fast_s, slow_s)
    assert torch.equal(ops.quantize_rows(torch.zeros(2, 32))[0], torch.zeros(2, 32,
                                                                              dtype=torch.int8))


@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
def test_an_int8_projection_gives_the_same_bits_with_the_kernels(ops, monkeypatch, bias):
    from runtime.model.matmul import Int8Weight, Projection

    torch.manual_seed(6)
    w = Int8Weight.quantize(torch.randn(80, 96))
    b = torch.randn(80) if bias else None
    x = torch.randn(9, 96)
    fast = {n: Projection(w, b).kernel(n)(x) for n in ("int_mm", "int_mm_kn")}
    monkeypatch.setattr(kernels, "ENABLED", False)
    slow = Projection(w, b).kernel("int_mm")(x)
    assert torch.equal(fast["int_mm"], slow) and torch.equal(fast["int_mm_kn"], slow)


@pytest.mark.parametrize("shape", [(80, 96), (37, 13), (3072, 576)], ids=str)
def test_the_int8_strips_kernel_gives_int_mms_bits_at_every_row_count(ops, shape):
    """strips_mm.cpp's sums are exact, so the kernel is int_mm's class of deterministic
    numerics: the same bits for every row count, a ragged strip and K tail included."""
    from runtime.model.matmul import Int8Weight, Projection

    if not ops.int8_strips_native():
        pytest.skip("int8_strips needs AVX-512 VNNI")
    torch.manual_seed(7)
    n, k = shape
    w = Int8Weight.quantize(torch.randn(n, k))
    b = torch.randn(n)
    assert "int8_strips" in Projection(w).candidate_names()
    for bias in (None, b):
        proj = Projection(w, bias)
        x = torch.randn(21, k) * 4
        for rows in (1, 2, 3, 4, 5, 8, 9, 21):
            want = proj.kernel("int_mm")(x[:rows])
            assert torch.equal(proj.kernel("int8_strips")(x[:rows]), want), rows
    q = torch.randint(-127, 128, (5, k), dtype=torch.int8)  # the integer sums themselves
    packed, sums = ops.pack_int8_strips(w.q)
    assert torch.equal(ops.int8_strips_mm(q, packed, sums, n), torch._int_mm(q, w.q.t()))
    with pytest.raises(RuntimeError, match="pack_int8_strips"):
        ops.int8_strips_mm(q[:, :-4], packed, sums, n)  # another K


@pytest.mark.parametrize("shape", [(80, 96), (37, 13), (3072, 576)], ids=str)
def test_the_f32_strips_kernel_is_row_count_invariant_and_linear(ops, shape):
    """strips_mm.cpp's fp32 kernel: each output one FMA chain in input order, so a row gets
    the same bits in every call (tiles of 6 rows and 4 strips, ragged ones too, threads),
    and F.linear's values to float rounding."""
    from runtime.model.matmul import Projection

    torch.manual_seed(8)
    n, k = shape
    w, b = torch.randn(n, k), torch.randn(n)
    assert "f32_strips" in Projection(w, pack=True).candidate_names()
    for bias in (None, b):
        kernel = Projection(w, bias).kernel("f32_strips")
        x = torch.randn(40, k)
        whole = kernel(x)
        torch.testing.assert_close(whole, torch.nn.functional.linear(x, w, bias),
                                   rtol=1e-4, atol=1e-4)
        for rows in (1, 2, 5, 6, 7, 13, 25):
            for start in (0, 3):
                got = kernel(x[start:start + rows])
                assert torch.equal(got, whole[start:start + rows]), (rows, start)
    with pytest.raises(RuntimeError, match="pack_f32_strips"):
        ops.f32_strips_mm(torch.randn(2, k + 1), ops.pack_f32_strips(w), b, n)


def test_the_model_with_kernels_matches_the_model_without(ops, monkeypatch):
    """Prefill, then decodes and a draft, paged: logits within float rounding either way."""
    hf_model = make_hf_model("llama3", seed=7, num_layers=2)
    tokens = random_tokens(60, seed=4)
    out = {}
    for on in ("1", "0"):
        monkeypatch.setattr(kernels, "ENABLED", on == "1")
        runner = make_runner(hf_model, page_size=16, num_pages=64)
        seq = PagedSeq(runner, free_list(runner, seed=1))
        out[on] = torch.cat([seq.run(tokens[:40])] + [seq.run([t]) for t in tokens[40:50]]
                            + [seq.run(tokens[50:])])
    scale = out["0"].abs().max().item()
    assert (out["1"] - out["0"]).abs().max().item() <= 1e-5 * scale
    assert torch.equal(out["1"].argmax(-1), out["0"].argmax(-1))


def test_rope_write_kv_and_silu_mul_match_the_eager_ops(ops):
    from runtime.model.rope import apply_rotary

    torch.manual_seed(5)
    t, h, kvh, d = 5, 6, 2, 32
    qkv = torch.randn(t, (h + 2 * kvh) * d)
    angles = torch.randn(t, d // 2)
    cos = torch.cat([angles.cos(), angles.cos()], -1)
    sin = torch.cat([angles.sin(), angles.sin()], -1)
    want = apply_rotary(qkv[:, : (h + kvh) * d].view(t, h + kvh, d), cos[:, None], sin[:, None])
    got = qkv.clone()
    ops.rope_(got, cos, sin, h + kvh, d)
    assert torch.equal(got[:, : (h + kvh) * d].view(t, h + kvh, d), want)  # bit for bit
    assert torch.equal(got[:, (h + kvh) * d:], qkv[:, (h + kvh) * d:])  # values untouched

    pool = _pool("layer-major")
    kv = torch.randn(t, 2, KVH, D)
    pages, slots = torch.tensor([3, 3, 9, 40, 7]), torch.tensor([0, 1, 15, 2, 8])
    expected = pool.clone()
    expected[pages, slots, 2] = kv
    ops.write_kv(pool, 2, kv, pages, slots)
    assert torch.equal(pool, expected)

    gu = torch.randn(4, 64)
    want = F.silu(gu[:, :32]) * gu[:, 32:]
    assert (ops.silu_mul(gu) - want).abs().max().item() < 1e-6


def _entries(t: int) -> torch.Tensor:
    """[t, 2, KVH, D] new K/V with entries of every size: zero, tiny, huge, ordinary."""
    torch.manual_seed(8)
    kv = torch.randn(t, 2, KVH, D) * torch.logspace(-3, 3, t)[:, None, None, None]
    kv[0, 0, 0] = 0.0
    kv[1, 1, 1] = 1e-20
    kv[2, 0, 1, 5] = 3e4
    return kv


@pytest.mark.parametrize("kv_dtype", ["bf16", "int8"])
def test_write_kv_stores_the_bits_of_layout_encode(ops, kv_dtype):
    """kv_dtype="bf16" and "int8": the C++ writer (the eager backend's and the fused decode
    step's) stores what runtime/kv/layout.py's encode() would, byte for byte."""
    from runtime.kv.layout import encode, entry_width, storage_dtype

    width = entry_width(kv_dtype, D)
    pool = torch.zeros(P, S, L, 2, KVH, width, dtype=storage_dtype(kv_dtype, torch.float32))
    t = 7
    qkv = torch.cat([torch.randn(t, H * D), _entries(t).reshape(t, -1)], 1)
    kv = qkv[:, H * D:].view(t, 2, KVH, D)  # a strided view, as the model's
    pages, slots = torch.tensor([3, 3, 9, 40, 7, 0, 159]), torch.tensor([0, 1, 15, 2, 8, 4, 4])
    expected = pool.clone()
    expected[pages, slots, 2] = encode(kv, expected)
    ops.write_kv(pool, 2, kv, pages, slots)
    assert torch.equal(pool, expected)


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_paged_attention_over_an_int8_pool_equals_sdpa_over_its_decoded_pages(ops, case):
    """kv_dtype="int8": each key's dot product and each value's weight times the entry's
    scale, in fp32: SDPA over the dequantized pages within float rounding."""
    from runtime.kv.layout import decode, encode

    fp32 = _pool("token-major")
    pool = encode(fp32, torch.empty(0, dtype=torch.int8))  # [P, S, L, 2, KVH, D + 4]
    out, q, tables, starts, cached = _call(ops, pool, CASES[case])
    ref = _reference(decode(pool, torch.float32), q, 1, tables, starts, cached)
    assert (out - ref).abs().max().item() < 2e-6


def test_every_file_a_build_reads_is_in_its_digest_and_the_package(tmp_path, monkeypatch) -> None:
    """The kernels compile on the user's machine from the installed files: each source,
    and each header they include, must ship in the package (a wheel once had no .cpp at
    all, and every kernel fell back to PyTorch) and be part of the build folder's digest
    (or an edited header would load a stale build)."""
    root = Path(kernels.__file__).resolve().parents[3]
    data = tomllib.loads((root / "pyproject.toml").read_text())
    globs = data["tool"]["setuptools"]["package-data"]["runtime.model.kernels"]
    compiled = {s for sources in kernels.SOURCES.values() for s in sources}
    included = {kernels.SOURCE.with_name(name) for s in compiled
                for name in re.findall(r'#include "([^"]+)"', s.read_text())}
    assert included == {kernels.HEADER}
    for path in compiled | included:
        assert any(fnmatch.fnmatch(path.name, g) for g in globs), path.name
    before = {s: kernels.folder(s) for s in kernels.SOURCES}
    edited = tmp_path / "vec16.h"
    edited.write_text(kernels.HEADER.read_text() + "\n// edited\n")
    monkeypatch.setattr(kernels, "HEADER", edited)
    assert all(kernels.folder(s) != before[s] for s in kernels.SOURCES)
