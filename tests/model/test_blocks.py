"""weights="gguf": GGUF blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) against their dequantized fp32
twins.

Per projection: the weights a block weight computes with are the file's dequantized values
bit for bit (identity activations read them back exactly), with the compiled kernel and
with its eager twin, and every kernel ``choose_kernels`` may pick agrees with the twin's
product up to fp32 summation order. Per model: a tiny GGUF of each format, run on its
blocks, against the fp32 runner on the same file (the converted folder holds its
dequantized weights): the same logits up to summation order, the same greedy tokens. An HF
folder quantized at load against the fp32 runner on the weights its blocks hold. The
per-model checks run without the int8-activation kernel (``blocks_q8``, which rounds the
activations: tests/model/test_blocks_q8.py holds it to its own budget).
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from loader_fixtures import hf_reference_weights, write_tiny_gguf
from tiny_models import make_hf_model, make_runner

from pie_ctx.proto.errors import ModelError
from runtime.model import blocks as blocks_mod
from runtime.model import kernels
from runtime.model.blocks import BlockWeight, round_activations
from runtime.model.kernel_choice import choose_kernels
from runtime.model.loader import load_blocks, load_model
from runtime.model.matmul import ROUNDS_ACTIVATIONS, ROW_BUCKETS, Projection, bucket
from runtime.model.runner import ModelRunner, SeqInput

FORMATS = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")
BITS = {"Q4_0": 4, "Q4_1": 4, "Q5_0": 5, "Q5_1": 5, "Q8_0": 8}


@pytest.fixture(params=["kernel", "eager"])
def compiled(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Run with the compiled block kernel, and with it turned off (the eager twin)."""
    monkeypatch.setattr(kernels, "ENABLED", request.param == "kernel")
    if request.param == "kernel" and kernels.block_ops() is None:
        pytest.skip("the block kernels did not build here (no compiler?)")
    return request.param == "kernel"


@pytest.fixture
def exact(monkeypatch: pytest.MonkeyPatch) -> None:
    """Leave the int8-activation kernel out of the choice (PIE_CTX_BLOCKS_Q8=0)."""
    monkeypatch.setattr(blocks_mod, "INT8_ACTIVATIONS", False)


@pytest.fixture(autouse=True)
def _tmp_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PIE_CTX_CACHE", str(tmp_path / "cache"))


