"""Every benchmark runs end to end in its ``--smoke`` mode: the real code path on a few
tokens, in a subprocess (as a user runs it: its folder first on sys.path). No timing is
asserted (benchmarks are scripts, never timed tests); a script that breaks, or a new
benchmark without ``--smoke``, fails here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"

# Modules in benchmarks/ that are not benchmarks, and why.
HELPERS = {
    "common.py": "shared code",
    "agent_workloads.py": "the agents' workloads (agents.py)",
    "agent_client.py": "one agent process of agents.py",
    "agent_inferlet.py": "one agent inferlet of agents.py",
    "agent_mcp.py": "the ReAct tools as an MCP server (agents.py, system e)",
    "scale_models.py": "the random-weight GGUF models of scale.py",
}
# Benchmarks whose smoke runs without the default model.
NO_DEFAULT_MODEL = {"pages.py", "agents.py", "block_kernels.py", "attention_kernel.py",
                    "kquant_kernels.py", "scale.py", "trace_replay.py"}
# Benchmarks whose smoke starts a Ray cluster: run by `make test-fleet` (PIE_CTX_TEST_FLEET=1)
FLEET = {"fleet.py"}
# Keys every smoke's JSON line must carry (beyond being a JSON object).
KEYS = {
    "agents.py": {"react_tput_vs_http", "react_hosted_tput_vs_http",
                  "react_hosted_tput_vs_socket", "socket_hop_us_per_token",
                  "react_responses_tput_vs_http", "react_responses_tput_vs_program",
                  "react_mcp_tput_vs_program", "responses_prompt_tokens_sent_per_round",
                  "decode_p99_itl_under_prefill_vs_idle"},
    "attention_kernel.py": {"us_bf16_warm_1x512", "us_bf16_cold_1x512", "us_fp32_warm_8x1024",
                            "us_int8_cold_fork8x1024", "us_fp32_warm_chunk512x8192",
                            "sdpa_us_warm_chunk512x8192"},
    "backend_hooks.py": {"cache_over_attention_ms"},
    "backends.py": {"transformers_backend_over_hf_bon", "native_over_transformers_backend_decode",
                    "backend_max_abs_logit_diff"},
    "best_of_n.py": {"speedup_vs_hf", "kv_ratio"},
    "block_kernels.py": {"ms_blocks_1", "ms_blocks_q8_1", "ms_int8_1", "ms_blocks_q8_512"},
    "compaction.py": {"snapkv_passkey_acc", "h2o_passkey_acc", "streaming_passkey_acc",
                       "full_passkey_acc", "truncate_passkey_acc", "ppl_full", "ppl_snapkv",
                       "ppl_h2o", "ppl_streaming", "ppl_truncate", "compaction_decode_speedup",
                       "attention_scores_overhead"},
    "deterministic.py": {"deterministic_prefill_ratio", "deterministic_decode_ratio",
                         "deterministic_decode8_ratio"},
    "decoding.py": {"json_valid_fraction", "constrained_tok_s_ratio", "spec_identical"},
    "fleet.py": {"fleet_computed_vs_round_robin", "fleet_computed_vs_single",
                 "fleet_router_ms_p50", "fleet_router_ms_p99", "fleet_failover_s",
                 "fleet_failover_recomputed_saved_tokens", "fleet_start_vs_serve",
                 "fleet_replace_s", "serve_start_s", "fleet_start_s",
                 "fleet_temp_folders_left"},
    "gguf_mixes.py": {"tokens"},
    "http_api.py": {"http_over_inprocess_wall", "cached_token_fraction"},
    "kquant_kernels.py": {"gbs_kquant_q8_1", "roofline_kquant_q8_1", "gbs_read_1",
                          "ms_kquant_1", "ms_kquant_q8_64"},
    "kv_pages.py": {"kv_int8_decode_ratio", "kv_pages_ratio"},
    "lora.py": {"lora_same_over_base", "lora_mixed_over_base", "adapter_load_ms",
                "lora_max_abs_logit_diff"},
    "model.py": {"max_abs_logit_diff", "decode_ratio"},
    "pages.py": {"alloc_free_ops_per_s", "ratio_fork_8192_over_64"},
    "prefix_reuse.py": {"ttft_hit_over_miss"},
    "quality.py": {"greedy_agreement", "ppl_delta"},
    "scale.py": {"scale_tiny_decode_vs_llamacpp", "scale_tiny_prefill_vs_llamacpp",
                 "scale_tiny_decode8_vs_llamacpp", "scale_tiny_bon_vs_llamacpp",
                 "scale_tiny_decode_8k_vs_llamacpp", "scale_tiny_rss_vs_llamacpp",
                 "scale_tiny_load_s_vs_llamacpp", "scale_tiny_decode_roofline_frac",
                 "scale_tiny_ours_decode_tok_s", "scale_tiny_ours_rss_mb",
                 "scale_tiny_ours_first_load_s"},
    "server.py": {"overhead_ratio", "noop_rtt_median_us"},
    "snapshots.py": {"reopen_after_restart_over_recompute", "reopen_mb_s", "disk_read_mb_s",
                     "save_mb_s", "disk_write_mb_s", "snapshots_saved"},
    "threads.py": {"copies_ratio"},
    "tensor_parallel.py": {"tp_overhead_fraction", "tp_logits_max_abs_diff"},
    "throughput.py": {"tokens_per_s", "scheduler_overhead_fraction"},
    "trace_replay.py": {"trace_hit_rate_vs_ceiling", "trace_ttft_p50_vs_llamaserver",
                        "trace_tput_vs_llamaserver", "fleet_trace_hit_rate_vs_single",
                        "fleet_trace_computed_vs_round_robin", "systems"},
    "vs_llamacpp.py": {"int8_decode_vs_llamacpp", "fp32_decode_vs_llamacpp",
                       "int8_prefill_vs_llamacpp", "int8_bon_vs_llamacpp",
                       "int8_decode8_vs_llamacpp", "q4_decode_vs_llamacpp",
                       "q4_decode8_vs_llamacpp", "q4_prefill_vs_llamacpp", "q4_bon_vs_llamacpp",
                       "q4_max_abs_logit_diff_vs_fp32", "q4_greedy_agreement_vs_fp32"},
}


def _marks(name: str) -> list:
    marks = [] if name in NO_DEFAULT_MODEL else [pytest.mark.real_model]
    if name in FLEET:
        marks.append(pytest.mark.skipif(os.environ.get("PIE_CTX_TEST_FLEET") != "1",
                                        reason="starts a Ray cluster: make test-fleet"))
    return marks


def _benchmarks() -> list:
    return [pytest.param(p.name, id=p.stem, marks=_marks(p.name))
            for p in sorted(BENCHMARKS.glob("*.py")) if p.name not in HELPERS]


def smoke(name: str) -> dict:
    out = subprocess.run([sys.executable, str(BENCHMARKS / name), "--smoke"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, f"{name} --smoke failed:\n{out.stderr[-3000:]}"
    lines = out.stdout.strip().splitlines()
    assert lines, f"{name} --smoke printed nothing"
    return json.loads(lines[-1])


def _fleet_temps() -> set[str]:
    """The fleet's temporary folders in the temp folder (replicas', fleet.py's)."""
    return {p.name for p in Path(tempfile.gettempdir()).iterdir()
            if p.name.startswith(("pie-ctx-replica-", "pie-ctx-fleet-bench-"))}


