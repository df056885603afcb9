"""The decode step in one C++ call (runtime/model/fused_step.py, decode_step.cpp) against
the eager forward, its oracle: two runners on the same weights take the same batches, one
with the fused step and one without, and must give the same tokens, logits within
``TOL`` (the projections, norms, RoPE and K/V writes are the same kernels; attention of a
fork differs in the last bits), and the same pool contents. bf16 and int8 KV pages are
written and read by the same C++ functions on both paths, so with the eager cascade off
the two give the same bits. Batches the step does not take (masks it cannot express,
scores, Qwen3's q/k norms, more than 32 rows) must still be right, through the eager
forward."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from lora_fixtures import make_adapter
from tiny_models import PagedSeq, free_list, make_hf_model, make_runner, random_tokens

from runtime.kv.layout import SCALE_BYTES
from runtime.model import fused_step, kernels
from runtime.model.attention.torch_backend import TorchAttention
from runtime.model.batch import ScoreQuery
from runtime.model.blocks import BlockWeight
from runtime.model.fused_step import FusedStep
from runtime.model.matmul import Projection
from runtime.model.runner import ModelRunner

TOL = 1e-4  # max abs logit difference, fused step vs eager (logits are O(1-10) here)
LORA_TOL = 1e-4  # fused (bf16 adapter weights) vs eager on the same bf16-rounded weights
PEFT_TOL = 2e-3  # relative to max |logit|: bf16 rounding of the adapter weights (std 0.1)


@pytest.fixture(autouse=True)
def _on(monkeypatch):
    monkeypatch.setattr(kernels, "ENABLED", True)
    monkeypatch.setattr(fused_step, "ENABLED", True)
    if kernels.ops() is None:
        pytest.skip("the CPU kernels did not build here (no compiler?); the eager code runs")


def _pair(make) -> tuple[ModelRunner, ModelRunner]:
    """(fused, eager): two runners from ``make()``, the second never fused."""
    fused, eager = make(), make()
    eager._step = False
    return fused, eager


def _steps(runner: ModelRunner) -> int:
    return runner._step.steps if isinstance(runner._step, FusedStep) else 0


class _Twin:
    """The same sequences on both runners (same pages: same free-list seed)."""

    def __init__(self, fused: ModelRunner, eager: ModelRunner) -> None:
        self.runners = (fused, eager)
        self.free = (free_list(fused), free_list(eager))
        self.seqs: list[tuple[PagedSeq, PagedSeq]] = []

    def add(self, fork_of: int | None = None, shared_pages: int = 0) -> int:
        pair = []
        for r, runner in enumerate(self.runners):
            seq = PagedSeq(runner, self.free[r])
            if fork_of is not None:
                parent = self.seqs[fork_of][r]
                seq.pages = list(parent.pages[:shared_pages])
                seq.num_cached = shared_pages * runner.page_size
            pair.append(seq)
        self.seqs.append((pair[0], pair[1]))
        return len(self.seqs) - 1

    def step(self, feeds: dict[int, list[int]], adapters: dict[int, int] | None = None,
             masks: dict[int, np.ndarray] | None = None, scores: int | None = None,
             tol: float = TOL) -> list[int]:
        """One forward of sequences ``feeds`` (index -> tokens) on both runners; checks
        they agree and returns the greedy token of each sequence's last row."""
        outs = []
        for r, runner in enumerate(self.runners):
            batch = []
            for i, tokens in feeds.items():
                s = self.seqs[i][r].step(tokens, logits=[len(tokens) - 1],
                                         mask=(masks or {}).get(i))
                s.adapter = (adapters or {}).get(i, 0)
                if scores == i:
                    s.scores = [ScoreQuery(rows=[0], layers=[0])]
                batch.append(s)
            outs.append(runner.forward(batch))
            for i, tokens in feeds.items():
                self.seqs[i][r].advance(len(tokens))
        got, want = outs
        assert (got - want).abs().max().item() <= tol
        assert torch.equal(got.argmax(-1), want.argmax(-1))
        return want.argmax(-1).tolist()

    def check_pools(self, tol: float = 1e-5) -> None:
        """fp32 pages within ``tol``; bf16 and int8 ones bit for bit with ``tol`` 0, else
        within one rounding step (one bf16 ulp, one int8 level; int8 scales within 1e-5)."""
        a, b = (r.pool_kv for r in self.runners)
        if tol == 0.0 or a.dtype == torch.float32:
            assert torch.equal(a, b) if tol == 0.0 else (a - b).abs().max().item() <= tol
        elif a.dtype == torch.bfloat16:
            assert (a.view(torch.int16).int() - b.view(torch.int16).int()).abs().max() <= 1
        else:
            d = a.shape[-1] - SCALE_BYTES
            assert (a[..., :d].int() - b[..., :d].int()).abs().max() <= 1
            sa, sb = (p[..., d:].contiguous().view(torch.float32) for p in (a, b))
            assert ((sa - sb).abs() <= 1e-5 * sa.abs()).all()


