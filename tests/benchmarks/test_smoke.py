"""The benchmarks run end to end in their ``--smoke`` mode (small shapes, no timings
asserted: benchmarks are scripts, never timed tests)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.real_model


def _last_json(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


def test_agents_smoke_runs_every_workload_and_system():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "agents.py"), "--smoke"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    result = _last_json(out.stdout)
    runs = {(r["workload"], r["system"]): r for r in result["runs"]}
    assert set(runs) == {(w, s) for w in ("react", "codeact", "swarm")
                         for s in ("a1", "a2", "b")}
    for (workload, system), r in runs.items():
        assert r["generated"] > 0 and r["wall_s"] > 0, (workload, system, r)
        assert r["prompt_computed"] <= r["prompt_sent"], (workload, system, r)
    # every ReAct call is a tool call the engine jumped through: fewer steps than tokens
    react = runs[("react", "a2")]
    assert react["call_tokens"] > 0 and react["call_steps"] < react["call_tokens"]
    assert 0 < result["tool_call_steps_per_token"] < 1
    assert result["react_tput_vs_http"] > 0 and result["react_plain_tput_vs_http"] > 0
