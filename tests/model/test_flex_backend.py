"""The FlexAttention backend against fp32 dense attention and the torch backend.

Per layer (tests/model/attention_oracle.py): one batch with every path (fresh prefill,
a chunk over a cached prefix, unequal decodes, forks, a custom mask) on shuffled pages,
half-precision inputs, output against fp32 attention over the same half inputs:
``TOL = 2e-2`` absolute on outputs of scale ~1 (measured on CPU: bf16 <= 9e-3 for flex,
<= 1.05e-2 for torch; fp16 <= 1.1e-3), while a row missing its newest key is off by 3.8
or more, so the test tells a wrong key from rounding. Page sizes 16 and 256, GQA and not, head dims 64 and
128 (paired so that each value meets the others); the torch backend runs the same
checks. Through the runner: flex against the dense reference model on chunked
prefills, forks and masks (fp32), and the cascade plan (flex's eager kernel, which
returns the log-sum-exp on CPU as the compiled one does on CUDA).

Compiles: each (dtype, heads, head dim, page size, one query or several, mask kind) is
compiled once per process, and inductor keeps them on disk between runs.
"""

from __future__ import annotations

import pytest
import torch
from attention_oracle import dense, scenario
from tiny_models import PagedSeq, config_of, free_list, make_hf_model, random_tokens

from pie_ctx.errors import InvalidArgument
from runtime.kv.pool import PagePool, PoolShape
from runtime.model.attention import select_backend
from runtime.model.attention.flex_backend import FlexAttention, _Cascade
from runtime.model.attention.torch_backend import TorchAttention
from runtime.model.reference import dense_forward
from runtime.model.runner import ModelRunner

TOL = 2e-2
SHAPES = [  # (page size, heads, kv heads, head dim): each value meets the others
    pytest.param((16, 4, 2, 64), id="ps16-gqa-d64"),
    pytest.param((256, 4, 2, 128), id="ps256-gqa-d128"),
    pytest.param((16, 2, 2, 128), id="ps16-mha-d128"),
    pytest.param((256, 2, 2, 64), id="ps256-mha-d64"),
]


def _layer(backend, shape, dtype=torch.bfloat16):
    page_size, h, kvh, d = shape
    pool, meta, q, kv = scenario(page_size, h, kvh, d, dtype)
    backend.prepare(meta, pool)
    with torch.inference_mode():
        out = backend.forward(1, q, kv, pool, meta)
    return out.float(), dense(pool, 1, q, meta), dense(pool, 1, q, meta, drop_newest=True), meta


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("backend", ["flex", "torch"])
def test_one_layer_against_fp32_dense_attention(shape, backend) -> None:
    be = FlexAttention(shape[0]) if backend == "flex" else TorchAttention()
    out, want, wrong, meta = _layer(be, shape)
    assert (out - want).abs().max().item() <= TOL
    assert (out - wrong).abs().max().item() > 5 * TOL  # a missing key is not noise
    if backend == "flex":  # compiled on CPU: no log-sum-exp, so forks read in place
        assert not any(isinstance(c, _Cascade) for c in meta.backend_state.calls)


def test_one_layer_in_fp16() -> None:
    """fp16 as well as bf16 (fp32 runs through the runner below: its compile alone takes
    a minute on a 2-core machine at head dim 64)."""
    out, want, wrong, _ = _layer(FlexAttention(16), (16, 4, 2, 64), torch.float16)
    assert (out - want).abs().max().item() <= TOL
    assert (out - wrong).abs().max().item() > 5 * TOL


def test_the_cascade_merges_shared_and_tail_through_the_lse() -> None:
    """Where flex returns the log-sum-exp (CUDA; here its eager kernel), forks attend their
    shared pages once and their tails apart, merged in fp32."""
    out, want, wrong, meta = _layer(FlexAttention(16, compiled=False), (16, 4, 2, 64))
    cascades = [c for c in meta.backend_state.calls if isinstance(c, _Cascade)]
    assert len(cascades) == 1 and cascades[0].tails.batch == 3
    assert (out - want).abs().max().item() <= TOL
    assert (out - wrong).abs().max().item() > 5 * TOL


# ------------------------------------------------------------------- through the runner


@pytest.fixture(scope="module")
def hf_model() -> torch.nn.Module:
    return make_hf_model("llama3", seed=7, num_layers=2)


