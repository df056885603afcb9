"""The fused decode step's kernel table: one, in C++, and the Python side agrees with it.

``decode_step.cpp`` exports ``STEP_KINDS`` (kernel name -> its ``Kind`` number);
``runtime.model.kernel_choice.step_kinds`` reads it, the kernel chooser prefers those
kernels and ``runtime.model.fused_step`` hands their numbers to ``DecodeStep``. Checked:
the table names exactly the kernels projections offer that have a C++ form, every one of
them is handed over with the table's number, and the step built from those numbers gives
the eager forward's bits.
"""

from __future__ import annotations

import pytest
import torch
from kquant_fixtures import random_blocks

from runtime.model import fused_step, kernels
from runtime.model.blocks import BlockWeight
from runtime.model.kernel_choice import has_step_form, step_kinds
from runtime.model.kquants import KQuantWeight
from runtime.model.matmul import Int8Weight, Projection

# the kernels a projection offers on CPU that the step does not run in C++
NO_STEP_FORM = {"f32", "blocks_f32"}


@pytest.fixture(autouse=True)
def _ops() -> None:
    if kernels.ops() is None:
        pytest.skip("pie-ctx's CPU kernels did not build here (no compiler?)")


def _projections() -> list[Projection]:
    """One CPU projection of each weight form (float with a packed copy allowed, int8,
    GGUF blocks with and without bf16-exact scales, K-quant super-blocks)."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(48, 256, generator=gen)
    out = [Projection(w, pack=True), Projection(Int8Weight.quantize(w)),
           Projection(BlockWeight.quantize_q4_1(w))]
    # Q4_1 blocks whose scales and minimums bf16 holds exactly: int4pack is offered too
    qs = torch.randint(0, 256, (32, 32), dtype=torch.uint8, generator=gen)
    d = (2.0 ** -torch.randint(3, 8, (32, 2), generator=gen)).to(torch.float16)
    m = (torch.randint(-16, 16, (32, 2), generator=gen) / 64).to(torch.float16)
    out.append(Projection(BlockWeight(4, qs, d, m, 32, 64, "Q4_1")))
    if kernels.kquant_ops() is not None:
        raw = random_blocks("Q4_K", 48, 256, 0)
        out.append(Projection(KQuantWeight.from_gguf(raw, "Q4_K", (48, 256))))
    return out


def test_the_table_comes_from_the_compiled_step() -> None:
    table = step_kinds()
    assert table == dict(kernels.ops().STEP_KINDS)
    assert table and all(isinstance(v, int) and v >= 0 for v in table.values())
    assert has_step_form("int_mm@4") and not has_step_form("blocks_f32")


def test_the_table_names_the_kernels_projections_offer_with_a_cpp_form() -> None:
    offered = {n for p in _projections() for n in p.candidate_names()}
    table = set(step_kinds())
    if kernels.kquant_ops() is None:
        table -= {"kquant", "kquant_q8"}
    assert table <= offered, table - offered
    assert offered - table <= NO_STEP_FORM, offered - table


def test_the_step_is_handed_the_tables_number_for_every_kernel() -> None:
    table = step_kinds()
    handed = set()
    for p in _projections():
        for name in p.candidate_names():
            if name not in table:
                continue
            p.use([name] * p.buckets)
            spec = fused_step._spec(p, name)
            if spec is None:  # a layout the kernel needs did not fit (int4pack's exactness)
                continue
            assert spec[0] == table[name], (name, spec[0], table[name])
            assert fused_step._spec(p, f"{name}@4")[7] == 4  # padded: same kind, its pad
            handed.add(name)
    assert {"mkl", "mm", "int_mm", "int_mm_kn", "blocks", "int4pack"} <= handed, handed


def test_no_kernel_without_a_table_entry_is_handed_over() -> None:
    for p in _projections():
        for name in set(p.candidate_names()) - set(step_kinds()):
            p.use([name] * p.buckets)
            assert fused_step._spec(p, name) is None
