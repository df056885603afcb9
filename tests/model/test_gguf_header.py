"""The GGUF header index (runtime.model.loader.gguf_header) against the gguf package's own
reader: every metadata value type, every tensor's bytes, and files cut or damaged."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from pie_ctx.errors import ModelError
from runtime.model.loader.gguf_header import index_gguf


def _write(path: Path) -> Path:
    """A GGUF with a value of every metadata type and tensors in float and block formats."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -5)
    w.add_uint16("t.u16", 65000)
    w.add_int16("t.i16", -300)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -7)
    w.add_float32("t.f32", 0.1)
    w.add_uint64("t.u64", 2**60)
    w.add_int64("t.i64", -(2**40))
    w.add_float64("t.f64", 1 / 3)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo ✓")
    w.add_array("t.strings", ["a", "", "ĠThe", "\u2581x", "<0x0A>"])
    w.add_array("t.ints", [3, 1, 4, 1, 5])
    w.add_array("t.floats", [0.5, -1.25, 3.0])
    w.add_array("t.bools", [True, False])
    w.add_array("t.nested", [[1, 2], [3]])
    rng = np.random.default_rng(0)
    w.add_tensor("f32", rng.standard_normal((3, 8)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((5,)).astype(np.float16))
    q = rng.standard_normal((4, 64)).astype(np.float32)
    w.add_tensor("q8", gguf.quants.quantize(q, gguf.GGMLQuantizationType.Q8_0),
                 raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("i32", np.arange(6, dtype=np.int32).reshape(2, 3))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_header_matches_gguf_reader(tmp_path: Path) -> None:
    path = _write(tmp_path / "all.gguf")
    ours = index_gguf(path)
    theirs = gguf.GGUFReader(path)
    want = {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert ours.metadata.keys() == want.keys()
    # the gguf package flattens arrays of arrays (a FIXME in its reader); they keep their
    # nesting here
    assert want.pop("t.nested") == [1, 2, 3]
    assert ours.metadata["t.nested"] == [[1, 2], [3]]
    for key, value in want.items():
        got = ours.metadata[key]
        assert got == value, key
        assert type(got) is type(value) or isinstance(value, (int, float)), key
    assert ours.metadata["t.strings"] == ["a", "", "ĠThe", "\u2581x", "<0x0A>"]
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for got, ref in zip(ours.tensors, theirs.tensors, strict=True):
        assert got.tensor_type == ref.tensor_type
        assert got.shape == tuple(reversed(ref.shape.tolist()))
        assert got.data.dtype == ref.data.dtype and got.data.shape == ref.data.shape
        assert np.array_equal(got.data, ref.data)
        assert not got.data.flags.writeable  # a view of the read-only mapping
        if got.tensor_type.name != "I32":  # (the gguf package dequantizes no integer type)
            np.testing.assert_array_equal(gguf.quants.dequantize(got.data, got.tensor_type),
                                          gguf.quants.dequantize(ref.data, ref.tensor_type))


@pytest.mark.parametrize("cut", [0, 3, 20, 200, -40])
def test_cut_files_raise_model_error(tmp_path: Path, cut: int) -> None:
    data = _write(tmp_path / "all.gguf").read_bytes()
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(data[:cut] if cut >= 0 else data[:cut])
    with pytest.raises(ModelError, match=r"cut\.gguf"):
        index_gguf(bad)


def test_damaged_header_raises_model_error(tmp_path: Path) -> None:
    data = bytearray(_write(tmp_path / "all.gguf").read_bytes())
    for name, edit in (("magic", (0, b"GGUX")), ("version", (4, (9).to_bytes(4, "little"))),
                       ("big-endian", (4, (3 << 24).to_bytes(4, "little")))):
        bad = bytearray(data)
        at, raw = edit
        bad[at:at + len(raw)] = raw
        path = tmp_path / f"{name}.gguf"
        path.write_bytes(bytes(bad))
        with pytest.raises(ModelError, match="corrupt or truncated"):
            index_gguf(path)
