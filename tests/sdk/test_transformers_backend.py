"""The transformers backend through the SDK: every tested architecture against
transformers' own forward and ``generate``, the native architectures against the native
runner, and the refusals that architectures force (docs/models.md)."""

from __future__ import annotations

import logging
from pathlib import Path

import anyio
import numpy as np
import pytest
import torch

from pie_ctx import Context, Sampler
from pie_ctx.errors import ContextTooLong, InvalidArgument, ModelError
from tests.model.transformers_fixtures import ARCHS, NATIVE, POSITIONS, make_model, write_folder
from tests.sdk.harness import tiny_runtime

pytestmark = pytest.mark.no_tp("the transformers backend runs on one device")

GREEDY = Sampler.greedy()
PROMPT = list(range(40, 60))  # 20 tokens: longer than the sliding windows (8)
TOL = 1e-4


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, tuple[torch.nn.Module, Path]]:
    root = tmp_path_factory.mktemp("archs")
    out = {}
    for arch in ARCHS + NATIVE:
        model = make_model(arch)
        out[arch] = model, write_folder(model, root / arch)
    return out


def _oracle(model: torch.nn.Module, tokens: list[int], mask: torch.Tensor | None = None,
            ) -> np.ndarray:
    """transformers' logits for every position of ``tokens`` (one dense forward)."""
    with torch.no_grad():
        return model(torch.tensor([tokens]), attention_mask=mask).logits[0].numpy()


def _generate(model: torch.nn.Module, tokens: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([tokens]), max_new_tokens=n, do_sample=False,
                             attention_mask=torch.ones(1, len(tokens), dtype=torch.int64))
    return out[0, len(tokens):].tolist()


async def _logits(ctx: Context, tokens: list[int], rows: list[int] | None = None) -> np.ndarray:
    rows = list(range(len(tokens))) if rows is None else rows
    out = await ctx.forward().input(tokens).logits(rows).execute()
    return np.stack([np.asarray(x) for x in out.logits])


def _close(got: np.ndarray, want: np.ndarray) -> None:
    assert got.shape == want.shape
    assert np.abs(got - want).max() <= TOL, np.abs(got - want).max()


@pytest.mark.parametrize("arch", ARCHS)
async def test_architecture_matches_transformers(arch: str, models, tmp_path: Path) -> None:
    """Paged prefill, a decode after a fork, a prefix hit, greedy generation and a durable
    snapshot reopened after a restart: each equals transformers on the same tokens."""
    model, folder = models[arch]
    snaps = tmp_path / "snaps"
    snaps.mkdir()
    async with tiny_runtime(folder, snapshot_dir=snaps) as rt:  # auto picks transformers
        assert rt.info.backend == "transformers"
        ctx = Context(rt)
        _close(await _logits(ctx, PROMPT), _oracle(model, PROMPT))
        fork = ctx.fork()
        _close(await _logits(fork, [77]), _oracle(model, PROMPT + [77])[-1:])
        other = Context(rt).append(PROMPT + [90, 91])
        report = await other.flush()
        assert report.pages_reused == 5  # the prompt's five full pages of 4
        _close(await _logits(other, [92]), _oracle(model, PROMPT + [90, 91, 92])[-1:])
        gen = Context(rt).append(PROMPT)
        assert await gen.generate(GREEDY, max_tokens=8, ignore_eos=True).tokens() == \
            _generate(model, PROMPT, 8)
        await ctx.save("prompt")
        rt.transport.engine.store.check_invariants()
    async with tiny_runtime(folder, snapshot_dir=snaps) as rt:
        ctx = await Context.open(rt, "prompt")
        assert ctx.open_report.pages_from_disk == 5
        _close(await _logits(ctx, [33]), _oracle(model, PROMPT + [33])[-1:])
        await ctx.truncate(1)  # roll the decoded token back
        _close(await _logits(ctx, [34, 35]), _oracle(model, PROMPT + [34, 35])[-2:])


@pytest.mark.parametrize("arch", ["mistral", "gemma2"])
async def test_custom_masks_and_positions_follow_transformers(arch: str, models) -> None:
    """A custom mask replaces the causal mask and the sliding window, as a 4D mask given to
    transformers does; explicit positions are the model's position_ids."""
    model, folder = models[arch]
    n = len(PROMPT)
    rng = np.random.default_rng(0)
    allowed = np.tril(rng.random((n, n)) < 0.7)
    np.fill_diagonal(allowed, True)
    additive = torch.zeros(1, 1, n, n)
    additive[0, 0][~torch.from_numpy(allowed)] = torch.finfo(torch.float32).min
    async with tiny_runtime(folder) as rt:
        ctx = Context(rt)
        out = await (ctx.forward().input(PROMPT).attention_mask(allowed.tolist())
                     .logits(list(range(n))).execute())
        _close(np.stack([np.asarray(x) for x in out.logits]),
               _oracle(model, PROMPT, {"full_attention": additive, "sliding_attention": additive}
                       if arch == "gemma2" else additive))
        positions = [3 * i for i in range(6)]
        out = await (Context(rt).forward().input_at(PROMPT[:6], positions).logits([5])
                     .execute())
        with torch.no_grad():
            want = model(torch.tensor([PROMPT[:6]]),
                         position_ids=torch.tensor([positions])).logits[0, -1].numpy()
        _close(np.asarray(out.logits[0])[None], want[None])


