"""K-quant weights in the packed layout (16 output rows in a vector's lanes): the same bytes
as the file's (a lossless round trip), and on every kernel and code path the same bits as
the file's layout gives, whatever the number of rows; packing at load; a Q4_K_M model on
packed weights gives the logits it gives on the file's layout.

Oracle: the file's layout through the same module (its own oracles are test_kquants.py's).
"""

from __future__ import annotations

import mmap
from pathlib import Path

import numpy as np
import pytest
import torch
from kquant_fixtures import Q4_K_M, random_blocks, write_kquant_gguf
from test_kquants import _forward, _ops, _pool, _tmp_cache  # noqa: F401 (an autouse fixture)

from runtime.model import blocks as blocks_mod
from runtime.model import kquants as kquants_mod
from runtime.model.formats import cat_weights
from runtime.model.kquants import KQUANT_FORMATS, KQuantWeight, built_isas, pack_wanted
from runtime.model.loader import load_blocks, load_model
from runtime.model.runner import ModelRunner

FORMATS = tuple(KQUANT_FORMATS)


@pytest.fixture
def ops():
    return _ops()


def _pair(kind: str, rows: int = 48, cols: int = 1280, seed: int = 0
          ) -> tuple[KQuantWeight, KQuantWeight]:
    """The same matrix in the file's layout and packed."""
    raw = random_blocks(kind, rows, cols, seed)
    natural = KQuantWeight.from_gguf(raw, kind, (rows, cols), pack=False)
    return natural, KQuantWeight.from_gguf(raw, kind, (rows, cols), pack=True)


@pytest.mark.parametrize("kind", FORMATS)
def test_packing_is_a_lossless_reordering_of_the_files_bytes(ops, kind: str) -> None:
    natural, packed = _pair(kind)
    part = packed.parts[0]
    assert part.packed and not natural.parts[0].packed
    assert torch.equal(part.natural(), natural.parts[0].raw)
    # the same bytes (Q6_K's blocks padded from 210 to 212 with zeros)
    pad = {"Q6_K": 2}.get(kind, 0)
    assert part.raw.numel() == natural.parts[0].raw.numel() + 48 * 5 * pad
    assert torch.equal(part.raw.flatten().sort().values[48 * 5 * pad:],
                       natural.parts[0].raw.flatten().sort().values)
    rows = torch.tensor([47, 0, 16, 5, 31])
    assert torch.equal(packed.dequantize(rows), natural.dequantize(rows))
    assert torch.equal(packed.dequantize(), natural.dequantize())


@pytest.mark.parametrize("isa", ["portable", "avx2", "avx512_vnni"])
def test_every_kernel_gives_the_files_bits_on_packed_weights(ops, isa: str) -> None:
    """A fused weight of three formats (5 super-blocks a row: a tail of the four-block
    chains), 1 to 40 rows (each of the AVX-512 row tiles and the 16-row switch of the
    file's layout), on every q8_K path and the exact kernel; each row alone too."""
    if isa not in built_isas():
        pytest.skip(f"{isa} is not built on this CPU")
    pairs = [_pair(kind, rows=rows, seed=i)
             for i, (kind, rows) in enumerate((("Q4_K", 32), ("Q5_K", 16), ("Q6_K", 48)))]
    natural = cat_weights([n for n, _ in pairs])
    packed = cat_weights([p for _, p in pairs])
    assert all(p.packed for p in packed.parts)
    x = torch.randn(40, 1280, generator=torch.Generator().manual_seed(3))
    for n in (1, 2, 3, 4, 5, 8, 15, 16, 17, 40):
        got = packed.matmul_q8(x[:n], isa)
        assert torch.equal(got, natural.matmul_q8(x[:n], isa)), n
        assert torch.equal(packed.matmul(x[:n]), natural.matmul(x[:n]))
    alone = torch.cat([packed.matmul_q8(x[i:i + 1], isa) for i in range(9)])
    assert torch.equal(alone, packed.matmul_q8(x[:9], isa))


def test_take_rows_of_a_packed_weight(ops) -> None:
    natural, packed = _pair("Q4_K", rows=48)
    index = torch.arange(47, -1, -1)  # a permutation keeps the rows a multiple of 16: packed
    taken = packed.take_rows(index)
    assert taken.parts[0].packed
    assert torch.equal(taken.dequantize(), natural.dequantize()[index])
    few = packed.take_rows(torch.tensor([3, 1, 40]))  # 3 rows: the file's layout
    assert not few.parts[0].packed
    assert torch.equal(few.dequantize(), natural.dequantize()[torch.tensor([3, 1, 40])])


