"""The per-machine cache of load-time work (``runtime.model.machine_cache``): the projection
kernel probe and the calibration pass run once per machine, and a later load gets exactly
what they decided, or computes again when anything that decides it changed or the entry is
damaged; the cache never fails a load.

Each test points the cache at its own folder (the suite's session folder is shared).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
from tiny_models import config_of, make_hf_model

from runtime.model import kernel_choice, machine_cache, quant
from runtime.model.blocks import BlockWeight, int8_activations, outlier_channels
from runtime.model.gguf_weights import use_blocks
from runtime.model.kernel_choice import choose_kernels
from runtime.model.matmul import Int8Weight, Projection
from runtime.model.model import Transformer

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty cache folder of this test's own; no in-process choices either (they would
    answer before the cache is asked)."""
    folder = tmp_path / "cache"
    monkeypatch.setenv("PIE_CTX_MACHINE_CACHE_DIR", str(folder))
    monkeypatch.delenv("PIE_CTX_MACHINE_CACHE", raising=False)
    monkeypatch.setattr(kernel_choice, "_CHOSEN", {})
    return folder


@pytest.fixture
def probes(monkeypatch: pytest.MonkeyPatch) -> list[kernel_choice.KernelChoice]:
    """Every probe ``choose_kernels`` runs, by its result."""
    done: list[kernel_choice.KernelChoice] = []
    real = kernel_choice.probe_signature

    def counted(*args, **kwargs) -> kernel_choice.KernelChoice:
        done.append(real(*args, **kwargs))
        return done[-1]

    monkeypatch.setattr(kernel_choice, "probe_signature", counted)
    return done


def _proj(form: str, shape=(96, 64), seed: int = 0) -> Projection:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(*shape, generator=gen) * 0.05
    if form == "int8":
        return Projection(Int8Weight.quantize(w))
    if form == "q4":
        return Projection(BlockWeight.quantize_q4_1(w))
    return Projection(w, torch.randn(shape[0], generator=gen), pack=True)


def _entries(cache: Path, kind: str = "probe") -> list[Path]:
    return sorted((cache / kind).glob("*.json"))


@pytest.mark.parametrize("form", ["fp32", "int8", "q4"])
def test_a_probe_runs_once_per_machine_and_the_hit_is_its_choice(cache, probes, form) -> None:
    first = _proj(form)
    lines = choose_kernels([first], deterministic=True, repeats=1)
    assert len(probes) == 1 and len(_entries(cache)) == 1
    fresh = probes[0]
    assert first.kernel_names == fresh.chosen and fresh.classes
    assert any(n in c for c in fresh.classes for n in fresh.chosen)

    kernel_choice._CHOSEN.clear()  # a new process: only the disk remembers
    again = _proj(form, seed=1)  # another model of the same shapes
    assert choose_kernels([again], deterministic=True, repeats=1) == lines
    assert len(probes) == 1, "a hit must not probe"
    assert again.kernel_names == fresh.chosen

    # what the probe decides without timing (the invariant classes, their pads) is what a
    # fresh probe decides again, for the kernels both probed (one much slower than an
    # invariant kernel at every bucket is skipped, by timing); the stored entry is
    # exactly the choice made
    redo = kernel_choice.probe_signature(again, [again], again.candidate_names(), 1, True)

    def facts(classes: list[list[str]], probed: set[str]) -> set[frozenset[str]]:
        kept = (frozenset(n for n in c if n.split("@")[0] in probed) for c in classes)
        return {c for c in kept if c}

    def probed(classes: list[list[str]]) -> set[str]:
        return {n.split("@")[0] for c in classes for n in c}

    both = probed(redo.classes) & probed(fresh.classes)
    assert both  # the fastest kernel is always probed
    assert facts(redo.classes, both) == facts(fresh.classes, both)
    stored = json.loads(_entries(cache)[0].read_text())["value"]
    assert stored == fresh.encode()


def test_free_choices_are_kept_apart_from_deterministic_ones(cache, probes) -> None:
    choose_kernels([_proj("int8")], repeats=1)
    choose_kernels([_proj("int8")], deterministic=True, repeats=1)
    assert len(probes) == 2 and len(_entries(cache)) == 2
    kernel_choice._CHOSEN.clear()
    free = _proj("int8")
    choose_kernels([free], repeats=1)
    assert len(probes) == 2 and free.kernel_names == probes[0].chosen