@pytest.mark.parametrize("arch", ["llama3", "qwen2", "llama_linear"])
def test_decodes_forks_and_drafts_match_the_eager_step(arch: str) -> None:
    hf = make_hf_model(arch, seed=3)
    fused, eager = _pair(lambda: make_runner(hf, num_pages=64))
    twin = _Twin(fused, eager)
    a, b = twin.add(), twin.add()
    prompt = random_tokens(40, seed=1)
    twin.step({a: prompt, b: random_tokens(9, seed=2)})  # prefill: 49 rows, eager
    assert _steps(fused) == 0
    fork = twin.add(fork_of=a, shared_pages=2)  # shares a's first 32 entries
    nxt = twin.step({fork: prompt[32:]})  # 8 new tokens over shared pages: fused
    assert _steps(fused) == 1
    last = {a: 5, b: 6, fork: nxt[0]}
    for _ in range(5):  # decodes of all three (a and the fork share two pages)
        toks = twin.step({i: [t] for i, t in last.items()})
        last = dict(zip(last, toks, strict=True))
    twin.step({a: [last[a], 7, 8]})  # a 3-token draft
    assert _steps(fused) == 7
    twin.check_pools()


def test_masks_scores_and_the_switch() -> None:
    hf = make_hf_model("llama3", seed=4)
    fused, eager = _pair(lambda: make_runner(hf, num_pages=32))
    twin = _Twin(fused, eager)
    a = twin.add()
    twin.step({a: random_tokens(20, seed=5)})
    causal = np.ones((1, 21), dtype=bool)
    twin.step({a: [3]}, masks={a: causal})  # a mask that is causal attention: fused
    assert _steps(fused) == 1
    holes = np.ones((1, 22), dtype=bool)
    holes[0, 2:9] = False
    twin.step({a: [4]}, masks={a: holes})  # one the paged kernel cannot express: eager
    twin.step({a: [5]}, scores=a)  # attention scores asked for: eager
    assert _steps(fused) == 1
    fused_step.ENABLED = False  # PIE_CTX_DECODE_STEP=0 (the fixture restores it)
    twin.step({a: [6]})
    assert _steps(fused) == 1
    fused_step.ENABLED = True
    twin.step({a: [7]})
    assert _steps(fused) == 2
    twin.check_pools()


def test_more_than_max_rows_and_qk_norms_run_eagerly() -> None:
    hf = make_hf_model("llama3", seed=5)
    fused, eager = _pair(lambda: make_runner(hf, num_pages=96))
    twin = _Twin(fused, eager)
    seqs = [twin.add() for _ in range(9)]
    twin.step({i: random_tokens(5, seed=i) for i in seqs})
    twin.step({i: random_tokens(4, seed=20 + i) for i in seqs})  # 36 rows: eager
    twin.step({i: random_tokens(4, seed=40 + i) for i in seqs[:8]})  # 32 rows: fused
    assert fused_step.MAX_ROWS == 32 and _steps(fused) == 1
    hf = make_hf_model("qwen3", seed=6)
    fused, eager = _pair(lambda: make_runner(hf, num_pages=32))
    twin = _Twin(fused, eager)
    a = twin.add()
    twin.step({a: random_tokens(18, seed=7)})
    twin.step({a: [1]}, tol=0.0)  # both eager: the same bits
    assert _steps(fused) == 0


