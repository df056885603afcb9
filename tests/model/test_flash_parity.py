"""flash-attn backend vs torch backend (skipped without CUDA + flash-attn), and selection."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny_models import PagedSeq, config_of, free_list, make_hf_model, random_tokens

from runtime.model.attention import select_backend
from runtime.model.attention.torch_backend import TorchAttention
from runtime.model.runner import ModelRunner


def test_cpu_selects_torch_backend() -> None:
    assert select_backend(torch.device("cpu"), torch.float32, 16).name == "torch"


def _flash_ok() -> bool:
    if not torch.cuda.is_available():
        return False
    from runtime.model.attention.flash_backend import flash_available

    return flash_available(torch.device("cuda"), torch.bfloat16)


cuda_flash = pytest.mark.skipif(not _flash_ok(), reason="needs CUDA sm80+ and flash-attn")


def _pair(page_size: int) -> tuple[ModelRunner, ModelRunner]:
    from runtime.model.attention.flash_backend import FlashAttention

    model = make_hf_model("qwen3", seed=3)
    cfg = config_of(model)
    runners = []
    for backend in (FlashAttention(page_size), TorchAttention()):
        pool = torch.zeros(48, page_size, cfg.num_layers, 2, cfg.num_kv_heads, cfg.head_dim,
                           dtype=torch.bfloat16, device="cuda")
        runners.append(ModelRunner(cfg, model.state_dict(), pool, page_size, backend=backend))
    return runners[0], runners[1]


@cuda_flash
@pytest.mark.cuda
@pytest.mark.parametrize("page_size", [16, 256])
def test_flash_matches_torch_on_mixed_batches(page_size: int) -> None:
    flash, ref = _pair(page_size)
    assert flash.backend.name == ("flash-paged" if page_size == 256 else "flash-varlen")
    prompts = [random_tokens(n, seed=n) for n in (1, 9, 40, 300)]
    outs = []
    for runner in (flash, ref):
        free = free_list(runner, seed=1)
        seqs = [PagedSeq(runner, free) for _ in prompts]
        steps = [runner.forward([s.step(p[: len(p) // 2 or 1]) for s, p in zip(seqs, prompts, strict=True)])]
        for s, p in zip(seqs, prompts, strict=True):
            s.advance(len(p) // 2 or 1)
        batch = [s.step(p[len(p) // 2 or 1:] or [5]) for s, p in zip(seqs, prompts, strict=True)]
        steps.append(runner.forward(batch))
        outs.append(torch.cat(steps).float())
    assert (outs[0] - outs[1]).abs().max().item() < 5e-2 * outs[1].abs().max().item()


@cuda_flash
@pytest.mark.cuda
def test_flash_delegates_custom_masks_to_torch() -> None:
    flash, ref = _pair(16)
    toks = random_tokens(6, seed=2)
    mask = np.ones((6, 6), dtype=np.bool_)
    got = PagedSeq(flash, free_list(flash)).run(toks, mask=mask)
    want = PagedSeq(ref, free_list(ref)).run(toks, mask=mask)
    assert torch.equal(got, want)
