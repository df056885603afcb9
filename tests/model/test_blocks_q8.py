"""The int8-activation block kernel (``blocks_q8``: block_mm.cpp's ``block_mm_q8`` on
:class:`runtime.model.blocks.StripBlocks`) against its twin: the file's dequantized weights
times the activations rounded as the kernel rounds them (:func:`round_activations`), so
only fp32 summation order may differ. Then: a row's bits whatever its batch (1, 8, 512
rows, strided rows), the rounding itself, the kernel's place in the choice, and a tiny
GGUF model on it against the fp32 runner on the same file (the activation rounding is the
whole difference: greedy tokens equal, logits within ``MODEL_TOL``).
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from loader_fixtures import hf_reference_weights, write_tiny_gguf
from test_blocks import FORMATS, _file_weight, _greedy, _pool

from runtime.model import blocks as blocks_mod
from runtime.model.blocks import (
    StripBlocks,
    int8_activations,
    outlier_channels,
    round_activations,
)
from runtime.model.kernel_choice import _one_rounding, choose_kernels
from runtime.model.loader import load_blocks, load_model
from runtime.model.matmul import Projection
from runtime.model.runner import ModelRunner

# Max |logit diff| of the tiny model on blocks_q8 against fp32 on the same file, relative
# to max |logit|: int8 activations per 32 carry ~0.2-0.4% relative error a product (half a
# step of max|x| / 127 per value), which the layers carry to the logits (measured 0.6-0.7%
# here for each format; 2e-2 leaves room for other seeds of the same shapes).
MODEL_TOL = 2e-2


@pytest.fixture(autouse=True)
def _kernel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PIE_CTX_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(blocks_mod, "INT8_ACTIVATIONS", True)
    if not int8_activations():
        pytest.skip("the block kernels did not build here (no compiler?)")


def _activations(rows: int, in_f: int, seed: int = 0) -> torch.Tensor:
    """Random rows with the cases the rounding must handle: a zero group (d = 0), an
    outlier, values at ties (x / d = k + 0.5 for some k)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, in_f, generator=g)
    x[0, :32] = 0
    if rows > 1:
        x[1, 5] = 40.0
        x[-1, 32:64] = torch.arange(32) - 15.5  # max 16.5 -> d = 16.5 / 127: ties land near
    return x


