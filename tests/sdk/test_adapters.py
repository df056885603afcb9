"""LoRA adapters through the SDK: per-context adapters against peft's PeftModel, mixed
batches, pages never shared across adapters, durable snapshots, load/unload races."""

from __future__ import annotations

from pathlib import Path

import anyio
import numpy as np
import pytest
import torch

from pie_ctx import Context, Sampler
from pie_ctx.errors import AdapterInUse, AdapterNotFound, InvalidArgument, ModelError
from tests.model.lora_fixtures import make_adapter
from tests.sdk.harness import sdk_runtime, tiny_runtime

pytest.importorskip("peft")
pytestmark = [pytest.mark.no_tp("LoRA adapters run on one device"),
              pytest.mark.native_only("LoRA adapters run on the native backend")]

GREEDY = Sampler.greedy()
PROMPT = list(range(40, 72))  # 32 tokens: 8 full pages of 4


@pytest.fixture(scope="module")
def adapters(tiny_folder_path, tmp_path_factory) -> tuple[Path, Path, dict]:
    """Two random adapters of the tiny model, and the oracles (peft) keyed by name."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_folder_path),
                                              torch_dtype=torch.float32).eval()
    root = tmp_path_factory.mktemp("adapters")
    oracles = {"a": make_adapter(hf, root / "a", rank=8, alpha=16, seed=1),
               "b": make_adapter(hf, root / "b", rank=4, alpha=8, seed=2,
                                 targets=["q_proj", "v_proj", "gate_proj", "down_proj"]),
               None: hf}
    return root / "a", root / "b", oracles


def _oracle_logits(model: torch.nn.Module, tokens: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0, -1].numpy()


def _oracle_greedy(model: torch.nn.Module, tokens: list[int], n: int) -> list[int]:
    out = list(tokens)
    for _ in range(n):
        out.append(int(_oracle_logits(model, out).argmax()))
    return out[len(tokens):]


async def _last_logits(ctx: Context, tokens: list[int]) -> np.ndarray:
    out = await ctx.forward().input(tokens).logits([len(tokens) - 1]).execute()
    return np.asarray(out.logits[0])


async def test_contexts_follow_their_adapters_oracle(tiny_folder_path, adapters,
                                                     transport) -> None:
    path_a, path_b, oracles = adapters
    async with sdk_runtime(tiny_folder_path, transport) as (rt, engine):
        info_a = await rt.load_adapter("a", str(path_a))
        await rt.load_adapter("b", str(path_b))
        assert [a.name for a in rt.info.adapters] == ["a", "b"]
        assert info_a.rank == 8 and len(info_a.targets) == 7
        for name in ("a", "b", None):
            ctx = Context(rt, adapter=name)
            got = await _last_logits(ctx, PROMPT)
            assert np.abs(got - _oracle_logits(oracles[name], PROMPT)).max() <= 1e-4
            await ctx.release()
        # three contexts decode together, one model call per step; each its own oracle
        ctxs = {name: Context(rt, adapter=name).append(PROMPT) for name in ("a", "b", None)}
        async with anyio.create_task_group() as tg:
            results: dict = {}

            async def run(name, ctx) -> None:
                results[name] = await ctx.generate(GREEDY, max_tokens=8,
                                                   ignore_eos=True).tokens()
            for name, ctx in ctxs.items():
                tg.start_soon(run, name, ctx)
        for name in ctxs:
            assert results[name] == _oracle_greedy(oracles[name], PROMPT, 8), name
        assert len({tuple(r) for r in results.values()}) == 3
        # a fork keeps its parent's adapter
        fork = ctxs["a"].fork()
        tail = await fork.generate(GREEDY, max_tokens=4, ignore_eos=True).tokens()
        assert tail == _oracle_greedy(oracles["a"], PROMPT + results["a"], 4)
        engine.store.check_invariants()


async def test_pages_are_shared_within_an_adapter_only(tiny_folder_path, adapters) -> None:
    path_a, path_b, _ = adapters
    async with tiny_runtime(tiny_folder_path) as rt:
        engine = rt.transport.engine
        await rt.load_adapter("a", str(path_a))
        await rt.load_adapter("b", str(path_b))
        await rt.load_adapter("a-again", str(path_a))  # same weights: same identity
        reports = {}
        keep = []
        for name in ("a", "a", "a-again", "b", None):
            ctx = Context(rt, adapter=name).append(PROMPT)
            reports.setdefault(name, []).append(await ctx.flush())
            keep.append(ctx)
            engine.store.check_invariants()
        # a prompt's last page is computed again for its logits (then deduplicated)
        assert reports["a"][0].pages_computed == 8 and reports["a"][1].pages_reused == 7
        assert reports["a-again"][0].pages_reused == 7
        assert reports["b"][0].pages_computed == 8 and reports["b"][0].pages_reused == 0
        assert reports[None][0].pages_computed == 8 and reports[None][0].pages_reused == 0
        pages: dict[int, set[int]] = {}  # adapter key -> pages its contexts hold
        for cid, state in engine.store.context_states():
            pages.setdefault(state.adapter, set()).update(engine.store.page_table(cid))
        assert len(pages) == 3  # a and a-again are one identity
        keys = list(pages)
        assert all(not pages[x] & pages[y] for x in keys for y in keys if x != y)


async def test_snapshots_record_the_adapter_across_a_restart(tiny_folder_path, adapters,
                                                             tmp_path: Path) -> None:
    path_a, path_b, oracles = adapters
    snaps = tmp_path / "snaps"
    snaps.mkdir()
    async with tiny_runtime(tiny_folder_path, snapshot_dir=snaps) as rt:
        await rt.load_adapter("a", str(path_a))
        ctx = Context(rt, adapter="a").append(PROMPT)
        await ctx.save("chat-a")
        await ctx.release()
    # a restart without the adapter: a typed error, and the snapshot is still there
    async with tiny_runtime(tiny_folder_path, snapshot_dir=snaps) as rt:
        with pytest.raises(AdapterNotFound, match="chat-a"):
            await Context.open(rt, "chat-a")
        assert await rt.snapshots() == ["chat-a"]
    # boot with it under another name: same weights, so the snapshot reopens
    async with tiny_runtime(tiny_folder_path, snapshot_dir=snaps,
                            adapters={"renamed": str(path_a)}) as rt:
        assert [a.name for a in rt.info.adapters] == ["renamed"]
        ctx = await Context.open(rt, "chat-a")
        assert ctx.open_report.pages_from_disk == 8
        got = await ctx.generate(GREEDY, max_tokens=6, ignore_eos=True).tokens()
        assert got == _oracle_greedy(oracles["a"], PROMPT, 6)
        rt.transport.engine.store.check_invariants()


async def test_load_and_unload_errors_and_races(tiny_folder_path, adapters,
                                                tmp_path: Path) -> None:
    path_a, path_b, _ = adapters
    async with tiny_runtime(tiny_folder_path) as rt:
        with pytest.raises(AdapterNotFound):
            await Context(rt, adapter="a").append(PROMPT).flush()
        with pytest.raises(ModelError, match="does not exist"):
            await rt.load_adapter("x", str(tmp_path / "missing"))
        with pytest.raises(AdapterNotFound):
            await rt.unload_adapter("a")
        await rt.load_adapter("a", str(path_a))
        with pytest.raises(InvalidArgument, match="already loaded"):
            await rt.load_adapter("a", str(path_b))
        ctx = Context(rt, adapter="a").append(PROMPT)
        gen = ctx.generate(GREEDY, max_tokens=64, ignore_eos=True)
        with pytest.raises(AdapterInUse, match="1 live context"):
            await rt.unload_adapter("a")  # while it generates
        assert len(await gen.tokens()) == 64
        with pytest.raises(AdapterInUse):
            await rt.unload_adapter("a")  # idle but alive
        await ctx.release()
        # unload races with many contexts being created: each either runs on the adapter
        # or fails with AdapterNotFound; the unload either happens or says AdapterInUse
        outcomes: list[str] = []

        async def user() -> None:
            try:
                c = Context(rt, adapter="a").append(PROMPT[:6])
                await c.generate(GREEDY, max_tokens=3, ignore_eos=True).tokens()
                await c.release()
                outcomes.append("ran")
            except AdapterNotFound:
                outcomes.append("not found")

        async def unloader() -> None:
            while True:
                try:
                    await rt.unload_adapter("a")
                    outcomes.append("unloaded")
                    return
                except AdapterInUse:
                    await anyio.sleep(0.001)

        async with anyio.create_task_group() as tg:
            for _ in range(6):
                tg.start_soon(user)
            tg.start_soon(unloader)
        assert "unloaded" in outcomes and len(outcomes) == 7
        assert rt.info.adapters == []
        rt.transport.engine.store.check_invariants()


def test_serve_and_run_take_repeatable_adapter_options(monkeypatch) -> None:
    from runtime.cli import _parser
    from runtime.model.adapters import peft
    from runtime.server.cli import engine_options

    checked: list[str] = []  # the folders' own check is tested in tests/http/test_adapters_runtime.py
    monkeypatch.setattr(peft, "check_folder", checked.append)

    for command in ("run", "serve"):
        words = [command] + (["x.py"] if command == "run" else [])
        args = _parser().parse_args(words + ["--adapter", "a=/p/a", "--adapter", "b=/p/b=c"])
        assert engine_options(args)["adapters"] == {"a": "/p/a", "b": "/p/b=c"}
        assert checked[-2:] == ["/p/a", "/p/b=c"]  # checked before any model loads
        assert "adapters" not in engine_options(_parser().parse_args(words))
        with pytest.raises(SystemExit):
            _parser().parse_args(words + ["--adapter", "no-path"])
        with pytest.raises(SystemExit):
            engine_options(_parser().parse_args(words + ["--adapter", "a=/x", "--adapter",
                                                         "a=/y"]))
