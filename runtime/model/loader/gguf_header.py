"""Index a GGUF file: its metadata and where each tensor's bytes lie, with one pass over the
header and the tensor data left memory-mapped.

Owner: the GGUF loaders (``gguf_file``, ``gguf_transformers``). ``gguf.GGUFReader`` does
the same job with a numpy view per item: a Llama 3 vocabulary (128,256 tokens, 280,147
merges, their scores and types) makes that ~2.6 million views, 4-5 s of a 1B model's load
where llama.cpp takes 0.6 s in all. Here strings are sliced from the mapping, numeric
arrays are one ``numpy.frombuffer`` each, and the format's constants (type ids, block
sizes) come from the ``gguf`` package. The layout read is GGUF v2/v3 little-endian, as
llama.cpp writes it (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pie_ctx.proto.errors import ModelError

__all__ = ["GGUFHeader", "GGUFTensor", "index_gguf"]

_MAGIC = b"GGUF"
_VERSIONS = (2, 3)
_DEFAULT_ALIGNMENT = 32
# GGUF metadata value types: id -> struct format of a scalar (8: string, 9: array)
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q",
            11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")
_FLOAT_ITEMS = {"F32": np.float32, "F16": np.float16, "F64": np.float64,
                "I8": np.int8, "I16": np.int16, "I32": np.int32, "I64": np.int64}


@dataclass(frozen=True, slots=True)
class GGUFTensor:
    """One tensor of the file.

    Attributes:
        name: llama.cpp's name (``blk.0.attn_q.weight``).
        tensor_type: its ``gguf.GGMLQuantizationType``.
        shape: numpy order, rows first (``[out, in]`` for a matrix).
        data: a read-only view of the mapping: float/integer types as their items in
            ``shape``, block formats as uint8 ``[*shape[:-1], row bytes]`` (what
            ``gguf.quants.dequantize`` takes).
    """

    name: str
    tensor_type: Any
    shape: tuple[int, ...]
    data: np.ndarray


@dataclass(frozen=True, slots=True)
class GGUFHeader:
    """A GGUF file's metadata (key -> value; arrays as lists) and tensors, in file order."""

    metadata: dict[str, Any]
    tensors: list[GGUFTensor]


class _Cursor:
    """Reads little-endian values from the mapping at a moving offset."""

    def __init__(self, buf: mmap.mmap) -> None:
        self.buf, self.at = buf, 0

    def take(self, n: int) -> bytes:
        end = self.at + n
        if end > len(self.buf):
            raise ValueError(f"the header runs past the end of the file (byte {end})")
        out, self.at = self.buf[self.at:end], end
        return out

    def scalar(self, fmt: str) -> Any:
        s = struct.Struct("<" + fmt)
        (v,) = s.unpack(self.take(s.size))
        return v

    def u32(self) -> int:
        return int(_U32.unpack(self.take(4))[0])

    def u64(self) -> int:
        return int(_U64.unpack(self.take(8))[0])

    def string(self) -> str:
        return self.take(self.u64()).decode("utf-8")

    def strings(self, n: int) -> list[str]:
        buf, at, unpack = self.buf, self.at, _U64.unpack_from
        out = []
        for _ in range(n):
            (size,) = unpack(buf, at)
            at += 8
            out.append(buf[at:at + size].decode("utf-8"))
            at += size
        if at > len(buf):
            raise ValueError("a string array runs past the end of the file")
        self.at = at
        return out

    def value(self, kind: int) -> Any:
        if kind == _STRING:
            return self.string()
        if kind in _SCALARS:
            return self.scalar(_SCALARS[kind])
        if kind != _ARRAY:
            raise ValueError(f"unknown metadata value type {kind}")
        item, n = self.u32(), self.u64()
        if item == _STRING:
            return self.strings(n)
        if item in _SCALARS:
            dtype = np.dtype("<" + _SCALARS[item])
            return np.frombuffer(self.take(n * dtype.itemsize), dtype=dtype).tolist()
        return [self.value(item) for _ in range(n)]  # arrays of arrays


def index_gguf(path: Path) -> GGUFHeader:
    """Index the GGUF at ``path`` (its tensor data stays memory-mapped, read-only).

    Raises:
        ModelError: not a GGUF of a version this reads, a big-endian file, or a header or
            tensor that runs past the end of the file (a truncated download).
    """
    import gguf  # the format's constants: tensor type ids and block sizes

    try:
        with open(path, "rb") as f:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError) as e:  # ValueError: an empty file cannot be mapped
        raise ModelError(f"cannot read GGUF file {path} ({e})") from None
    try:
        cur = _Cursor(buf)
        if cur.take(4) != _MAGIC:
            raise ValueError("no GGUF magic at its start")
        version = cur.u32()
        if version not in _VERSIONS:
            if version & 0xFFFF == 0:
                raise ValueError("it is a big-endian GGUF; convert it to little-endian")
            raise ValueError(f"GGUF version {version} (this reads versions 2 and 3)")
        n_tensors, n_kv = cur.u64(), cur.u64()
        metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string()
            metadata[key] = cur.value(cur.u32())
        infos = []
        for _ in range(n_tensors):
            name = cur.string()
            dims = [cur.u64() for _ in range(cur.u32())]
            infos.append((name, dims, cur.u32(), cur.u64()))
        align = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
        if align <= 0 or align & (align - 1):
            raise ValueError(f"general.alignment {align} is not a power of two")
        start = -(-cur.at // align) * align
        data = np.frombuffer(buf, dtype=np.uint8)
        tensors, seen = [], set()
        for name, dims, type_id, offset in infos:
            if name in seen:
                raise ValueError(f"tensor {name!r} appears twice")
            seen.add(name)
            kind = gguf.GGMLQuantizationType(type_id)
            block, block_bytes = gguf.GGML_QUANT_SIZES[kind]
            shape = tuple(reversed(dims))
            elems = int(np.prod(shape, dtype=np.int64))
            size = elems // block * block_bytes
            lo = start + offset
            if lo + size > len(buf) or shape and shape[-1] % block:
                raise ValueError(f"tensor {name!r} does not fit the file")
            raw = data[lo:lo + size]
            item = _FLOAT_ITEMS.get(kind.name)
            if item is not None:
                view = raw.view(item).reshape(shape)
            else:
                view = raw.reshape(*shape[:-1], shape[-1] // block * block_bytes)
            tensors.append(GGUFTensor(name, kind, shape, view))
    except (ValueError, KeyError, struct.error, UnicodeDecodeError) as e:
        raise ModelError(f"GGUF file {path} is corrupt or truncated ({e}); download it "
                         "again") from None
    return GGUFHeader(metadata, tensors)