@pytest.mark.parametrize("kind", FORMATS)
@pytest.mark.parametrize("shape", [(48, 96), (40, 128), (16, 576)])  # odd blocks, part strips
def test_the_kernel_is_the_twins_product_on_rounded_activations(kind, shape) -> None:
    out_f, in_f = shape
    bw, twin = _file_weight(kind, out_f, in_f, seed=11)
    strips = StripBlocks.from_blocks(bw)
    assert strips.bits == bw.bits and strips.d.shape == (-(-out_f // 16), in_f // 32, 16)
    x = _activations(9, in_f)
    got = strips.matmul(x)
    ref = F.linear(round_activations(x), twin)
    assert got.shape == (9, out_f) and got.dtype == torch.float32
    assert (got - ref).abs().max().item() <= 2e-6 * max(1.0, ref.abs().max().item())
    assert torch.equal(got[0, :], got[0, :])  # no NaN from the zero group
    # the rounding is the whole difference from the unrounded product: a few tenths of a %
    plain = F.linear(x, twin)
    assert (got - plain).abs().max().item() <= 2e-2 * plain.abs().max().item()


@pytest.mark.parametrize("kind", FORMATS)
@pytest.mark.parametrize("shape", [(48, 96), (40, 128)])
def test_the_outlier_split_is_exact_on_its_channels(kind, shape) -> None:
    """Channels kept out of the rounding: zeroed before it (each group's scale follows the
    rest), multiplied exactly by the file's weights of those columns."""
    out_f, in_f = shape
    bw, twin = _file_weight(kind, out_f, in_f, seed=15)
    idx = torch.tensor([3, 33, in_f - 1])
    strips = StripBlocks.from_blocks(bw, idx)
    assert torch.equal(strips.side, twin[:, idx].t())  # the file's values, bit for bit
    x = _activations(9, in_f)
    x[:, idx] *= 30  # static outliers, as an RMSNorm's large gains make them
    got = strips.matmul(x)
    ref = F.linear(round_activations(x, idx), twin)
    assert (got - ref).abs().max().item() <= 2e-6 * max(1.0, ref.abs().max().item())
    xz = x.clone()
    xz[:, idx] = 0
    want = F.linear(round_activations(xz), twin) + x[:, idx] @ twin[:, idx].t()
    assert (ref - want).abs().max().item() <= 1e-5 * want.abs().max().item()
    plain = F.linear(x, twin)  # closer to the unrounded product than without the split
    unsplit = StripBlocks.from_blocks(bw).matmul(x)
    assert (got - plain).abs().max().item() < 0.5 * (unsplit - plain).abs().max().item()


@pytest.mark.parametrize("kind", FORMATS)
@pytest.mark.parametrize("shape", [(48, 96), (40, 128)])
def test_two_levels_round_the_first_levels_error_again(kind, shape) -> None:
    """Activations in two levels (down_proj's): the kernel is the twin's product on
    ``q d + q2 d2``, whose error is a small fraction of one level's."""
    out_f, in_f = shape
    bw, twin = _file_weight(kind, out_f, in_f, seed=17)
    idx = torch.tensor([3, in_f - 1])
    strips = StripBlocks.from_blocks(bw, idx, levels=2)
    assert strips.code == bw.bits + blocks_mod.TWO_LEVELS
    x = _activations(9, in_f)
    x[:, 40] *= 25  # an outlier the split does not know: one level loses its group
    got = strips.matmul(x)
    ref = F.linear(round_activations(x, idx, levels=2), twin)
    assert (got - ref).abs().max().item() <= 2e-6 * max(1.0, ref.abs().max().item())
    plain = F.linear(x, twin)
    one = StripBlocks.from_blocks(bw, idx).matmul(x)
    assert (got - plain).abs().max().item() < 0.02 * (one - plain).abs().max().item()
    xr = round_activations(x, idx, levels=2)  # within a second step of the exact values
    d2 = (x - round_activations(x, idx)).view(9, -1, 32).abs().amax(dim=2) / 127
    assert ((xr - x).view(9, -1, 32).abs() <= d2[..., None] / 2 * (1 + 1e-4) + 1e-12).all()


@pytest.mark.parametrize("kind", FORMATS)
@pytest.mark.parametrize("outliers", [None, torch.tensor([0, 7, 100, 191])])
@pytest.mark.parametrize("levels", [1, 2])
def test_a_rows_bits_do_not_depend_on_its_batch(kind, outliers, levels) -> None:
    """1 row, 8 rows, 512 rows, and a strided view: the same bits for the same row."""
    bw, _ = _file_weight(kind, 72, 192, seed=12)
    strips = StripBlocks.from_blocks(bw, outliers, levels)
    x = _activations(512, 192, seed=3)
    whole = strips.matmul(x)
    for r in (0, 1, 5, 300, 511):
        assert torch.equal(strips.matmul(x[r:r + 1]), whole[r:r + 1])
    assert torch.equal(strips.matmul(x[504:512]), whole[504:512])
    assert torch.equal(strips.matmul(x[3:11]), whole[3:11])
    wide = torch.zeros(8, 400)
    wide[:, 7:199] = x[:8]
    assert torch.equal(strips.matmul(wide[:, 7:199]), whole[:8])  # strided rows


def test_rounding_is_q8_per_group_of_32() -> None:
    """Per group: d = max|x| / 127, every value within half a step, integers in
    [-127, 127]; llama.cpp's Q8_0 (gguf's reference) rounds the same values alike up to
    its float16 scale (the kernel keeps d in fp32)."""
    x = _activations(4, 96, seed=5)
    xr = round_activations(x)
    g, gr = x.view(4, 3, 32), xr.view(4, 3, 32)
    d = g.abs().amax(dim=2, keepdim=True) / 127
    assert ((gr - g).abs() <= d / 2 * (1 + 1e-6)).all()
    q = torch.where(d > 0, gr / d, torch.zeros_like(gr))
    assert (q.round() - q).abs().max().item() < 1e-4 and q.abs().max().item() <= 127
    ref = gguf.quants.dequantize(gguf.quants.quantize(x.numpy(), gguf.GGMLQuantizationType.Q8_0),
                                 gguf.GGMLQuantizationType.Q8_0)
    ref = torch.from_numpy(np.asarray(ref, dtype=np.float32)).view(4, 96)
    assert (xr - ref).abs().max().item() <= 1.01 * d.max().item()


def test_it_is_a_candidate_and_the_switch_leaves_it_out(monkeypatch) -> None:
    bw, twin = _file_weight("Q4_1", 64, 128, seed=13)
    proj = Projection(bw)
    assert "blocks_q8" in proj.candidate_names()
    choose_kernels([proj], repeats=1)  # passes its check (on the rounded activations)
    x = torch.randn(3, 128)
    got = proj.kernel("blocks_q8")(x)
    assert (got - F.linear(round_activations(x), twin)).abs().max().item() <= 1e-5
    monkeypatch.setattr(blocks_mod, "INT8_ACTIVATIONS", False)
    assert "blocks_q8" not in Projection(bw).candidate_names()


def test_bad_shapes_are_refused() -> None:
    bw, _ = _file_weight("Q8_0", 32, 64)
    strips = StripBlocks.from_blocks(bw)
    with pytest.raises(RuntimeError, match="columns"):
        strips.matmul(torch.randn(2, 96))
    ops = blocks_mod.kernels.block_ops()
    with pytest.raises(RuntimeError, match="out of range"):
        ops.block_mm_q8(torch.randn(2, 64), strips.qs, strips.d, strips.m, 8, 32,
                        torch.tensor([64]), torch.zeros(1, 32))


def test_outlier_channels_are_the_largest_inputs() -> None:
    amax = torch.ones(96)
    amax[[70, 4, 50]] = torch.tensor([9.0, 5.0, 7.0])
    assert outlier_channels(amax, 3).tolist() == [4, 50, 70]
    assert outlier_channels(amax[:2], 8).tolist() == [0, 1]


def test_a_calibrated_gguf_model_splits_its_norm_fed_projections(tmp_path: Path) -> None:
    """With calibration tokens, every projection and the lm_head keep their inputs' largest
    channels (max |x| over the pass) out of the rounding."""
    hf = hf_reference_weights(seed=5, scaled=True)
    names = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    path = write_tiny_gguf(tmp_path / "tiny.gguf", hf,
                           formats={**{f"{n}.weight": "Q4_1" for n in names},
                                    "token_embd.weight": "Q8_0"})
    loaded = load_model(path, device="cpu", progress=False)
    c = loaded.config
    ours = ModelRunner(c, loaded.weights, _pool(c), 16, weight_format="gguf",
                       blocks=load_blocks(loaded.path), calibration=list(range(3, 40)))
    lw = ours.model.layers[0]
    assert lw.qkv.outliers is not None and lw.qkv.outliers.numel() == min(8, c.hidden_size)
    assert lw.gate_up.outliers is not None and ours.model.lm_head.outliers is not None
    assert lw.o_proj.outliers is not None and lw.down.outliers is not None
    fp32 = ModelRunner(c, loaded.weights, _pool(c), 16)
    for p in ours.model.projections():
        p.use(["blocks_q8"] * p.buckets)
    ids = [3, 7, 1, 9, 4, 4, 12, 5, 8, 2, 6, 11]
    want, want_logits = _greedy(fp32, ids, 6)
    got, got_logits = _greedy(ours, ids, 6)
    assert got == want
    assert (got_logits - want_logits).abs().max().item() <= MODEL_TOL * want_logits.abs().max().item()


@pytest.mark.parametrize("kind", FORMATS)
def test_a_gguf_model_on_int8_activations_keeps_the_fp32_runners_tokens(
        tmp_path: Path, kind: str) -> None:
    hf = hf_reference_weights(seed=5, scaled=True)
    names = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    path = write_tiny_gguf(tmp_path / "tiny.gguf", hf,
                           formats={**{f"{n}.weight": kind for n in names},
                                    "token_embd.weight": "Q8_0"})
    loaded = load_model(path, device="cpu", progress=False)
    c = loaded.config
    fp32 = ModelRunner(c, loaded.weights, _pool(c), 16)
    ours = ModelRunner(c, loaded.weights, _pool(c), 16, weight_format="gguf",
                       blocks=load_blocks(loaded.path))
    for p in ours.model.projections():  # every projection and the lm_head on blocks_q8
        p.use(["blocks_q8"] * p.buckets)
    ids = [3, 7, 1, 9, 4, 4, 12, 5, 8, 2, 6, 11]
    want, want_logits = _greedy(fp32, ids, 6)
    got, got_logits = _greedy(ours, ids, 6)
    assert got == want
    diff = (got_logits - want_logits).abs().max().item()
    assert diff <= MODEL_TOL * want_logits.abs().max().item()


def test_a_rounding_kernel_serves_every_bucket_or_none() -> None:
    """blocks_q8 computes other numbers than blocks (not only other last bits): a
    projection uses it for every row bucket or for none, so a sequence's tokens never depend
    on the bucket its batch falls in."""
    t = [{"blocks": 1.0, "blocks_f32": 3.0, "blocks_q8": 0.5},
         {"blocks": 1.0, "blocks_f32": 0.8, "blocks_q8": 0.9},
         {"blocks": 1.0, "blocks_f32": 0.9, "blocks_q8": 1.5}]
    # 0.5 / 1 * 0.9 / 0.8 * 1.5 / 0.9 = 0.94: faster overall, every bucket
    assert _one_rounding(["blocks_q8", "blocks_f32", "blocks_f32"], t) == ["blocks_q8"] * 3
    t[2]["blocks_q8"] = 2.0  # 1.25: slower overall, no bucket
    assert _one_rounding(["blocks_q8", "blocks_f32", "blocks_f32"], t) == [
        "blocks", "blocks_f32", "blocks_f32"]
    assert _one_rounding(["blocks", "blocks_f32"], t[:2]) == ["blocks", "blocks_f32"]
    bw, _ = _file_weight("Q4_1", 64, 128, seed=14)
    proj = Projection(bw)
    choose_kernels([proj], repeats=1)
    assert ("blocks_q8" in proj.kernel_names) == (set(proj.kernel_names) == {"blocks_q8"})


@pytest.mark.parametrize("kind", FORMATS)
def test_the_outlier_product_inside_the_tiles_is_the_two_pass_sum(kind) -> None:
    """The kernel adds the outlier channels' exact product in the tile that computes a
    value (one pass a call): the block product of the zeroed input plus an fp32 fma chain
    over the channels. Against the two passes (the kernel without a split on the zeroed
    input, plus that chain in fp64): within the chain's own fp32 roundings (K fmas and
    one add: (K + 1) ulps of the magnitudes summed)."""
    bw, twin = _file_weight(kind, 72, 192, seed=21)
    idx = torch.tensor([0, 7, 100, 191])
    split, plain = StripBlocks.from_blocks(bw, idx), StripBlocks.from_blocks(bw)
    for rows in (1, 8, 512):
        x = _activations(rows, 192, seed=rows)
        x[:, idx] *= 30
        xz = x.clone()
        xz[:, idx] = 0
        first = plain.matmul(xz).double()
        terms = x[:, idx].double()[:, :, None] * split.side.double()[None]  # [M, K, out]
        want = first + terms.sum(dim=1)
        eps = torch.finfo(torch.float32).eps
        bound = (len(idx) + 1) * eps * (terms.abs().sum(dim=1) + first.abs()) + 1e-30
        assert ((split.matmul(x).double() - want).abs() <= bound).all()


@pytest.mark.parametrize("kind", FORMATS)
@pytest.mark.parametrize("levels", [1, 2])
def test_the_into_form_writes_adds_and_takes_a_bias_as_the_eager_ops(kind, levels) -> None:
    """``block_mm_q8_out`` (the fused decode step's call): into strided rows of a buffer,
    ``=`` or ``+=`` (a residual), with a bias: the bits of ``block_mm_q8``, ``.add_(bias)``
    and ``residual.add_(...)``, eagerly."""
    ops = blocks_mod.kernels.block_ops()
    bw, _ = _file_weight(kind, 72, 192, seed=22)
    strips = StripBlocks.from_blocks(bw, torch.tensor([3, 64]), levels)
    bias = torch.randn(72)
    for rows in (1, 8, 33):
        x = _activations(rows, 192, seed=rows + 1)
        want = strips.matmul(x).add_(bias)
        buf = torch.full((rows, 100), 7.0)
        ops.block_mm_q8_out(x, strips.qs, strips.d, strips.m, strips.code, 72, strips.outliers,
                            strips.side, bias, buf[:, 10:82], False)
        assert torch.equal(buf[:, 10:82], want)
        assert (buf[:, :10] == 7).all() and (buf[:, 82:] == 7).all()  # nothing else written
        residual = torch.randn(rows, 72)
        eager = residual.clone().add_(want)
        ops.block_mm_q8_out(x, strips.qs, strips.d, strips.m, strips.code, 72, strips.outliers,
                            strips.side, bias, residual, True)
        assert torch.equal(residual, eager)
    with pytest.raises(RuntimeError, match="out float32"):
        ops.block_mm_q8_out(x, strips.qs, strips.d, strips.m, strips.code, 72, strips.outliers,
                            strips.side, bias, torch.empty(rows, 71), False)


def test_strips_moved_to_one_huge_page_arena_give_the_same_bits(monkeypatch) -> None:
    """strips_on_huge_pages moves every blocks_q8 layout into one arena (2 MiB pages where
    THP allows; the arena's floor lowered so test-sized weights take it) and routes the
    kernels there: same products, bit for bit; other layouts are left alone."""
    from runtime.kv import hugepages
    from runtime.model.gguf_weights import strips_on_huge_pages

    monkeypatch.setattr(hugepages, "_MIN_BYTES", 0)
    projs = [Projection(_file_weight(kind, 48, 96, seed=20 + i)[0])
             for i, kind in enumerate(FORMATS)]
    for p in projs:
        p.use(["blocks_q8"] * p.buckets)
    other = Projection(_file_weight("Q4_1", 32, 64, seed=30)[0])
    other.use(["blocks"] * other.buckets)
    x, x_other = _activations(5, 96), _activations(5, 64)
    want = [p(x) for p in projs] + [other(x_other)]
    before = [p.layout("blocks_q8") for p in projs]
    nbytes = strips_on_huge_pages([*projs, other])
    assert nbytes >= sum(t.numel() * t.element_size() for s in before for t in (s.qs, s.d, s.m))
    arena = {p.layout("blocks_q8").qs.untyped_storage().data_ptr() for p in projs}
    assert len(arena) == 1  # one storage holds them all
    for p, old in zip(projs, before, strict=True):
        new = p.layout("blocks_q8")
        assert new.qs.data_ptr() != old.qs.data_ptr() and new.qs.data_ptr() % 64 == 0
        assert torch.equal(new.qs, old.qs) and torch.equal(new.d, old.d)
        assert torch.equal(new.m, old.m)
    got = [p(x) for p in projs] + [other(x_other)]
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    assert strips_on_huge_pages([other]) == 0