def _runner(model, backend, page_size=16, kv_dtype="fp32") -> ModelRunner:
    cfg = config_of(model)
    pool = PagePool(PoolShape(96, page_size, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim,
                    kv_dtype=kv_dtype))
    return ModelRunner(cfg, model.state_dict(), pool.kv, page_size, backend=backend)


def _close(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-4) -> None:
    assert a.shape == b.shape and (a - b).abs().max().item() <= tol


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "eager-cascade"])
def test_runner_forks_masks_and_chunks_match_dense_and_torch(hf_model, compiled) -> None:
    import numpy as np

    flex = _runner(hf_model, FlexAttention(16, compiled=compiled))
    ref = _runner(hf_model, TorchAttention())
    outs = []
    for runner in (flex, ref):
        free = free_list(runner, seed=6)
        prompt = random_tokens(37, seed=21)
        parent = PagedSeq(runner, free)
        got = [parent.run(prompt[:20]), parent.run(prompt[20:32])]  # two chunks
        forks = [PagedSeq(runner, free, pages=list(parent.pages), num_cached=32)
                 for _ in range(3)]
        tails = [prompt[32:] + random_tokens(2 + 5 * i, seed=30 + i) for i in range(3)]
        for f, t in zip(forks, tails, strict=True):
            f.run(t[:-1])
        other = PagedSeq(runner, free)
        other.run(random_tokens(9, seed=40))
        mask = np.ones((4, 13), dtype=np.bool_)
        mask[:, 9:] = np.tril(np.ones((4, 4), dtype=np.bool_))
        mask[1:, 3] = False
        got.append(runner.forward([f.step(t[-1:]) for f, t in zip(forks, tails, strict=True)]
                                  + [other.step(random_tokens(4, seed=41), mask=mask)]))
        outs.append((got, tails, prompt))
    (got, tails, prompt), (want, _, _) = outs
    for g, w in zip(got, want, strict=True):
        _close(g, w)
    _close(torch.cat(got[:2]), dense_forward(flex.model, prompt[:32]))
    for i, t in enumerate(tails):
        _close(got[2][i:i + 1], dense_forward(flex.model, prompt[:32] + t)[-1:])


def test_an_int8_pool_is_attended_by_the_torch_backend(hf_model) -> None:
    flex = _runner(hf_model, FlexAttention(16), kv_dtype="int8")
    ref = _runner(hf_model, TorchAttention(), kv_dtype="int8")
    tokens = random_tokens(21, seed=3)
    got = PagedSeq(flex, free_list(flex, seed=1)).run(tokens)
    want = PagedSeq(ref, free_list(ref, seed=1)).run(tokens)
    torch.testing.assert_close(got, want)


def test_selection_by_name_and_by_measurement(monkeypatch) -> None:
    cpu = torch.device("cpu")
    monkeypatch.delenv("PIE_CTX_ATTENTION", raising=False)
    assert select_backend(cpu, torch.float32, 16, 64).name == "torch"  # CPU default
    monkeypatch.setenv("PIE_CTX_ATTENTION", "flex")
    assert select_backend(cpu, torch.float32, 16, 64).name == "flex"
    assert select_backend(cpu, torch.float32, 16, 64, choice="torch").name == "torch"
    with pytest.raises(InvalidArgument, match="flash-attn cannot run here"):
        select_backend(cpu, torch.bfloat16, 16, 64, choice="flash")
    with pytest.raises(InvalidArgument, match="pick one of"):
        select_backend(cpu, torch.bfloat16, 16, 64, choice="fast")
    # measurement: the faster candidate wins, whichever it is
    from runtime.model.attention import measure

    monkeypatch.setattr(measure, "measure_backends",
                        lambda c, *a: {"flex": 2.0, "torch": 1.0})
    assert select_backend(cpu, torch.float32, 16, 64, choice="measure").name == "torch"
    monkeypatch.setattr(measure, "measure_backends",
                        lambda c, *a: {"flex": 1.0, "torch": 2.0})
    assert select_backend(cpu, torch.float32, 16, 64, choice="measure").name == "flex"
    assert select_backend(cpu, torch.float32, 16, 64, "int8", choice="measure").name == "torch"