def _no_cascade(hf, kv: str) -> ModelRunner:
    """A runner on ``kv`` pages whose torch backend attends forks through the paged kernel
    (no cascade), as the fused step does."""
    runner = make_runner(hf, num_pages=48, kv_dtype=kv)
    runner.backend = TorchAttention(cascade=False, bf16_pool=kv == "bf16")
    return runner


@pytest.mark.parametrize("kv", ["bf16", "int8"])
def test_bf16_and_int8_pages_give_the_eager_steps_bits(kv: str) -> None:
    """The step writes K/V with the eager backend's C++ encoder and attends with its paged
    kernel: with the cascade off on both, every logit and every page byte is the same, on
    decodes, forks over shared pages and drafts."""
    hf = make_hf_model("qwen2", seed=11)
    fused, eager = _pair(lambda: _no_cascade(hf, kv))
    twin = _Twin(fused, eager)
    a, b = twin.add(), twin.add()
    prompt = random_tokens(40, seed=1)
    twin.step({a: prompt, b: random_tokens(9, seed=2)}, tol=0.0)  # prefill: eager
    fork = twin.add(fork_of=a, shared_pages=2)
    nxt = twin.step({fork: prompt[32:]}, tol=0.0)  # 8 new tokens over shared pages
    last = {a: 5, b: 6, fork: nxt[0]}
    for _ in range(3):
        last = dict(zip(last, twin.step({i: [t] for i, t in last.items()}, tol=0.0),
                        strict=True))
    twin.step({a: [last[a], 7, 8]}, tol=0.0)  # a 3-token draft
    assert _steps(fused) == 5
    twin.check_pools(tol=0.0)


def _blocks(p: Projection, kernel: str = "blocks") -> Projection:
    """``p``'s weight as Q4_1 blocks (runtime/model/blocks.py) on block kernel ``kernel``
    (``blocks_q8_split``: blocks_q8 with three input channels kept out of the rounding;
    ``<kernel>-<format>``: the weight quantized by gguf to that format instead)."""
    outliers = None
    kernel, _, kind = kernel.partition("-")
    if kernel == "blocks_q8_split":
        kernel, outliers = "blocks_q8", torch.tensor([1, 5, 40])
    w = p.weight.float()
    if kind:
        fmt = gguf.GGMLQuantizationType[kind]
        bw = BlockWeight.from_gguf(gguf.quants.quantize(w.numpy(), fmt), kind, tuple(w.shape))
    else:
        bw = BlockWeight.quantize_q4_1(w)
    proj = Projection(bw, p.bias, outliers=outliers)
    proj.use([kernel] * proj.buckets)
    return proj


@pytest.mark.parametrize("weights", ["int8", "int8_strips", "f32_strips", "blocks",
                                     "blocks_q8", "blocks_q8_split", "blocks-Q5_1",
                                     "blocks_q8_split-Q5_0"])
def test_int8_and_block_weights_match_the_eager_step(weights: str) -> None:
    hf = make_hf_model("qwen2", seed=7)  # q/k/v biases too
    if weights == "int8_strips" and not kernels.ops().int8_strips_native():
        pytest.skip("int8_strips needs AVX-512 VNNI")

    def make() -> ModelRunner:
        if weights in ("int8", "int8_strips", "f32_strips"):
            runner = make_runner(hf, num_pages=32)
            if weights != "f32_strips":
                runner = ModelRunner(runner.config, hf.state_dict(), runner.pool_kv, 16,
                                     weight_format="int8", calibration=random_tokens(64, seed=9))
            if weights.endswith("_strips"):  # strips_mm.cpp's kernel for every row count
                for lw in runner.model.layers:
                    for proj in (lw.qkv, lw.o_proj, lw.gate_up, lw.down):
                        proj.use([weights] * proj.buckets)
            return runner
        runner = make_runner(hf, num_pages=32)
        for lw in runner.model.layers:
            lw.qkv, lw.o_proj = _blocks(lw.qkv, weights), _blocks(lw.o_proj, weights)
            lw.gate_up, lw.down = _blocks(lw.gate_up, weights), _blocks(lw.down, weights)
        return runner

    fused, eager = _pair(make)
    twin = _Twin(fused, eager)
    a, b = twin.add(), twin.add()
    twin.step({a: random_tokens(30, seed=1), b: random_tokens(12, seed=2)})
    last = {a: 1, b: 2}
    for _ in range(3):
        last = dict(zip(last, twin.step({i: [t] for i, t in last.items()}), strict=True))
    twin.step({a: [last[a]]})  # one row: the 1-row bucket's kernels
    assert _steps(fused) == 4
    twin.check_pools()