def _file_weight(kind: str, out_f: int = 48, in_f: int = 96,
                 seed: int = 0) -> tuple[BlockWeight, torch.Tensor]:
    """A block weight from GGUF bytes and the file's own dequantization of those bytes."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((out_f, in_f)) * 0.1).astype(np.float32)
    w[3, :32] = 0.25  # a constant group: d = 0 in Q4_1
    fmt = gguf.GGMLQuantizationType[kind]
    raw = gguf.quants.quantize(w, fmt)
    twin = np.asarray(gguf.quants.dequantize(raw, fmt), dtype=np.float32).reshape(out_f, in_f)
    return BlockWeight.from_gguf(raw, kind, (out_f, in_f)), torch.from_numpy(twin)


@pytest.mark.parametrize("kind", FORMATS)
def test_block_weights_are_the_files_dequantized_values_bit_for_bit(kind, compiled):
    bw, twin = _file_weight(kind)
    assert bw.source == kind and bw.bits == BITS[kind]
    # equal values, every bit (a Q4_0 zero may come out +0 where ggml's (q - 8) * d gives -0:
    # the same number in every product)
    assert torch.equal(bw.dequantize(), twin)
    assert torch.equal(bw.dequantize().abs().view(torch.int32), twin.abs().view(torch.int32))
    rows = torch.tensor([5, 0, 47, 5])
    assert torch.equal(bw.dequantize(rows), twin[rows])
    # identity activations: output column k is weight k of every row, formed in fp32
    eye = torch.eye(bw.in_features)
    assert torch.equal(bw.matmul(eye).abs().view(torch.int32),
                       twin.t().contiguous().abs().view(torch.int32))


@pytest.mark.parametrize("kind", FORMATS)
@pytest.mark.parametrize("bias", [False, True])
def test_every_chosen_kernel_computes_the_twins_product(kind, bias, compiled):
    bw, twin = _file_weight(kind, seed=1)
    b = torch.randn(bw.out_features) if bias else None
    proj = Projection(bw, b)
    choose_kernels([proj], repeats=1)
    torch.manual_seed(2)
    for rows in (*ROW_BUCKETS, 3):
        x = torch.randn(rows, bw.in_features)
        ref = F.linear(x, twin, b)
        got = proj(x)
        # (the product of the activations the chosen kernel multiplies: blocks_q8 rounds them)
        chosen = proj.kernel_names[min(bucket(rows), proj.buckets - 1)]
        exact_ref = (F.linear(round_activations(x), twin, b) if chosen in ROUNDS_ACTIVATIONS
                     else ref)
        assert got.dtype == torch.float32 and got.shape == ref.shape
        assert (got - exact_ref).abs().max().item() <= 2e-6 * max(1.0, ref.abs().max().item())
        for name in proj.candidate_names():  # each candidate, not only the chosen ones
            y = proj.kernel(name)(x)
            assert (y - ref).abs().max().item() <= 1e-2 * ref.abs().max().item(), name


@pytest.mark.parametrize("kind", FORMATS)
def test_a_row_gets_the_same_bits_in_any_batch(kind, compiled):
    """The compiled kernel's sums run in a fixed order per row (the eager twin is MKL's)."""
    if not compiled:
        pytest.skip("a property of the compiled kernel")
    bw, _ = _file_weight(kind, seed=3)
    x = torch.randn(11, bw.in_features)
    whole = bw.matmul(x)
    for r in (0, 7, 10):
        assert torch.equal(bw.matmul(x[r:r + 1]), whole[r:r + 1])


def test_k_quants_are_refused_naming_what_runs():
    with pytest.raises(ModelError, match="Q4_0, Q4_1, Q5_0, Q5_1, Q8_0.*--weights fp32 or int8"):
        BlockWeight.from_gguf(np.zeros((4, 144), np.uint8), "Q4_K", (4, 256))


def test_hf_quantization_is_llama_cpps_q4_1():
    torch.manual_seed(4)
    w = torch.randn(40, 64)
    ours = BlockWeight.quantize_q4_1(w)
    raw = gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType.Q4_1)
    ref = torch.from_numpy(np.asarray(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_1),
                                      dtype=np.float32).reshape(40, 64))
    # the same grid, scale and minimum; a value half-way between two steps may round apart
    assert (ours.dequantize() - ref).abs().max().item() <= ours.d.float().max().item() + 1e-6
    assert (ours.dequantize() == ref).float().mean().item() > 0.99


def _greedy(runner: ModelRunner, ids: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    pages = list(range(runner.num_pages))
    logits = runner.forward([SeqInput(ids, list(range(len(ids))), pages, 0,
                                      list(range(len(ids))))])
    first, out, pos = logits, [], len(ids)
    for _ in range(n):
        out.append(int(logits[-1].argmax()))
        logits = runner.forward([SeqInput([out[-1]], [pos], pages, pos, [0])])
        pos += 1
    return out, first


def _pool(c, pages: int = 16) -> torch.Tensor:
    return torch.zeros(pages, 16, c.num_layers, 2, c.num_kv_heads, c.head_dim)


@pytest.mark.parametrize("kind", FORMATS)
def test_a_gguf_model_on_its_blocks_matches_the_fp32_runner_on_the_same_file(
        tmp_path: Path, kind: str, exact: None) -> None:
    hf = hf_reference_weights(seed=5, scaled=True)
    path = write_tiny_gguf(tmp_path / "tiny.gguf", hf,
                           formats={"attn_q.weight": kind, "attn_k.weight": kind,
                                    "attn_v.weight": kind, "attn_output.weight": kind,
                                    "ffn_gate.weight": kind, "ffn_up.weight": kind,
                                    "ffn_down.weight": kind, "token_embd.weight": "Q8_0"})
    loaded = load_model(path, device="cpu", progress=False)
    blocks = load_blocks(loaded.path)
    assert blocks is not None and blocks["model.layers.0.self_attn.q_proj.weight"].source == kind
    c = loaded.config
    fp32 = ModelRunner(c, loaded.weights, _pool(c), 16)
    ours = ModelRunner(c, loaded.weights, _pool(c), 16, weight_format="gguf", blocks=blocks)
    assert ours.weight_format == "gguf"
    assert all(p.is_blocks for p in ours.model.projections())
    assert ours.weight_bytes < 0.45 * fp32.weight_bytes
    _assert_agree(fp32, ours, 1e-5)


def _assert_agree(fp32: ModelRunner, ours: ModelRunner, tol: float) -> None:
    """The same 6 greedy tokens after a 12-token prompt, and the prompt's logits within
    ``tol`` of the largest (relative)."""
    ids = [3, 7, 1, 9, 4, 4, 12, 5, 8, 2, 6, 11]
    want, want_logits = _greedy(fp32, ids, 6)
    got, got_logits = _greedy(ours, ids, 6)
    assert got == want
    scale = want_logits.abs().max().item()
    assert (got_logits - want_logits).abs().max().item() <= tol * scale


def test_a_gguf_read_in_place_computes_what_the_converted_path_computes(
        tmp_path: Path, exact: None) -> None:
    """load_model(blocks=True): the matrices arrive as block weights on the file (never in
    float), the cache folder holds no weights, and the runner built on them gives the same
    tokens and logits as the runner built in float and then put on the same blocks."""
    hf = hf_reference_weights(seed=5, scaled=True)
    path = write_tiny_gguf(tmp_path / "tiny.gguf", hf,
                           formats={"attn_q.weight": "Q4_0", "attn_k.weight": "Q4_0",
                                    "attn_v.weight": "Q8_0", "attn_output.weight": "Q4_1",
                                    "ffn_gate.weight": "Q4_1", "ffn_up.weight": "Q4_1",
                                    "ffn_down.weight": "Q8_0", "token_embd.weight": "Q8_0"})
    in_place = load_model(path, device="cpu", progress=False, blocks=True)
    assert not list(in_place.path.glob("*.safetensors"))  # the weights stay in the GGUF
    kinds = {n: type(w).__name__ for n, w in in_place.weights.items()}
    assert kinds["model.layers.0.mlp.up_proj.weight"] == "BlockWeight"
    assert kinds["model.embed_tokens.weight"] == "BlockWeight"
    assert kinds["model.layers.0.input_layernorm.weight"] == "Tensor"
    dense = load_model(path, device="cpu", progress=False)
    c = dense.config
    ours = ModelRunner(c, in_place.weights, _pool(c), 16, weight_format="gguf", blocks={})
    twin = ModelRunner(c, dense.weights, _pool(c), 16, weight_format="gguf",
                       blocks=load_blocks(dense.path))
    # qkv mixes Q4_0 and Q8_0 (float, dequantized), the rest stays on its blocks
    def on_blocks(runner: ModelRunner) -> list[bool]:
        lw = runner.model.layers[0]
        return [p.is_blocks for p in (lw.qkv, lw.o_proj, lw.gate_up, lw.down)]

    assert on_blocks(ours) == on_blocks(twin) == [False, True, True, True]
    assert ours.weight_bytes == twin.weight_bytes
    ids = [3, 7, 1, 9, 4, 4, 12, 5, 8, 2, 6, 11]
    want, want_logits = _greedy(twin, ids, 6)
    got, got_logits = _greedy(ours, ids, 6)
    assert got == want
    assert torch.equal(got_logits, want_logits)


def test_an_hf_folder_runs_on_q4_1_blocks_made_at_load(exact: None) -> None:
    hf_model = make_hf_model("llama3", seed=7, num_layers=2)
    base = make_runner(hf_model)
    c = base.config
    ours = ModelRunner(c, hf_model.state_dict(), _pool(c), 16, weight_format="gguf")
    kinds = {p.weight.source for p in ours.model.projections()}
    assert kinds == {"Q4_1", "Q8_0"}  # projections Q4_1, the (tied) lm_head Q8_0
    # the twin: the fp32 runner with every matrix replaced by what its blocks hold
    for lw, twin in zip(ours.model.layers, base.model.layers, strict=True):
        for name in ("qkv", "o_proj", "gate_up", "down"):
            p = getattr(lw, name)
            setattr(twin, name, Projection(p.weight.dequantize(), p.bias))
    head = ours.model.lm_head.weight.dequantize()
    base.model.lm_head = Projection(head, buckets=2)
    base.model.embed = ours.model.embed.table.dequantize()
    ids = [3, 7, 1, 9, 4, 4, 12, 5]
    want, want_logits = _greedy(base, ids, 5)
    got, got_logits = _greedy(ours, ids, 5)
    assert got == want
    assert (got_logits - want_logits).abs().max().item() <= 1e-5 * want_logits.abs().max().item()


def test_int4pack_is_offered_only_where_bf16_holds_the_weights():
    """torch's int4 kernel takes bf16 scales and zeros: a file's float16 scales do not fit
    (it would compute other weights), scales that bf16 holds exactly do."""
    file_weight, _ = _file_weight("Q4_1", seed=6)
    assert "int4pack" not in Projection(file_weight).candidate_names()
    torch.manual_seed(7)
    out_f, in_f = 32, 64
    qs = torch.randint(0, 256, (out_f, in_f // 2), dtype=torch.uint8)
    d = (2.0 ** -torch.randint(3, 8, (out_f, in_f // 32))).to(torch.float16)
    m = (torch.randint(-16, 16, (out_f, in_f // 32)) / 64).to(torch.float16)
    exact = BlockWeight(4, qs, d, m, out_f, in_f, "Q4_1")
    proj = Projection(exact)
    assert "int4pack" in proj.candidate_names()
    assert "int4pack" not in Projection(exact.take_rows(torch.arange(24))).candidate_names()
    x = torch.randn(5, in_f)
    ref = F.linear(x.bfloat16().float(), exact.dequantize())  # only activations rounded
    got = proj.kernel("int4pack")(x)
    assert got.dtype == torch.float32
    assert (got - ref).abs().max().item() <= 1e-2 * ref.abs().max().item()
