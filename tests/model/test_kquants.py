"""K-quant weights (Q4_K, Q5_K, Q6_K) computed as stored: the file's dequantized values bit
for bit, both kernels on every code path built here against their references, a row's bits
independent of its batch, the format dispatch, and a tiny Q4_K_M Llama end to end.

Oracles: ``gguf.quants.dequantize`` (the weights); a float64 product with those weights
(the exact kernel); the same product on :func:`round_q8k`'s activations (``kquant_q8``).
"""

from __future__ import annotations

import logging
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from kquant_fixtures import Q4_K_M, dequantized, random_blocks, write_kquant_gguf

from runtime.cli import main as cli_main
from runtime.model import blocks as blocks_mod
from runtime.model import fused_step, gguf_weights, kernels
from runtime.model.blocks import BLOCK_FORMATS, BlockWeight
from runtime.model.formats import FAMILIES, cat_weights, family_of, weight_from_gguf
from runtime.model.kquants import KQUANT_FORMATS, KQuantWeight, built_isas, round_q8k
from runtime.model.loader import load_blocks, load_model
from runtime.model.runner import ModelRunner, SeqInput

FORMATS = tuple(KQUANT_FORMATS)


@pytest.fixture(autouse=True)
def _tmp_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PIE_CTX_CACHE", str(tmp_path / "cache"))