def test_every_helper_is_still_there():
    """A helper that was renamed or removed would hide a benchmark from this file."""
    assert {p.name for p in BENCHMARKS.glob("*.py")} >= set(HELPERS)


@pytest.mark.parametrize("name", _benchmarks())
def test_benchmark_smoke(name: str):
    temps = _fleet_temps() if name in FLEET else set()
    result = smoke(name)
    if name in FLEET:  # the replicas' folders and the benchmark's own are gone
        assert _fleet_temps() <= temps, _fleet_temps() - temps
    if result.get("skipped"):  # an optional library is missing (vs_llamacpp.py)
        return
    assert KEYS.get(name, set()) <= result.keys(), sorted(result)
    if name == "snapshots.py":
        assert result["identical_after_restart"] and result["pages_computed_on_open"] == 0
        assert result["snapshots_saved"] == result["snapshots_reopened"]
    if name == "agents.py":
        check_agents(result)
    if name == "gguf_mixes.py":  # every mix ran on the file's own blocks, by default
        weights = {k: v for k, v in result.items() if k.endswith("_weights")}
        assert weights and set(weights.values()) == {"gguf"}, weights
    if name == "trace_replay.py":  # one engine on the tiny model: every request answered,
        a = result["systems"]["a"]  # and no page reused that the trace never repeats
        assert a["requests"] == 40 and a["generated_tokens"] >= 40
        assert 0 < result["trace_hit_rate_vs_ceiling"] <= 1.0
    if name == "fleet.py":  # (figures of a smoke mean little; these hold at any size)
        assert result["fleet_failover_recomputed_saved_tokens"] == 0
        assert result["computed_session"] <= result["computed_round_robin"]
        assert result["fleet_temp_folders_left"] == 0
        assert result["fleet_start_s"] > 0 and result["fleet_replace_s"] > 0
        assert result["fleet_adopted"] == 2  # both replicas took an engine booted early


def check_agents(result: dict) -> None:
    runs = {(r["workload"], r["system"]): r for r in result["runs"]}
    assert set(runs) == {(w, s) for w in ("react", "codeact", "swarm")
                         for s in ("a1", "a2", "a3", "b")} | {
        ("react", "d"), ("swarm", "d"), ("react", "e")}
    for (workload, system), r in runs.items():
        assert r["generated"] > 0 and r["wall_s"] > 0, (workload, system, r)
        if system == "e":  # its tool results are written in the server, never sent
            continue
        # d: a follow-up also computes the last generated token of the stored context
        slack = r["agents"] * 20 if system == "d" else 0
        assert r["prompt_computed"] <= r["prompt_sent"] + slack, (workload, system, r)
    # d sends only new items: far fewer prompt tokens than b, which re-sends everything
    assert runs[("react", "d")]["prompt_sent"] < runs[("react", "b")]["prompt_sent"]
    assert 0 < result["responses_prompt_tokens_sent_per_round"]
    # every ReAct call is a tool call the engine jumped through: fewer steps than tokens
    react = runs[("react", "a2")]
    assert react["call_tokens"] > 0 and react["call_steps"] < react["call_tokens"]
    assert 0 < result["tool_call_steps_per_token"] < 1
    assert result["react_tput_vs_http"] > 0 and result["react_plain_tput_vs_http"] > 0
    # the hosted column ran, and the hop was measured (its sign is noise at smoke size)
    assert result["react_hosted_tput_vs_http"] > 0 and result["react_hosted_tput_vs_socket"] > 0
    assert isinstance(result["socket_hop_us_per_token"], float)
    # the generation beside a long prompt was timed: gaps alone and beside it
    assert result["decode_p99_itl_under_prefill_vs_idle"] > 0
    assert result["long_prompt_beside_decode_s"] > 0
