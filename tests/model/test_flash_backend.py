"""The flash-attn backend against the torch backend, in half precision.

Every scenario runs twice: on CPU with a model of flash-attn's kernel
(tests/model/fake_flash_attn.py: the documented contract, refusing what the real kernel
refuses), which checks our grouping, page gathers, block tables, causal alignment and
log-sum-exp layout in every CI run; and on CUDA with the real flash-attn, marked ``cuda``
and skipped without a GPU (``make gpu-check`` runs them). Both page sizes: 16 (gather) and
256 (paged, read in place).

Tolerance: two attention implementations in one dtype differ by rounding only; logits
may move by ``TOL[dtype]`` of the batch's max |logit| (bf16 3%, fp16 0.4%; the old flash
test allowed 5% for both). Measured on CPU: bf16 at most 1.8%, fp16 0.25%, each less than
either backend's own distance from the fp32 run (bf16 ~2.7%, fp16 ~0.35%).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from fake_flash_attn import flash_attn_with_kvcache as cpu_model_of_flash
from tiny_models import PagedSeq, config_of, free_list, make_hf_model, random_tokens

from runtime.kv.pool import PagePool, PoolShape
from runtime.model.attention import select_backend
from runtime.model.attention.torch_backend import TorchAttention
from runtime.model.runner import ModelRunner

TOL = {torch.bfloat16: 2.0**-5, torch.float16: 2.0**-8}


def _real_flash() -> bool:
    if not torch.cuda.is_available():
        return False
    from runtime.model.attention.flash_backend import flash_available

    return flash_available(torch.device("cuda"), torch.bfloat16, 128)


cuda_flash = pytest.mark.skipif(not _real_flash(), reason="needs CUDA sm80+ and flash-attn")


@pytest.fixture(params=[pytest.param("cpu", id="cpu-model-of-flash"),
                        pytest.param("cuda", marks=[pytest.mark.cuda, cuda_flash], id="cuda")])
def device(request: pytest.FixtureRequest) -> torch.device:
    return torch.device(request.param)


def _pair(device: torch.device, dtype: torch.dtype, page_size: int, num_pages: int,
          model: torch.nn.Module | None = None,
          kv_dtype: str = "fp32") -> tuple[ModelRunner, ModelRunner]:
    """Two runners on the same weights: flash-attn first (its CPU model on CPU), torch
    second."""
    from runtime.model.attention.flash_backend import FlashAttention

    model = model or make_hf_model("qwen3", seed=3)
    cfg = config_of(model)
    weights = {k: v.to(device) for k, v in model.state_dict().items()}
    kernel = cpu_model_of_flash if device.type == "cpu" else None
    runners = []
    for backend in (FlashAttention(page_size, kernel=kernel), TorchAttention()):
        pool = PagePool(PoolShape(num_pages, page_size, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim,
                        dtype=dtype, device=device, kv_dtype=kv_dtype))
        runners.append(ModelRunner(cfg, weights, pool.kv, page_size, backend=backend,
                                   dtype=dtype))
    return runners[0], runners[1]


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    got, want = got.float().cpu(), want.float().cpu()
    assert got.shape == want.shape
    scale = max(want.abs().max().item(), 1.0)
    assert (got - want).abs().max().item() <= TOL[dtype] * scale


def _both(flash: ModelRunner, ref: ModelRunner, scenario, *args) -> None:
    """Run ``scenario(runner, *args)`` on both runners; every returned step must agree."""
    got, want = scenario(flash, *args), scenario(ref, *args)
    for g, w in zip(got, want, strict=True):
        _close(g, w, flash.dtype)


def _groups(runner: ModelRunner) -> list:
    """Record the flash plan of each following forward."""
    seen = []
    prepare = runner.backend.prepare

    def spy(meta, pool):
        prepare(meta, pool)
        seen.append(meta.backend_state)
    runner.backend.prepare = spy
    return seen


def mixed(runner: ModelRunner, seed: int = 1) -> list[torch.Tensor]:
    """Fresh prefills, a prefill over a cached prefix, and decodes, all in one forward."""
    prompts = [random_tokens(n, seed=n) for n in (1, 9, 40, 300)]
    free = free_list(runner, seed=seed)
    seqs = [PagedSeq(runner, free) for _ in prompts]
    steps = [runner.forward([s.step(p[: len(p) // 2 or 1]) for s, p in zip(seqs, prompts, strict=True)])]
    for s, p in zip(seqs, prompts, strict=True):
        s.advance(len(p) // 2 or 1)
    steps.append(runner.forward([s.step(p[len(p) // 2 or 1:] or [5])
                                 for s, p in zip(seqs, prompts, strict=True)]))
    return steps


def decode_only(runner: ModelRunner) -> list[torch.Tensor]:
    """Every query of length 1, over unequal contexts (flash-attn's separate decode path)."""
    lengths = (3, 40, 17, 300)
    free = free_list(runner, seed=2)
    seqs = [PagedSeq(runner, free) for _ in lengths]
    for s, n in zip(seqs, lengths, strict=True):
        s.run(random_tokens(n, seed=n))
    return _decode_steps(runner, seqs, 3)


def _decode_steps(runner: ModelRunner, seqs: list[PagedSeq], n: int) -> list[torch.Tensor]:
    """``n`` steps in which every sequence decodes one token."""
    steps = []
    for k in range(n):
        steps.append(runner.forward([s.step([7 + k]) for s in seqs]))
        for s in seqs:
            s.advance(1)
    return steps


def forks(runner: ModelRunner, masked: bool = False) -> list[torch.Tensor]:
    """Forks with unequal tails decoding together (a cascade), beside another sequence, or
    beside one whose pass has a custom mask."""
    ps = runner.page_size
    free = free_list(runner, seed=3)
    prompt = random_tokens(2 * ps, seed=80)  # two full pages every fork shares
    parent = PagedSeq(runner, free)
    parent.run(prompt)
    tails = [random_tokens(k, seed=90 + k) for k in (2, 7, 19)]
    kids = [PagedSeq(runner, free, pages=list(parent.pages), num_cached=2 * ps) for _ in tails]
    for f, t in zip(kids, tails, strict=True):
        f.run(t[:-1])
    other = PagedSeq(runner, free)
    other_prompt = random_tokens(12, seed=40)
    other.run(other_prompt[:5])
    extra = other.step(other_prompt[5:])
    if masked:  # a tree: each new token sees the prefix and every other token of the pass
        n = len(other_prompt) - 5
        extra.mask = np.concatenate([np.ones((n, 5), bool), np.tri(n, dtype=bool) | ~np.eye(n, dtype=bool)[::-1]], axis=1)
    batch = [f.step(t[-1:]) for f, t in zip(kids, tails, strict=True)] + [extra]
    return [runner.forward(batch)]


def consecutive(runner: ModelRunner) -> list[torch.Tensor]:
    """Sequences on consecutive page ids: a lone one is read in place (gather path)."""
    free = list(range(runner.num_pages))[::-1]
    seq = PagedSeq(runner, free)
    prompt = random_tokens(70, seed=50)
    return [seq.run(prompt[:60]), seq.run(prompt[60:61]), seq.run(prompt[61:])]


def run_prefix(runner: ModelRunner) -> list[torch.Tensor]:
    """The engine's usual table: a run of consecutive committed pages, then a page from
    elsewhere; a chunk and then decodes over it (the run read in place, the rest gathered)."""
    ps = runner.page_size
    free = list(range(runner.num_pages))[::-1]  # pop() hands out 0, 1, 2, ...
    seq = PagedSeq(runner, free)
    n = 6 * ps + 9
    prompt = random_tokens(n, seed=70)
    steps = [seq.run(prompt[:5 * ps])]  # pages 0..4: one run
    seq.pages += [runner.num_pages - 1, runner.num_pages - 3]  # tail pages from elsewhere
    steps.append(seq.run(prompt[5 * ps:n - 2]))
    steps += [seq.run(prompt[j:j + 1]) for j in range(n - 2, n)]
    return steps


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("page_size", [16, 256])
@pytest.mark.parametrize("scenario", [mixed, decode_only, forks, consecutive, run_prefix],
                         ids=lambda f: f.__name__)
def test_flash_matches_torch(device, dtype, page_size, scenario) -> None:
    flash, ref = _pair(device, dtype, page_size, num_pages=4096 // page_size)
    assert flash.backend.name == ("flash-paged" if page_size == 256 else "flash-gather")
    _both(flash, ref, scenario)


@pytest.mark.parametrize("page_size", [16, 256])
def test_forks_attend_as_a_cascade_and_masks_go_to_torch(device, page_size) -> None:
    from runtime.model.attention.flash_backend import _Cascade, _Group

    flash, ref = _pair(device, torch.bfloat16, page_size, num_pages=4096 // page_size)
    plans = _groups(flash)
    _both(flash, ref, forks, True)
    plan = plans[-1]
    assert [type(g) for g in plan.flash] == [_Cascade]  # the three forks; the masked one:
    assert len(plan.torch_state) == 1 and not plan.delegate_all
    forks(flash, False)
    assert [type(g) for g in plans[-1].flash] == [_Cascade, _Group]
    assert plans[-1].torch_state is None


def test_a_run_prefix_is_read_in_place_and_merged_through_the_lse(device) -> None:
    """Page size 16: a chunk and lone decodes over a run of pages plus two stray tail pages
    attend the run in place and gather only the tail; the scratch buffer holds two pages
    (of K and of V)."""
    from runtime.model.attention.flash_backend import _RunSplit

    flash, ref = _pair(device, torch.bfloat16, 16, num_pages=256)
    plans = _groups(flash)
    _both(flash, ref, run_prefix)
    assert all(isinstance(p.flash[0], _RunSplit) for p in plans[1:])
    assert plans[1].flash[0].head.run_start == 0
    assert plans[1].flash[0].tail.page_index.numel() == 2  # the gathered part: two pages
    assert flash.backend.scratch_bytes == 2 * 2 * flash.pool_kv[0, :, 0, 0].numel() * 2


def test_an_fp32_pool_uses_torch_attention_throughout(device) -> None:
    flash, ref = _pair(device, torch.float32, 16, num_pages=256)
    out, want = mixed(flash), mixed(ref)
    for g, w in zip(out, want, strict=True):
        torch.testing.assert_close(g, w)


def test_an_int8_pool_uses_torch_attention_throughout(device) -> None:
    flash, ref = _pair(device, torch.bfloat16, 16, num_pages=256, kv_dtype="int8")
    plans = _groups(flash)
    out, want = mixed(flash), mixed(ref)
    assert plans and all(p.delegate_all for p in plans)
    for g, w in zip(out, want, strict=True):
        torch.testing.assert_close(g, w)


def test_backend_selection(monkeypatch) -> None:
    from runtime.model.attention import flash_backend

    monkeypatch.delenv("PIE_CTX_ATTENTION", raising=False)
    assert select_backend(torch.device("cpu"), torch.float32, 16, 64).name == "torch"
    assert select_backend(torch.device("cpu"), torch.bfloat16, 256, 64).name == "torch"
    monkeypatch.setattr(flash_backend, "flash_available", lambda *a: True)
    monkeypatch.setattr(flash_backend, "_import_kvcache", lambda: cpu_model_of_flash)
    cuda = torch.device("cuda")
    assert select_backend(cuda, torch.bfloat16, 16, 64).name == "flash-gather"
    assert select_backend(cuda, torch.bfloat16, 16, 64, "int8").name == "torch"


def test_flash_is_only_offered_for_head_dims_it_runs_without_a_copy(monkeypatch) -> None:
    from runtime.model.attention import flash_backend

    monkeypatch.setattr(flash_backend, "_import_kvcache", lambda: cpu_model_of_flash)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    cuda = torch.device("cuda")
    assert flash_backend.flash_available(cuda, torch.bfloat16, 128)
    assert not flash_backend.flash_available(cuda, torch.bfloat16, 320)  # over 256
    assert not flash_backend.flash_available(cuda, torch.bfloat16, 100)  # not a multiple of 8
    assert not flash_backend.flash_available(cuda, torch.float32, 128)  # flash-attn: half only
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    assert not flash_backend.flash_available(cuda, torch.bfloat16, 128)  # before Ampere


# ---------------------------------------------------------------------------- CUDA only


def long_model() -> torch.nn.Module:
    """A GQA model with head dim 128 (the common real shape) for contexts up to 9k."""
    return make_hf_model("llama3", seed=5, hidden_size=512, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=512,
                         max_position_embeddings=9000)


def long_decodes(runner: ModelRunner) -> list[torch.Tensor]:
    """Contexts of 1k-8k tokens prefilled in chunks of 2,048, then 4 decode steps."""
    free = free_list(runner, seed=4)
    lengths = (1024, 3000, 8000, 5555)
    seqs = [PagedSeq(runner, free) for _ in lengths]
    for s, n in zip(seqs, lengths, strict=True):
        toks = random_tokens(n, seed=n)
        for a in range(0, n, 2048):
            s.run(toks[a:a + 2048], logits=[0])
    return _decode_steps(runner, seqs, 4)


@pytest.mark.cuda
@cuda_flash
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("page_size", [16, 256])
def test_gqa_head_dim_128_over_long_unequal_contexts(page_size, dtype) -> None:
    """Decoding over contexts of 1k-8k tokens, prefilled in chunks: flash-attn against
    torch, both page sizes, bf16 and fp16."""
    flash, ref = _pair(torch.device("cuda"), dtype, page_size,
                       num_pages=40_000 // page_size, model=long_model())
    _both(flash, ref, long_decodes)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_torch_backend_keeps_a_fused_sdpa_kernel_with_masks_and_gqa(dtype) -> None:
    """Masked GQA batches (custom masks, unequal decodes, fp32) must not fall back to SDPA's
    math kernel: with the math kernel disabled, they still run."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model = make_hf_model("qwen3", seed=3)
    cfg = config_of(model)
    weights = {k: v.cuda() for k, v in model.state_dict().items()}
    pool = torch.zeros(256, 16, cfg.num_layers, 2, cfg.num_kv_heads, cfg.head_dim,
                       dtype=dtype, device="cuda")
    runner = ModelRunner(cfg, weights, pool, 16, backend=TorchAttention())
    fused = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
    with sdpa_kernel(fused):
        forks(runner, True)
        decode_only(runner)


def test_the_kernel_report_names_a_fused_kernel_for_every_path(tmp_path) -> None:
    """scripts/attention_kernels.py (run by ``make gpu-check``) on CPU in bf16: every path
    reports its groups and a fused attention kernel, never SDPA's math kernel."""
    import json
    import subprocess

    from tests.sdk.harness import tiny_model_folder

    folder = tiny_model_folder(tmp_path)
    script = Path(__file__).resolve().parents[2] / "scripts" / "attention_kernels.py"
    out = subprocess.run([sys.executable, str(script), "--device", "cpu",
                          "--dtype", "bfloat16", "--model", str(folder)],
                         capture_output=True, text=True, check=True, timeout=300)
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["backend"] == "torch" and report["dtype"] == "bfloat16"
    assert set(report["paths"]) == {"prefill", "chunk over a cached prefix",
                                    "decodes, unequal lengths", "forks decoding together",
                                    "custom mask"}
    assert report["paths"]["forks decoding together"]["groups"] == ["CascadeGroup"]
    for path in report["paths"].values():
        assert any("flash_attention" in k for k in path["kernels"]), path
        assert not any("math" in k for k in path["kernels"]), path
