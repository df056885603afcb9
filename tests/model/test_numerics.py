"""The numerics record: decided once, handed down, read by everything below.

``Numerics.decide`` checks the options against the device and pie-ctx's kernels; a runner
given one follows it (its attention backend, ``EngineInfo.deterministic``), and
``finish_weights`` makes every weight format's projections final before their kernels are
chosen, once each.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import pytest
import torch
from tiny_models import config_of, make_hf_model

from pie_ctx.proto.errors import InvalidArgument
from runtime.model import kernels, numerics
from runtime.model.matmul import Int8Weight, Projection
from runtime.model.numerics import Numerics
from runtime.model.runner import ModelRunner

CPU = torch.device("cpu")


def test_decide_checks_the_options() -> None:
    with pytest.raises(InvalidArgument, match="weights must be one of"):
        Numerics.decide(CPU, torch.float32, weight_format="int4")
    with pytest.raises(InvalidArgument, match="PIE_CTX_ATTENTION='fast'"):
        Numerics.decide(CPU, torch.float32, attention="fast")
    got = Numerics.decide(CPU, torch.bfloat16, weight_format="int8", attention=" Torch ")
    assert (got.weight_format, got.dtype, got.attention) == ("int8", torch.bfloat16, "torch")
    with pytest.raises(dataclasses.FrozenInstanceError):
        got.deterministic = True  # type: ignore[misc]


def test_deterministic_is_decided_by_the_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    # (no CUDA needed: a GPU is refused by its device type, before any work)
    gpu = Numerics.decide(torch.device("cuda"), torch.float32, deterministic=True)
    assert not gpu.deterministic
    assert not Numerics.decide(CPU, torch.float32).deterministic
    monkeypatch.setattr(kernels, "ENABLED", False)
    assert not Numerics.decide(CPU, torch.float32, deterministic=True).deterministic
    monkeypatch.setenv("PIE_CTX_ATTENTION", "flex")
    assert Numerics.decide(CPU, torch.float32).attention == "flex"


@pytest.mark.parametrize("weight_format", ["fp32", "int8", "gguf"])
def test_each_projection_gets_its_kernels_chosen_once_in_its_final_form(
        weight_format: str, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[list[Projection]] = []
    real = numerics.choose_kernels

    def counted(projections: Iterable[Projection], **kw: object) -> list[str]:
        calls.append(list(projections))
        return real(calls[-1], repeats=1, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(numerics, "choose_kernels", counted)
    hf = make_hf_model("llama3")
    cfg = config_of(hf)
    pool = torch.zeros(8, 16, cfg.num_layers, 2, cfg.num_kv_heads, cfg.head_dim)
    runner = ModelRunner(cfg, hf.state_dict(), pool, 16, calibration=list(range(3, 40)),
                         numerics=Numerics.decide(CPU, torch.float32,
                                                  weight_format=weight_format))
    assert len(calls) == 1
    (chosen,) = calls
    final = runner.model.projections()
    assert [id(p) for p in chosen] == [id(p) for p in final]  # the final ones, each once
    if weight_format == "int8":
        assert all(isinstance(p.weight, Int8Weight) for p in final)
    if weight_format == "gguf":
        assert all(p.is_blocks for p in final)
    assert runner.weight_format == weight_format
    assert runner.model.kernel_report  # what EngineInfo.kernels shows


def test_a_runner_follows_the_numerics_it_is_given() -> None:
    if kernels.ops() is None:
        pytest.skip("deterministic numerics need pie-ctx's CPU kernels")
    hf = make_hf_model("llama3")
    cfg = config_of(hf)
    pool = torch.zeros(8, 16, cfg.num_layers, 2, cfg.num_kv_heads, cfg.head_dim)
    given = Numerics.decide(CPU, torch.float32, deterministic=True)
    # the record, not the keyword arguments, decides
    runner = ModelRunner(cfg, hf.state_dict(), pool, 16, deterministic=False, numerics=given)
    assert runner.numerics is given and runner.deterministic
    assert runner.backend.deterministic and runner.backend.cascade is False
    loose = ModelRunner(cfg, hf.state_dict(), pool, 16)
    assert not loose.deterministic and not loose.backend.deterministic