@pytest.fixture(params=["kernel", "eager"])
def compiled(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Run with the compiled K-quant kernels, and with them turned off (the eager twin)."""
    monkeypatch.setattr(kernels, "ENABLED", request.param == "kernel")
    if request.param == "kernel" and kernels.kquant_ops() is None:
        pytest.skip("the K-quant kernels did not build here (no compiler?)")
    return request.param == "kernel"


def _ops():
    ops = kernels.kquant_ops()
    if ops is None:
        pytest.skip("the K-quant kernels did not build here (no compiler?)")
    return ops


def _weight(kind: str, rows: int = 37, cols: int = 512, seed: int = 0
            ) -> tuple[KQuantWeight, torch.Tensor]:
    raw = random_blocks(kind, rows, cols, seed)
    return KQuantWeight.from_gguf(raw, kind, (rows, cols)), torch.from_numpy(dequantized(raw, kind))


@pytest.mark.parametrize("kind", FORMATS)
def test_weights_are_the_files_dequantized_values_bit_for_bit(kind: str, compiled: bool) -> None:
    w, want = _weight(kind)
    assert torch.equal(w.dequantize().view(torch.int32), want.view(torch.int32))
    rows = torch.tensor([5, 0, 36, 5])
    assert torch.equal(w.dequantize(rows).view(torch.int32), want[rows].view(torch.int32))


def test_the_weight_is_a_view_of_the_files_bytes() -> None:
    raw = random_blocks("Q4_K", 8, 512)
    w = KQuantWeight.from_gguf(raw, "Q4_K", (8, 512))
    assert w.parts[0].raw.data_ptr() == raw.ctypes.data  # no copy
    assert w.nbytes == raw.nbytes == 8 * 2 * 144


@pytest.mark.parametrize("kind", FORMATS)
def test_the_exact_kernel_is_the_product_with_the_files_weights(kind: str, compiled: bool) -> None:
    w, want_w = _weight(kind)
    x = torch.randn(9, 512, generator=torch.Generator().manual_seed(1))
    want = x.double() @ want_w.double().T
    got = w.matmul(x)
    assert (got.double() - want).abs().max().item() <= 1e-5 * want.abs().max().item()
    if compiled:  # a row's bits do not depend on its batch
        for lo, n in ((0, 1), (3, 1), (2, 5), (8, 1), (0, 4)):
            assert torch.equal(w.matmul(x[lo:lo + n]), got[lo:lo + n])
        # nor a column's on the columns beside it (the kernel dequantizes blocks of rows
        # and tiles them two at a time)
        for cols in ([5], [0, 36], [3, 4, 5], list(range(17, 37))):
            assert torch.equal(w.take_rows(torch.tensor(cols)).matmul(x), got[:, cols])


def test_q8k_rounding_is_the_eager_twins() -> None:
    ops = _ops()
    x = torch.randn(5, 768, generator=torch.Generator().manual_seed(2)) * 3
    x[1, 256:512] = 0  # an all-zero super-block: d = 0
    x[2, 7] = 40.0  # one outlier sets a super-block's scale
    q, d, sums = ops.q8k_quantize(x)
    values = (q.float().view(5, 3, 256) * d[..., None]).view(5, 768)
    assert torch.equal(values, round_q8k(x))
    assert int(q[2, 7]) == -127  # iscale = -127 / (the value of largest magnitude)
    assert torch.equal(sums.int(), q.view(5, 48, 16).int().sum(-1))


@pytest.mark.parametrize("kind", FORMATS)
@pytest.mark.parametrize("isa", ["portable", "avx2", "avx512_vnni"])
def test_the_int8_activation_kernel_on_each_path(kind: str, isa: str) -> None:
    _ops()
    if isa not in built_isas():
        pytest.skip(f"{isa} is not built on this CPU")
    w, want_w = _weight(kind, seed=3)
    x = torch.randn(9, 512, generator=torch.Generator().manual_seed(4))
    got = w.matmul_q8(x, isa)
    rounded = round_q8k(x).double() @ want_w.double().T  # the same input, exactly
    scale = rounded.abs().max().item()
    assert (got.double() - rounded).abs().max().item() <= 2e-6 * scale
    dense = x.double() @ want_w.double().T  # and close to the fp32 activations' product
    assert (got.double() - dense).abs().max().item() <= 3e-2 * scale
    for lo, n in ((0, 1), (3, 1), (2, 5), (8, 1), (0, 4), (1, 8)):
        assert torch.equal(w.matmul_q8(x[lo:lo + n], isa), got[lo:lo + n])


@pytest.mark.parametrize("cols", [512, 1280])  # 2 and 5 super-blocks a row
@pytest.mark.parametrize("isa", ["portable", "avx2", "avx512_vnni"])
def test_many_rows_give_each_rows_own_bits(isa: str, cols: int) -> None:
    """Calls of many rows (AVX-512 from 16 rows: columns in lanes, 32 at a time) give every
    row the bits a call of that row alone gives, and the product the few-row kernel's
    reference does, over a fused weight whose parts differ in format and whose column
    counts are not multiples of 16."""
    _ops()
    if isa not in built_isas():
        pytest.skip(f"{isa} is not built on this CPU")
    parts = [_weight(kind, rows=rows, cols=cols, seed=8 + i)
             for i, (kind, rows) in enumerate((("Q4_K", 37), ("Q5_K", 20), ("Q6_K", 12)))]
    fused = cat_weights([w for w, _ in parts])
    x = torch.randn(301, cols, generator=torch.Generator().manual_seed(10))
    got = fused.matmul_q8(x, isa)
    rounded = round_q8k(x).double() @ torch.cat([w for _, w in parts]).double().T
    assert (got.double() - rounded).abs().max().item() <= 2e-6 * rounded.abs().max().item()
    for lo, n in ((0, 1), (5, 1), (300, 1), (17, 16), (250, 51), (0, 64), (3, 21), (40, 15)):
        assert torch.equal(fused.matmul_q8(x[lo:lo + n], isa), got[lo:lo + n])
    assert torch.equal(got, torch.cat([w.matmul_q8(x, isa) for w, _ in parts], 1))


def test_a_fused_weight_keeps_its_parts_formats_and_bytes(compiled: bool) -> None:
    a, wa = _weight("Q4_K", rows=20, seed=5)
    b, wb = _weight("Q6_K", rows=12, seed=6)
    fused = cat_weights([a, b])
    assert isinstance(fused, KQuantWeight) and fused.source == "Q4_K+Q6_K"
    assert fused.parts[1].raw.data_ptr() == b.parts[0].raw.data_ptr()
    want_w = torch.cat([wa, wb])
    assert torch.equal(fused.dequantize(), want_w)
    rows = torch.tensor([19, 20, 0, 31])
    assert torch.equal(fused.dequantize(rows), want_w[rows])
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(7))
    want = x.double() @ want_w.double().T
    assert (fused.matmul(x).double() - want).abs().max().item() <= 1e-5 * want.abs().max().item()
    if compiled:
        assert torch.equal(fused.matmul_q8(x), torch.cat([a.matmul_q8(x), b.matmul_q8(x)], 1))


def test_take_rows_copies_the_rows_asked_for() -> None:
    w, want = _weight("Q5_K", rows=16)
    index = torch.tensor([3, 1, 15, 0])
    taken = w.take_rows(index)
    assert taken.out_features == 4 and torch.equal(taken.dequantize(), want[index])


def test_dispatch_by_family() -> None:
    assert {FAMILIES[k] for k in BLOCK_FORMATS} == {"legacy"}
    assert {FAMILIES[k] for k in KQUANT_FORMATS} == {"kquant"}
    q8 = gguf.quants.quantize(np.ones((4, 64), np.float32), gguf.GGMLQuantizationType.Q8_0)
    assert isinstance(weight_from_gguf(q8, "Q8_0", (4, 64)), BlockWeight)
    assert isinstance(weight_from_gguf(random_blocks("Q6_K", 4, 256), "Q6_K", (4, 256)),
                      KQuantWeight)
    for kind in ("Q2_K", "Q3_K", "IQ4_NL", "TQ1_0"):  # dequantized at load instead
        assert family_of(kind) is None
        assert weight_from_gguf(np.zeros((4, 84), np.uint8), kind, (4, 256)) is None


def _forward(runner: ModelRunner, ids: list[int]) -> torch.Tensor:
    pages = list(range(runner.num_pages))
    return runner.forward([SeqInput(ids, list(range(len(ids))), pages, 0,
                                    list(range(len(ids))))])


def _greedy(runner: ModelRunner, ids: list[int], n: int) -> list[int]:
    pages = list(range(runner.num_pages))
    logits, out, pos = _forward(runner, ids), [], len(ids)
    for _ in range(n):
        out.append(int(logits[-1].argmax()))
        logits = runner.forward([SeqInput([out[-1]], [pos], pages, pos, [0])])
        pos += 1
    return out


def _pool(c, pages: int = 16) -> torch.Tensor:
    return torch.zeros(pages, 16, c.num_layers, 2, c.num_kv_heads, c.head_dim)


@pytest.mark.parametrize("q8", [False, True], ids=["exact", "q8"])
def test_a_q4_k_m_model_runs_on_its_super_blocks(tmp_path: Path, q8: bool,
                                                 monkeypatch: pytest.MonkeyPatch,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    """A Q4_K_M file (one Q2_K tensor among them) loads with every projection, the lm_head
    and the embedding on the file's super-blocks (the Q2_K one dequantized, logged once),
    and generates what the fp32 runner on the same file's dequantized weights does."""
    monkeypatch.setattr(blocks_mod, "INT8_ACTIVATIONS", q8)
    path = write_kquant_gguf(tmp_path / "tiny.gguf", {**Q4_K_M, "blk.1.ffn_up": "Q2_K"})
    loaded = load_model(path, device="cpu", progress=False)
    with caplog.at_level(logging.INFO, logger="runtime.model.formats"):
        blocks = load_blocks(loaded.path)
    assert blocks is not None
    notes = [r.getMessage() for r in caplog.records if r.name == "runtime.model.formats"]
    assert len(notes) == 1 and "tensors in Q2_K x1 run dequantized" in notes[0]
    assert "model.layers.1.mlp.up_proj.weight" not in blocks
    c = loaded.config
    fp32 = ModelRunner(c, loaded.weights, _pool(c), 16)
    ours = ModelRunner(c, loaded.weights, _pool(c), 16, weight_format="gguf", blocks=blocks)
    projections = ours.model.projections()
    sources = [getattr(p.weight, "source", None) for p in projections]
    assert sources[0] == "Q4_K+Q6_K" and sources[-1] == "Q6_K"  # qkv; the tied lm_head
    assert sources.count(None) == 1  # layer 1's gate_up: a Q4_K part and a float part
    assert getattr(ours.model.embed, "table", None) is projections[-1].weight
    assert ours.weight_bytes < 0.4 * fp32.weight_bytes  # (layer 1 gate_up: float)
    ids = [3, 7, 1, 9, 4, 4, 12, 5, 8, 2, 6, 11]
    want, got = _forward(fp32, ids), _forward(ours, ids)
    scale = want.abs().max().item()
    if not q8:
        assert (got - want).abs().max().item() <= 1e-5 * scale
        assert _greedy(ours, ids, 6) == _greedy(fp32, ids, 6)
    else:  # every K-quant projection on q8_K activations: close, not equal
        for p in projections:
            if isinstance(p.weight, KQuantWeight):
                assert "kquant_q8" in p.candidate_names()
                p.use(["kquant_q8"] * p.buckets)
        got = _forward(ours, ids)
        assert 0 < (got - want).abs().max().item() <= 2e-2 * scale
        assert (got.argmax(-1) == want.argmax(-1)).float().mean().item() >= 0.9


@pytest.mark.parametrize(("formats", "calibrated"), [
    ({}, False), ({"blk.0.ffn_down": "Q8_0"}, True)], ids=["all-k-quant", "a-legacy-block"])
def test_calibration_runs_only_for_legacy_blocks(tmp_path: Path, formats: dict[str, str],
                                                 calibrated: bool,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The calibration pass finds blocks_q8's outlier channels; kquant_q8 has no outlier
    split, so a file all in K-quants loads without the pass."""
    monkeypatch.setattr(blocks_mod, "INT8_ACTIVATIONS", True)
    calls = []
    real = gguf_weights.calibrate

    def spy(model, tokens):  # type: ignore[no-untyped-def]
        calls.append(len(tokens))
        return real(model, tokens)

    monkeypatch.setattr(gguf_weights, "calibrate", spy)
    path = write_kquant_gguf(tmp_path / "tiny.gguf", {**Q4_K_M, **formats})
    loaded = load_model(path, device="cpu", progress=False)
    blocks = load_blocks(loaded.path)
    c = loaded.config
    runner = ModelRunner(c, loaded.weights, _pool(c), 16, weight_format="gguf", blocks=blocks,
                         calibration=[3, 7, 1, 9, 4])
    assert calls == ([5] if calibrated else [])
    legacy = [p for p in runner.model.projections() if isinstance(p.weight, BlockWeight)]
    assert bool(legacy) == calibrated
    assert all(p.outliers is not None for p in legacy)


@pytest.mark.parametrize("kernel", ["kquant", "kquant_q8"])
def test_the_fused_decode_step_gives_the_eager_steps_bits(tmp_path: Path, kernel: str,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernels, "ENABLED", True)
    monkeypatch.setattr(fused_step, "ENABLED", True)
    if kernels.ops() is None or kernels.kquant_ops() is None:
        pytest.skip("the CPU kernels did not build here (no compiler?)")
    path = write_kquant_gguf(tmp_path / "tiny.gguf")
    loaded = load_model(path, device="cpu", progress=False)
    blocks = load_blocks(loaded.path)
    c = loaded.config

    def make() -> ModelRunner:
        runner = ModelRunner(c, loaded.weights, _pool(c), 16, weight_format="gguf",
                             blocks=blocks)
        for p in runner.model.projections():
            p.use([kernel] * p.buckets)
        return runner

    fused, eager = make(), make()
    eager._step = False  # never fused
    ids = [3, 7, 1, 9, 4, 4, 12, 5]
    pages = list(range(fused.num_pages))
    logits = [r.forward([SeqInput(ids, list(range(8)), pages, 0, [7])]) for r in (fused, eager)]
    assert torch.equal(logits[0], logits[1])
    for pos, token in ((8, 5), (9, 11), (10, 2)):
        logits = [r.forward([SeqInput([token], [pos], pages, pos, [0])]) for r in (fused, eager)]
        assert torch.equal(logits[0], logits[1])
    # (the 8-token prompt is a step too: MAX_ROWS)
    assert isinstance(fused._step, fused_step.FusedStep) and fused._step.steps == 4


def test_a_k_quant_file_runs_with_default_options(tmp_path: Path) -> None:
    path = write_kquant_gguf(tmp_path / "tiny.gguf", {**Q4_K_M, "blk.0.ffn_down": "Q5_K"})
    assert cli_main(["run", "examples/hello.py", "--model", str(path), "--page-size", "4",
                     "--", "hi", "--max-tokens", "3"]) == 0


@pytest.mark.parametrize("ftype", ["Q4_K_M", "Q5_K_M", "Q6_K"])
def test_llama_cpps_own_k_quant_files_load_as_stored(tmp_path: Path, ftype: str,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The mixes llama.cpp's quantizer writes: every matrix runs on its super-blocks (or on
    legacy blocks where llama.cpp chose them), each the converted folder's dequantized
    floats bit for bit, Q/K rows un-permuted alike."""
    llama_cpp = pytest.importorskip("llama_cpp")
    import ctypes

    import loader_fixtures as lf

    monkeypatch.setattr(lf, "HIDDEN", 256)
    monkeypatch.setattr(lf, "FFN", 512)
    hf = lf.hf_reference_weights(seed=3, scaled=True, head_dim=64)
    f16 = lf.write_tiny_gguf(tmp_path / "f16.gguf", {
        k: v.astype(np.float16) if v.ndim == 2 else v for k, v in hf.items()}, formats={})
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    path = tmp_path / f"{ftype}.gguf"
    assert llama_cpp.llama_model_quantize(str(f16).encode(), str(path).encode(),
                                          ctypes.byref(params)) == 0
    loaded = load_model(path, device="cpu", progress=False)
    blocks = load_blocks(loaded.path)
    assert blocks is not None and len(blocks) == 1 + 7 * lf.LAYERS  # embedding + projections
    assert {w.source for w in blocks.values()} & set(KQUANT_FORMATS)
    for name, w in blocks.items():
        assert torch.equal(w.dequantize(), torch.as_tensor(loaded.weights[name]).float()), name