def _round_adapters(runner: ModelRunner) -> None:
    """A runner's fused adapter weights rounded to bf16 (what the step reads)."""
    for f in runner._fused.values():
        for pairs in f.layers:
            for a, b in pairs.values():
                a.copy_(a.bfloat16().float())
                b.copy_(b.bfloat16().float())


def test_adapters_match_the_eager_deltas(tmp_path: Path) -> None:
    hf = make_hf_model("llama3", seed=8)
    make_adapter(hf, tmp_path / "a", rank=4, alpha=8, seed=5)
    make_adapter(hf, tmp_path / "b", rank=16, alpha=16, seed=6,
                 targets=["q_proj", "v_proj", "down_proj"])

    def make() -> ModelRunner:
        runner = make_runner(hf, num_pages=64)
        runner.load_adapter("a", str(tmp_path / "a"))
        runner.load_adapter("b", str(tmp_path / "b"))
        return runner

    fused, eager = _pair(make)
    ka, kb = (fused.adapters[n].key for n in ("a", "b"))
    plain = make()  # eager on the fp32 adapter weights, for the bf16 rounding's size
    plain._step = False
    _round_adapters(eager)
    _round_adapters(fused)  # its prefill runs eagerly
    twin = _Twin(fused, eager)
    seqs = [twin.add() for _ in range(5)]
    which = {0: ka, 2: kb, 3: ka, 4: kb}  # a, base, b, a, b: a's rows not contiguous
    twin.step({i: random_tokens(11 + i, seed=i) for i in seqs}, adapters=which)
    last = {i: i + 3 for i in seqs}
    for _ in range(3):  # mixed decode batches: one grouped delta kernel a projection
        toks = twin.step({i: [t] for i, t in last.items()}, adapters=which, tol=LORA_TOL)
        last = dict(zip(last, toks, strict=True))
    twin.step({0: [last[0]], 3: [last[3]]}, adapters=which, tol=LORA_TOL)  # one adapter
    assert _steps(fused) == 4
    twin.check_pools()
    # against the fp32 deltas: within bf16 rounding of the adapter weights
    seq = PagedSeq(plain, free_list(plain))
    fseq = PagedSeq(fused, free_list(fused, seed=1))
    toks = random_tokens(15, seed=9)
    for runner, s in ((plain, seq), (fused, fseq)):
        first = s.step(toks[:-1])
        first.adapter = ka
        runner.forward([first])
        s.advance(len(toks) - 1)
    outs = []
    for runner, s in ((plain, seq), (fused, fseq)):
        last_step = s.step(toks[-1:])
        last_step.adapter = ka
        outs.append(runner.forward([last_step]))
    assert (outs[0] - outs[1]).abs().max().item() <= 1e-2 * outs[0].abs().max().item()
    # an unloaded adapter leaves the step too
    fused.unload_adapter("b")
    assert not fused._step.has(kb) and fused._step.has(ka)


def test_adapters_in_the_step_follow_peft(tmp_path: Path) -> None:
    """End to end against peft on HF (test_lora.py's oracle), through the fused step."""
    hf = make_hf_model("qwen2", seed=1)
    oracle = make_adapter(hf, tmp_path / "a", rank=8, seed=2)
    runner = make_runner(hf, num_pages=32)
    key = runner.load_adapter("a", str(tmp_path / "a")).key
    tokens = random_tokens(20, seed=3)
    seq = PagedSeq(runner, free_list(runner))
    first = seq.step(tokens[:-1])
    first.adapter = key
    runner.forward([first])
    seq.advance(len(tokens) - 1)
    last = seq.step(tokens[-1:])
    last.adapter = key
    got = runner.forward([last])[0]
    assert _steps(runner) == 1
    with torch.no_grad():
        ref = oracle(torch.tensor([tokens])).logits[0, -1]
    err = (got - ref).abs().max().item()
    assert err <= PEFT_TOL * ref.abs().max().item(), err