@pytest.mark.parametrize("arch", NATIVE)
async def test_native_architectures_agree_across_backends(arch: str, models) -> None:
    """The two backends are each other's oracle on the architectures both run."""
    model, folder = models[arch]
    results = {}
    for backend in ("native", "transformers"):
        async with tiny_runtime(folder, backend=backend) as rt:
            assert rt.info.backend == backend
            ctx = Context(rt)
            prefill = await _logits(ctx, PROMPT)
            decode = await _logits(ctx.fork(), [77])
            tokens = await Context(rt).append(PROMPT).generate(
                GREEDY, max_tokens=8, ignore_eos=True).tokens()
            results[backend] = prefill, decode, tokens
    (p1, d1, t1), (p2, d2, t2) = results["native"], results["transformers"]
    _close(p2, p1)
    _close(d2, d1)
    _close(p2, _oracle(model, PROMPT))
    assert t1 == t2 == _generate(model, PROMPT, 8)


async def test_contexts_of_different_lengths_decode_in_one_call(models) -> None:
    model, folder = models["gemma2"]
    async with tiny_runtime(folder) as rt:
        engine = rt.transport.engine
        short, long = Context(rt).append(PROMPT[:5]), Context(rt).append(PROMPT)
        await short.flush()
        await long.flush()
        calls = engine.executor.num_model_calls
        results: dict[str, list[int]] = {}

        async def run(name: str, ctx: Context) -> None:
            results[name] = await ctx.generate(GREEDY, max_tokens=6, ignore_eos=True).tokens()

        async with anyio.create_task_group() as tg:
            tg.start_soon(run, "short", short)
            tg.start_soon(run, "long", long)
        assert engine.executor.num_model_calls - calls <= 7  # one call a step, not one a context
        assert results["short"] == _generate(model, PROMPT[:5], 6)
        assert results["long"] == _generate(model, PROMPT, 6)


@pytest.mark.native_only("checks that auto picks native for a Llama")
async def test_refusals_are_typed(models, caplog) -> None:
    gpt2, gpt2_folder = models["gpt2"]
    async with tiny_runtime(gpt2_folder) as rt:
        ctx = Context(rt)
        with pytest.raises(InvalidArgument, match=r"position 64 is not in \[0, 64\)"):
            await ctx.forward().input_at([5], [POSITIONS]).logits([0]).execute()
        assert (await _logits(ctx, [5]))[0].shape == (gpt2.config.vocab_size,)  # unchanged
        with pytest.raises(InvalidArgument, match="native backend only"):
            await rt.load_adapter("a", str(gpt2_folder))
        with pytest.raises(InvalidArgument, match="attention scores"):
            await ctx.forward().input([5]).attention_scores([0]).execute()
        long = Context(rt).append(list(range(40, 40 + POSITIONS - 2)))
        with pytest.raises(ContextTooLong, match="exceed the model's 64 tokens"):
            await long.generate(GREEDY, max_tokens=8, ignore_eos=True).tokens()
    with pytest.raises(ModelError, match="unsupported model architecture"):
        async with tiny_runtime(gpt2_folder, backend="native"):
            pass
    with pytest.raises(InvalidArgument, match="native runner"):
        async with tiny_runtime(gpt2_folder, weights="int8"):
            pass
    with pytest.raises(InvalidArgument, match="backend must be one of"):
        async with tiny_runtime(gpt2_folder, backend="vllm"):
            pass
    _, llama_folder = models["llama"]
    with caplog.at_level(logging.INFO, logger="pie_ctx.engine"):
        async with tiny_runtime(llama_folder) as rt:
            assert rt.info.backend == "native"
    assert "the native backend" in caplog.text


async def test_probes_constraints_and_speculation(models) -> None:
    """Hidden states, entropy and constrained generation over a GPT-2 (learned positions),
    and speculative decoding (a verify block of several rows) identical to plain greedy."""
    from pie_ctx.constrain import Regex

    model, folder = models["gpt2"]
    async with tiny_runtime(folder) as rt:
        out = await (Context(rt).forward().input(PROMPT).hidden_states([5, 19])
                     .entropy([19]).logits([19]).execute())
        with torch.no_grad():
            ref = model(torch.tensor([PROMPT]), output_hidden_states=True)
        want_hidden = ref.hidden_states[-1][0, [5, 19]].numpy()
        assert np.abs(np.stack(out.hidden_states) - want_hidden).max() <= TOL
        p = torch.softmax(ref.logits[0, 19], -1)
        assert abs(out.entropies[0] - float(-(p * p.log()).sum())) <= 1e-4
        text = await Context(rt).append(PROMPT).generate(
            GREEDY, max_tokens=6, constrain=Regex("[a-c]{3}")).text()
        assert text in {a + b + c for a in "abc" for b in "abc" for c in "abc"}
        loop = PROMPT[:6] * 3  # repeats: prompt lookup finds drafts
        plain = await Context(rt).append(loop).generate(GREEDY, max_tokens=12,
                                                        ignore_eos=True).tokens()
        engine = rt.transport.engine
        calls = engine.executor.num_model_calls
        drafted = await Context(rt).append(loop).generate(
            GREEDY, max_tokens=12, ignore_eos=True, speculator="prompt_lookup").tokens()
        assert drafted == plain == _generate(model, loop, 12)
        assert engine.executor.num_model_calls - calls < 12  # drafts were accepted