def test_packing_at_load_and_its_switch(ops, monkeypatch: pytest.MonkeyPatch) -> None:
    raw = random_blocks("Q4_K", 32, 512)
    want = "avx512_vnni" in built_isas()
    assert pack_wanted(32) is want and not pack_wanted(24)
    assert KQuantWeight.from_gguf(raw, "Q4_K", (32, 512)).parts[0].packed is want
    assert not KQuantWeight.from_gguf(raw[:24], "Q4_K", (24, 512)).parts[0].packed
    monkeypatch.setattr(kquants_mod, "_PACKING", False)  # PIE_CTX_KQUANT_PACK=0
    assert not KQuantWeight.from_gguf(raw, "Q4_K", (32, 512)).parts[0].packed


def _resident_kb(region: mmap.mmap) -> int:
    """KB of a mapping resident in this process (its Rss in /proc/self/smaps)."""
    start = np.frombuffer(region, np.uint8).ctypes.data
    found = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if "-" in line.split()[0] and not line.split()[0].endswith(":"):
            found = int(line.split("-")[0], 16) == start
        elif found and line.startswith("Rss:"):
            return int(line.split()[1])
    raise AssertionError("mapping not found")


def test_packing_releases_the_pages_of_the_file_it_read(ops, tmp_path: Path) -> None:
    """The packed copy replaces the mapped bytes: their pages leave this process (they stay
    readable, from the file), so memory holds the weights once."""
    raw = random_blocks("Q6_K", 64, 4096)
    path = tmp_path / "w.bin"
    path.write_bytes(b"\0" * mmap.PAGESIZE + raw.tobytes())
    with open(path, "rb") as f:
        region = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    view = np.frombuffer(region, np.uint8)[mmap.PAGESIZE:].reshape(raw.shape)
    assert int(view.sum()) == int(raw.sum())  # every page read in
    assert _resident_kb(region) >= raw.nbytes // 1024
    w = KQuantWeight.from_gguf(view, "Q6_K", (64, 4096), pack=True)
    assert _resident_kb(region) <= 2 * mmap.PAGESIZE // 1024  # the partial pages at most
    assert torch.equal(w.parts[0].natural(), torch.from_numpy(raw))  # the copy is whole
    assert np.array_equal(view, raw)  # and the file's bytes read back
    # a copy in memory (writeable, not a mapping) is never released
    mine = raw.copy()
    KQuantWeight.from_gguf(mine, "Q6_K", (64, 4096), pack=True)
    assert np.array_equal(mine, raw)


@pytest.mark.parametrize("q8", [False, True], ids=["exact", "q8"])
def test_a_q4_k_m_model_gives_the_same_logits_packed(ops, tmp_path: Path, q8: bool,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    if "avx512_vnni" not in built_isas():
        pytest.skip("packing needs the AVX-512 VNNI path")
    monkeypatch.setattr(blocks_mod, "INT8_ACTIVATIONS", q8)
    path = write_kquant_gguf(tmp_path / "tiny.gguf", Q4_K_M)
    loaded = load_model(path, device="cpu", progress=False)
    c = loaded.config
    logits = {}
    for packing in (True, False):
        monkeypatch.setattr(kquants_mod, "_PACKING", packing)
        blocks = load_blocks(loaded.path)
        assert blocks is not None
        runner = ModelRunner(c, loaded.weights, _pool(c), 16, weight_format="gguf", blocks=blocks)
        parts = [part for p in runner.model.projections() if isinstance(p.weight, KQuantWeight)
                 for part in p.weight.parts]
        assert all(part.packed is (packing and part.rows % 16 == 0) for part in parts)
        assert sum(part.packed for part in parts) >= (len(parts) - 1 if packing else 0)
        for p in runner.model.projections():
            if q8 and isinstance(p.weight, KQuantWeight):
                p.use(["kquant_q8"] * p.buckets)
        logits[packing] = _forward(runner, [3, 7, 1, 9, 4, 4, 12, 5, 8, 2, 6, 11])
    assert torch.equal(logits[True], logits[False])