def test_a_damaged_entry_is_probed_again_and_rewritten(cache, probes, caplog) -> None:
    choose_kernels([_proj("fp32")], deterministic=True, repeats=1)
    (entry,) = _entries(cache)
    good = entry.read_bytes()
    for damage in (good[: len(good) // 2],  # killed mid-write (no rename: cannot happen, but)
                   good.replace(b'"chosen": ["', b'"chosen": ["x'),  # edited: checksum
                   b"\x00" * 10):
        entry.write_bytes(damage)
        kernel_choice._CHOSEN.clear()
        p = _proj("fp32")
        choose_kernels([p], deterministic=True, repeats=1)
        # (a probe again: its timing may pick another class than the first did)
        assert p.kernel_names == probes[-1].chosen
        assert json.loads(entry.read_text())["value"] == probes[-1].encode()
    assert len(probes) == 4
    assert "ignoring" in caplog.text
    assert not list((cache / "probe").glob(".*.tmp"))  # no temporary file left behind


def test_the_key_changes_with_every_input_that_decides_a_probe(cache, monkeypatch) -> None:
    def key(p: Projection, deterministic: bool = True) -> str:
        sig = p.signature + (("deterministic",) if deterministic else ())
        return machine_cache.key("probe",
                                 kernel_choice._probe_inputs(p, sig, p.candidate_names(), 3))

    base = key(_proj("fp32"))
    assert key(_proj("fp32", seed=3)) == base  # the weights' values decide nothing
    assert key(_proj("fp32", shape=(64, 96))) != base
    assert key(_proj("int8")) != base
    assert key(_proj("fp32"), deterministic=False) != base
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        assert key(_proj("fp32")) != base
    finally:
        torch.set_num_threads(threads)
    assert key(_proj("fp32")) == base
    monkeypatch.setenv("MKL_ENABLE_INSTRUCTIONS", "AVX2")
    assert key(_proj("fp32")) != base
    monkeypatch.delenv("MKL_ENABLE_INSTRUCTIONS")
    monkeypatch.setattr(kernel_choice, "PROBE_ROWS", kernel_choice.PROBE_ROWS[:-1])
    assert key(_proj("fp32")) != base


def test_off_never_touches_the_cache_and_refresh_probes_again(cache, probes,
                                                              monkeypatch) -> None:
    monkeypatch.setenv("PIE_CTX_MACHINE_CACHE", "0")
    choose_kernels([_proj("int8")], deterministic=True, repeats=1)
    assert len(probes) == 1 and not cache.exists()
    monkeypatch.setenv("PIE_CTX_MACHINE_CACHE", "1")
    kernel_choice._CHOSEN.clear()
    choose_kernels([_proj("int8")], deterministic=True, repeats=1)
    (entry,) = _entries(cache)
    before = entry.stat().st_mtime_ns
    monkeypatch.setenv("PIE_CTX_MACHINE_CACHE", "refresh")
    kernel_choice._CHOSEN.clear()
    choose_kernels([_proj("int8")], deterministic=True, repeats=1)
    assert len(probes) == 3 and entry.stat().st_mtime_ns >= before
    assert json.loads(entry.read_text())["value"] == probes[-1].encode()


def test_a_cache_that_cannot_be_written_falls_back_to_computing(tmp_path, probes,
                                                                 monkeypatch) -> None:
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the cache folder would be")
    monkeypatch.setenv("PIE_CTX_MACHINE_CACHE_DIR", str(blocker / "pie-ctx"))
    monkeypatch.setattr(kernel_choice, "_CHOSEN", {})
    for _ in range(2):
        p = _proj("int8")
        choose_kernels([p], deterministic=True, repeats=1)
        kernel_choice._CHOSEN.clear()
    assert len(probes) == 2 and p.kernel_names == probes[-1].chosen


def test_the_cache_lives_beside_the_models_unless_moved(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("PIE_CTX_MACHINE_CACHE_DIR")
    monkeypatch.setenv("PIE_CTX_CACHE", str(tmp_path / "root"))  # the models' cache root
    assert machine_cache.root() == tmp_path / "root"
    monkeypatch.setenv("PIE_CTX_MACHINE_CACHE_DIR", str(tmp_path / "elsewhere"))
    assert machine_cache.entry_path("probe", "k") == tmp_path / "elsewhere" / "probe" / "k.json"


def test_threads_that_need_one_entry_compute_it_once(cache) -> None:
    computed, results = [], []

    def compute() -> int:
        computed.append(1)
        time.sleep(0.3)
        return 42

    def load() -> None:
        results.append(machine_cache.cached("test", {"x": 1}, compute, int, int))

    threads = [threading.Thread(target=load) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(computed) == 1
    assert sorted(results) == [(42, False), (42, True), (42, True)]


def test_processes_starting_at_once_compute_one_entry_once(cache, tmp_path) -> None:
    """Two processes, one entry: the second waits on the first's lock and reads its entry
    (a value that differs per process shows who computed it)."""
    script = textwrap.dedent("""
        import os, sys, time
        from runtime.model import machine_cache
        def compute():
            time.sleep(1.0)
            return os.getpid()
        value, hit = machine_cache.cached("test", {"x": 2}, compute, int, int)
        print(value, hit)
    """)
    env = {"PIE_CTX_MACHINE_CACHE_DIR": str(cache), "PYTHONPATH": str(ROOT),
           "PATH": "/usr/bin:/bin"}
    runs = [subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE,
                             text=True) for _ in range(2)]
    outs = [r.communicate(timeout=120)[0].split() for r in runs]
    assert all(r.returncode == 0 for r in runs)
    assert outs[0][0] == outs[1][0]  # one pid: one process computed, the other read it
    assert sorted(o[1] for o in outs) == ["False", "True"]
    assert len(_entries(cache, "test")) == 1


def _tiny(seed: int = 0, layers: int = 2):
    hf = make_hf_model("qwen2", seed=seed, num_layers=layers)
    cfg = config_of(hf)
    return cfg, hf.state_dict()


def _float_model(cfg, weights) -> Transformer:
    return Transformer(cfg, weights, torch.device("cpu"), torch.float32)


@pytest.fixture
def passes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    done: list[int] = []
    real = quant._dense_pass

    def counted(model, tokens):
        done.append(len(tokens))
        return real(model, tokens)

    monkeypatch.setattr(quant, "_dense_pass", counted)
    return done


def test_a_calibration_runs_once_and_the_hit_is_the_same_bits(cache, passes) -> None:
    cfg, weights = _tiny()
    tokens = list(range(3, 60))
    fresh_layers, fresh_head = quant.calibrate(_float_model(cfg, weights), tokens)
    layers, head = quant.calibrate(_float_model(cfg, weights), tokens)
    assert passes == [len(tokens)] and len(_entries(cache, "calibration")) == 1
    assert torch.equal(head, fresh_head)
    for got, want in zip(layers, fresh_layers, strict=True):
        assert got.keys() == want.keys()
        for n in want:
            assert torch.equal(got[n], want[n])
            for k in (8, 3):  # blocks_q8's channels, whatever OUTLIERS is
                assert torch.equal(outlier_channels(got[n], k), outlier_channels(want[n], k))
    # another text, other weights, another dtype: another entry
    quant.calibrate(_float_model(cfg, weights), tokens[:-1])
    quant.calibrate(_float_model(*_tiny(seed=1)), tokens)
    changed = dict(weights)
    name = "model.layers.1.mlp.down_proj.weight"
    changed[name] = weights[name].clone()
    changed[name][0, 0] += 1e-3  # one weight
    quant.calibrate(_float_model(cfg, changed), tokens)
    quant.calibrate(Transformer(cfg, weights, torch.device("cpu"), torch.bfloat16), tokens)
    assert len(passes) == 5 and len(_entries(cache, "calibration")) == 5


def test_a_damaged_calibration_entry_is_computed_again(cache, passes) -> None:
    cfg, weights = _tiny()
    tokens = list(range(3, 40))
    want, _ = quant.calibrate(_float_model(cfg, weights), tokens)
    (entry,) = _entries(cache, "calibration")
    doc = json.loads(entry.read_text())
    doc["value"]["layers"] = doc["value"]["layers"][:1]  # a shorter model's, checksum redone
    doc["checksum"] = machine_cache._digest(json.dumps(doc["value"], sort_keys=True))
    entry.write_text(json.dumps(doc))
    got, _ = quant.calibrate(_float_model(cfg, weights), tokens)
    assert len(passes) == 2 and torch.equal(got[1]["down"], want[1]["down"])


@pytest.mark.skipif(not int8_activations(), reason="blocks_q8 needs the block kernels")
def test_gguf_blocks_get_the_same_outlier_channels_from_the_cache(cache, passes) -> None:
    cfg, weights = _tiny()
    tokens = list(range(3, 60))

    def channels() -> list[list[int]]:
        model = _float_model(cfg, weights)
        use_blocks(model, None, tokens)
        return [p.outliers.tolist() for p in model.projections()]

    fresh = channels()
    assert channels() == fresh and len(passes) == 1
    assert all(len(c) == min(8, 64) for c in fresh[:1])
