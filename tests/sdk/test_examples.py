"""Every example runs end to end on the tiny random model (the first three also on the
default model, in tests/test_real_examples.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pie_ctx.loading import inferlet_args, load_inferlet
from tests.sdk.harness import sdk_runtime

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
ALL = sorted(p.name for p in EXAMPLES.glob("*.py"))
# The memory policies compact (which a tensor-parallel engine refuses by design) and two of
# them read attention scores (refused on the transformers backend too); the refusals are
# tested in tests/parallel/test_engine.py and tests/sdk/test_transformers_backend.py.
_COMPACTS = pytest.mark.no_tp("compaction")
_SCORES = pytest.mark.native_only("attention scores")
POLICIES = {"streaming_llm.py": [_COMPACTS], "h2o.py": [_COMPACTS, _SCORES],
            "snapkv.py": [_COMPACTS, _SCORES]}


def _example(name: str, *rest: object) -> object:
    return pytest.param(name, *rest, marks=POLICIES.get(name, ()))


def test_every_example_is_listed():
    assert ALL == sorted(["hello.py", "best_of_n.py", "prefix_snapshot.py", "speculative.py",
                          "structured_output.py", "classify.py", "tool_agent.py",
                          "attention_sink.py", "tree_of_thought.py", "beam_search.py",
                          "streaming_llm.py", "h2o.py", "snapkv.py"])


@pytest.mark.parametrize("name", [_example(n) for n in ALL])
async def test_example_runs(name, tiny_folder, transport, capsys):
    module = load_inferlet(EXAMPLES / name)
    args = inferlet_args(module, [], prog=name)
    async with sdk_runtime(tiny_folder, transport, page_size=4) as (rt, engine):
        result = await module.main(rt, args)
    out = capsys.readouterr().out
    assert out.strip(), f"{name} printed nothing"
    if name == "speculative.py":
        assert result is True  # identical to plain greedy
    # Everything the inferlet left open was released at exit; only snapshots remain.
    stats = engine.store.stats()
    assert stats.num_contexts == 0, stats
    assert stats.num_snapshots == (1 if name == "prefix_snapshot.py" else 0)
    engine.store.check_invariants()


@pytest.mark.parametrize("name,budget", [_example("streaming_llm.py", 24),
                                         _example("h2o.py", 24), _example("snapkv.py", 20)])
async def test_memory_policies_hold_their_budget(name, budget, tiny_folder):
    """The three policies of docs/compaction.md never hold more than their budget after
    compacting (a pass may add up to one step's tokens before the next compaction)."""
    module = load_inferlet(EXAMPLES / name)
    args = inferlet_args(module, ["--budget", str(budget)], prog=name)
    async with sdk_runtime(tiny_folder, page_size=4) as (rt, engine):
        held = await module.main(rt, args)
        assert 0 < held <= budget
        engine.store.check_invariants()