def test_the_measurement_times_both_backends() -> None:
    from runtime.model.attention.measure import measure_backends

    scores = measure_backends({"flex": lambda: FlexAttention(16), "torch": TorchAttention},
                              torch.device("cpu"), torch.bfloat16, 16, 4, 2, 64, repeats=1)
    assert set(scores) == {"flex", "torch"} and all(v > 0 for v in scores.values())


# ------------------------------------------------------------------------- CUDA graphs


def _graph_steps(runner: ModelRunner, steps: int = 3) -> list[torch.Tensor]:
    """Greedy decode of 5 sequences (3 of them forks) for ``steps`` steps: the logits."""
    free = free_list(runner, seed=2)
    prompt = random_tokens(40, seed=5)
    parent = PagedSeq(runner, free)
    parent.run(prompt[:32])
    seqs = [PagedSeq(runner, free, pages=list(parent.pages), num_cached=32) for _ in range(3)]
    seqs += [PagedSeq(runner, free) for _ in range(2)]
    last = []
    for i, s in enumerate(seqs):
        last.append(int(s.run(random_tokens(3 + 7 * i, seed=50 + i))[-1].argmax()))
    out = []
    for _ in range(steps):
        logits = runner.forward([s.step([t]) for s, t in zip(seqs, last, strict=True)])
        for s in seqs:
            s.advance(1)
        last = logits.argmax(-1).tolist()
        out.append(logits)
    return out


def test_decode_steps_through_the_static_path_equal_the_plain_forward(hf_model) -> None:
    """The CUDA-graph path without the graph (CPU): 5 rows padded to a bucket of 8 by
    copies of row 0, block masks refilled in place, same logits as the plain forward."""
    from runtime.model.cuda_graphs import DecodeGraphs

    plain = _runner(hf_model, FlexAttention(16))
    static = _runner(hf_model, FlexAttention(16))
    static.graphs = DecodeGraphs(static, capture=False)
    for got, want in zip(_graph_steps(static), _graph_steps(plain), strict=True):
        _close(got, want, 1e-5)
    assert static.graphs.replays == 3 and list(static.graphs._slots) == [8]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_cuda_graphs_decode_the_same_tokens(monkeypatch, dtype) -> None:
    monkeypatch.setenv("PIE_CTX_CUDA_GRAPHS", "1")
    model = make_hf_model("llama3", seed=7, num_layers=2)
    cfg = config_of(model)
    weights = {k: v.cuda() for k, v in model.state_dict().items()}
    runners = []
    for _ in range(2):
        pool = PagePool(PoolShape(96, 16, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype=dtype,
                        device="cuda"))
        runners.append(ModelRunner(cfg, weights, pool.kv, 16, backend=FlexAttention(16),
                                   dtype=dtype))
    graphs, plain = runners
    plain.graphs = None
    assert graphs.graphs is not None
    got, want = _graph_steps(graphs, 6), _graph_steps(plain, 6)
    assert graphs.graphs.replays == 6 and graphs.graphs._slots[8].graph is not None
    for g, w in zip(got, want, strict=True):
        assert g.argmax(-1).tolist() == w.argmax(-1).tolist()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("page_size", [16, 256])
def test_flex_on_cuda_over_long_unequal_contexts(page_size, dtype) -> None:
    """The long test of test_flash_backend.py with flex (compiled Triton, the cascade
    through the log-sum-exp) against the torch backend on CUDA."""
    from test_flash_backend import TOL as HALF_TOL
    from test_flash_backend import long_decodes, long_model

    model = long_model()
    cfg = config_of(model)
    weights = {k: v.cuda() for k, v in model.state_dict().items()}
    runners = []
    for backend in (FlexAttention(page_size), TorchAttention()):
        pool = PagePool(PoolShape(40_000 // page_size, page_size, cfg.num_layers, cfg.num_kv_heads,
                        cfg.head_dim, dtype=dtype, device="cuda"))
        runners.append(ModelRunner(cfg, weights, pool.kv, page_size, backend=backend,
                                   dtype=dtype))
    got, want = long_decodes(runners[0]), long_decodes(runners[1])
    for g, w in zip(got, want, strict=True):
        scale = max(w.abs().max().item(), 1.0)
        assert (g.float() - w.float()).abs().max().item() <= HALF_TOL[dtype] * scale