def test_a_prefill_chunk_with_an_adapter_runs_eagerly(tmp_path: Path) -> None:
    """Under deterministic numerics the step takes prefill chunks, but not one with an
    adapter: its rows get the fp32 deltas of the eager forward (peft within fp32 noise),
    not the grouped kernel's bf16 ones. The same chunk without an adapter runs fused."""
    hf = make_hf_model("llama3", seed=9)
    oracle = make_adapter(hf, tmp_path / "a", rank=8, seed=3)
    runner = make_runner(hf, num_pages=32, deterministic=True)
    key = runner.load_adapter("a", str(tmp_path / "a")).key
    tokens = random_tokens(24, seed=4)
    free = free_list(runner)
    first = PagedSeq(runner, free).step(tokens, logits=[len(tokens) - 1])
    first.adapter = key
    got = runner.forward([first])[0]
    assert _steps(runner) == 0
    with torch.no_grad():
        ref = oracle(torch.tensor([tokens])).logits[0, -1]
    assert (got - ref).abs().max().item() <= 1e-4
    if runner._step.chunks:  # every chunk-bucket kernel has a C++ form
        PagedSeq(runner, free).run(tokens, logits=[len(tokens) - 1])
        assert _steps(runner) == 1


@pytest.mark.parametrize("kv", ["fp32", "bf16", "int8"])
def test_forks_of_a_long_shared_prefix_stay_on_the_cascade(kv: str, tmp_path: Path) -> None:
    """Forks past MAX_SHARED_PAGES run the eager cascade; a few short forks, one on an
    adapter, run the step (the eager side attends them through the cascade, so forked
    rows and the K/V after them differ in the last bits: within one rounding step)."""
    hf = make_hf_model("llama3", seed=9)
    make_adapter(hf, tmp_path / "a", rank=4, alpha=8, seed=5)

    def make() -> ModelRunner:
        runner = make_runner(hf, page_size=4, num_pages=96, kv_dtype=kv)
        runner.load_adapter("a", str(tmp_path / "a"))
        _round_adapters(runner)
        return runner

    fused, eager = _pair(make)
    key = fused.adapters["a"].key
    twin = _Twin(fused, eager)
    a = twin.add()
    twin.step({a: random_tokens(72, seed=4)})  # 18 full pages
    forks = [twin.add(fork_of=a, shared_pages=18) for _ in range(2)]
    twin.step({f: [i + 1] for i, f in enumerate(forks)} | {a: [3]})  # 36 re-reads: eager
    assert _steps(fused) == 0
    short = [twin.add(fork_of=a, shared_pages=3) for _ in range(2)]
    last = {f: i + 1 for i, f in enumerate(short)}
    for _ in range(2):  # 3 re-reads: fused
        last = dict(zip(last, twin.step({f: [t] for f, t in last.items()},
                                        adapters={short[0]: key}, tol=LORA_TOL), strict=True))
    assert _steps(fused) == 2
    twin.check_pools()


def test_blocks_q8_split_in_the_step_is_the_eager_bits() -> None:
    """blocks_q8 with its outlier split, q/k/v biases, the o and down projections added
    into the residual inside the kernel: the step's logits and K/V are the eager forward's
    bits (one op, the same arithmetic), for decode rows of two sequences and one."""
    hf = make_hf_model("qwen2", seed=8)

    def make() -> ModelRunner:
        runner = make_runner(hf, num_pages=32)
        for lw in runner.model.layers:
            lw.qkv, lw.o_proj = _blocks(lw.qkv, "blocks_q8_split"), _blocks(lw.o_proj,
                                                                             "blocks_q8_split")
            lw.gate_up = _blocks(lw.gate_up, "blocks_q8_split")
            lw.down = _blocks(lw.down, "blocks_q8_split")
        return runner

    fused, eager = _pair(make)
    twin = _Twin(fused, eager)
    a, b = twin.add(), twin.add()
    twin.step({a: random_tokens(20, seed=3), b: random_tokens(9, seed=4)}, tol=0.0)
    last = {a: 1, b: 2}
    for _ in range(3):
        last = dict(zip(last, twin.step({i: [t] for i, t in last.items()}, tol=0.0),
                        strict=True))
    twin.step({a: [last[a]]}, tol=0.0)
    assert _steps(fused) == 4
    twin.check_pools(tol=0.0)
