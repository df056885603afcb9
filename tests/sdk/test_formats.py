"""Engines with int8 or GGUF-block weights, int8 or bf16 KV pages: what the SDK and the CLI
see (the numerics are tested in tests/model/test_int8*.py, tests/model/test_blocks.py and,
for KV pages, tests/model/test_attention.py)."""

from __future__ import annotations

import logging

import pytest
import torch

from pie_ctx import Context, Sampler
from pie_ctx.errors import InvalidArgument
from runtime.boot import boot_engine, pool_pages_for
from runtime.cli import main as cli_main
from runtime.model.loader import load_model
from tests.sdk.harness import sdk_runtime


@pytest.mark.no_tp("int8 weights run on one device")
@pytest.mark.native_only("int8 weights are a format of the native runner")
async def test_int8_weights_engine_serves_and_reports_it(tiny_folder, transport):
    async with sdk_runtime(tiny_folder, transport, weights="int8") as (rt, engine):
        assert rt.info.weights == "int8" and rt.info.dtype == tiny_folder.dtype
        base = Context(rt).user("hi").cue()
        await base.flush()
        a, b = base.fork(), base.fork()
        out_a = await a.generate(Sampler.greedy(), max_tokens=6, ignore_eos=True).tokens()
        out_b = await b.generate(Sampler.greedy(), max_tokens=6, ignore_eos=True).tokens()
        assert out_a == out_b and len(out_a) == 6  # deterministic, fork shares the prefix
        engine.store.check_invariants()


async def test_default_engine_is_fp32_weights_and_pages(tiny_folder):
    async with sdk_runtime(tiny_folder) as (rt, _):
        assert rt.info.weights == "fp32" and rt.info.kv_dtype == "fp32"


async def test_int8_pages_fork_snapshot_and_prefix_reuse(tiny_folder, transport):
    """Everything that moves pages works on int8 pages: the same tokens come back whether a
    continuation runs fresh, from a fork (cascade), from a reused prefix or a snapshot."""
    async with sdk_runtime(tiny_folder, transport, kv_dtype="int8") as (rt, engine):
        assert rt.info.kv_dtype == "int8" and rt.info.dtype == tiny_folder.dtype
        assert engine.store.pool.kv.dtype.is_floating_point is False
        await _continuations_agree(rt, engine, forks=3)


@pytest.mark.no_tp("GGUF block weights run on one device")
@pytest.mark.native_only("GGUF block weights are a format of the native runner")
async def test_gguf_weights_and_bf16_pages_serve_forks_and_snapshots(tiny_folder, transport):
    """An HF folder with weights="gguf" runs on Q4_1 blocks made at load; with bf16 pages a
    fork, a reused prefix and a snapshot continue exactly as a fresh context does."""
    async with sdk_runtime(tiny_folder, transport, weights="gguf",
                           kv_dtype="bf16") as (rt, engine):
        assert rt.info.weights == "gguf" and rt.info.kv_dtype == "bf16"
        assert engine.store.pool.kv.dtype == torch.bfloat16
        await _continuations_agree(rt, engine, forks=2)


@pytest.mark.no_tp("GGUF block weights run on one device")
@pytest.mark.native_only("GGUF block weights are a format of the native runner")
@pytest.mark.parametrize(("weights", "pages"), [("gguf", "bf16"), ("fp32", "fp32")])
def test_auto_pages_are_bf16_beside_gguf_blocks(tiny_folder, weights, pages):
    """``kv_dtype="auto"`` (``run`` and ``serve``'s default, ``--kv-dtype auto``): bf16 pages
    with the GGUF's blocks (llama.cpp's f16 KV), else fp32 pages."""
    engine = boot_engine(str(tiny_folder), weights=weights, kv_dtype="auto", num_pages=8,
                         progress=False)
    assert engine.info().kv_dtype == pages
    assert cli_main(["run", "examples/hello.py", "--model", str(tiny_folder), "--page-size", "4",
                     "--weights", weights, "--", "hi", "--max-tokens", "2"]) == 0


def test_bf16_pages_fit_twice_the_fp32_pages(tiny_folder):
    cfg = load_model(str(tiny_folder), progress=False).config
    fp32 = pool_pages_for(cfg, 16, torch.float32, 1.0)
    assert pool_pages_for(cfg, 16, torch.float32, 1.0, "bf16") == pytest.approx(2 * fp32, abs=1)


def test_int8_pages_fit_more_in_the_same_memory(tiny_folder):
    cfg = load_model(str(tiny_folder), progress=False).config
    fp32 = pool_pages_for(cfg, 16, torch.float32, 1.0)
    int8 = pool_pages_for(cfg, 16, torch.float32, 1.0, "int8")
    d = cfg.head_dim
    assert int8 / fp32 == pytest.approx(4 * d / (d + 4), rel=0.01)


def test_unknown_formats_are_refused(tiny_folder):
    with pytest.raises(InvalidArgument, match="weights must be one of fp32, int8, gguf"):
        boot_engine(str(tiny_folder), weights="int4", progress=False)
    with pytest.raises(InvalidArgument, match="kv_dtype must be one of fp32, int8, bf16 or auto"):
        boot_engine(str(tiny_folder), kv_dtype="fp8", progress=False)


def test_cli_run_with_int8_weights(tiny_folder):
    assert cli_main(["run", "examples/hello.py", "--model", str(tiny_folder), "--page-size", "4",
                     "--dtype", tiny_folder.dtype, "--weights", "int8", "--", "hi",
                     "--max-tokens", "4"]) == 0


def test_cli_run_with_int8_pages(tiny_folder):
    assert cli_main(["run", "examples/hello.py", "--model", str(tiny_folder), "--page-size", "4",
                     "--dtype", tiny_folder.dtype, "--kv-dtype", "int8", "--", "hi",
                     "--max-tokens", "4"]) == 0


async def _continuations_agree(rt, engine, forks: int) -> None:
    """The same 8 greedy tokens from ``forks`` forks of a flushed prompt (cascade), from a
    fresh context (its prefix pages reused) and from the prompt's snapshot."""
    prompt = "tell me about pages " * 6

    async def continuation(ctx):
        return await ctx.generate(Sampler.greedy(), max_tokens=8, ignore_eos=True).tokens()

    base = Context(rt).user(prompt).cue()
    await base.flush()
    await base.save("prompt")
    forked = [base.fork() for _ in range(forks)]  # all alive at once
    outs = [await continuation(f) for f in forked]
    fresh = await continuation(Context(rt).user(prompt).cue())  # prefix pages reused
    opened = await continuation(await Context.open(rt, "prompt"))
    assert all(out == fresh for out in outs) and fresh == opened and len(fresh) == 8
    engine.store.check_invariants()


@pytest.mark.no_tp("GGUF block weights run on one device")
@pytest.mark.native_only("GGUF block weights are a format of the native runner")
@pytest.mark.parametrize(("weights", "line"), [("gguf", "weights: gguf"),
                                               ("fp32", "weights: fp32"),
                                               ("auto", "weights: fp32 (weights='auto')")])
def test_the_weights_line_is_logged_whether_given_or_chosen(tiny_folder, caplog, weights,
                                                            line):
    """``-v`` shows the weight format an engine runs on, given explicitly or chosen."""
    with caplog.at_level(logging.INFO, logger="pie_ctx.engine"):
        boot_engine(str(tiny_folder), weights=weights, num_pages=8, progress=False)
    assert line in [r.getMessage() for r in caplog.records]
