"""Random-weight GGUF models in the exact shapes of real ones, for ``scale.py``.

Each shape is written as an F16 GGUF with the ``gguf`` package, tensor by tensor (the 8B
shape's 16 GB never sits in memory), then quantized by llama.cpp's own quantizer
(``llama_cpp.llama_model_quantize``) to the mix people download (Q4_K_M by default); the F16
intermediate is deleted. Without llama-cpp-python, the ``gguf`` package's own Q8_0 quantizer
writes the file directly (``--smoke`` on a machine without llama.cpp). Files are kept in a
folder (``<pie-ctx cache>/bench-scale`` unless told) and reused by name.

The tokenizer is synthetic but complete, so both engines load it: a byte-level BPE vocabulary
of the shape's size (256 byte tokens, then two- and three-byte tokens, each with its merge),
two control tokens for BOS/EOS, and a plain chat template. The weights are random (normal, std 0.02; norms 1), so the
text is meaningless and only speed, memory and loading are measured.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = ["Shape", "SHAPES", "build", "ftype_id", "bytes_per_token"]


@dataclass(frozen=True, slots=True)
class Shape:
    """One model shape (its GGUF architecture and sizes)."""

    label: str  # key prefix in the JSON: scale_<label>_...
    title: str
    arch: str  # "llama" or "qwen2"
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    rope_theta: float
    tied: bool
    qkv_bias: bool = False
    rope_factor: float | None = None  # llama3 rope scaling (low 1, high 4, original 8192)
    context: int = 131072


SHAPES: dict[str, Shape] = {
    "1b": Shape("1b", "Llama-3.2-1B", "llama", 2048, 16, 32, 8, 64, 8192, 128256, 500000.0,
                tied=True, rope_factor=32.0),
    "1.5b": Shape("1p5b", "Qwen2.5-1.5B", "qwen2", 1536, 28, 12, 2, 128, 8960, 151936,
                  1000000.0, tied=True, qkv_bias=True, context=32768),
    "8b": Shape("8b", "Llama-3.1-8B", "llama", 4096, 32, 32, 8, 128, 14336, 128256, 500000.0,
                tied=False, rope_factor=8.0),
    # --smoke: seconds to build and run; rows of 256 so that K-quants apply
    "tiny": Shape("tiny", "tiny Llama", "llama", 256, 2, 4, 2, 64, 512, 1024, 500000.0,
                  tied=True, rope_factor=32.0, context=4096),
}


def _byte_chars() -> list[str]:
    """GPT-2's byte -> printable character table (byte-level BPE token spelling)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def _vocabulary(size: int) -> tuple[list[str], list[str], list[int]]:
    """(tokens, merges, token types) of a byte-level BPE vocabulary of ``size`` tokens, the
    last two control tokens (BOS, EOS)."""
    b = _byte_chars()
    tokens, merges = list(b), []
    want = size - 2
    for i in range(256):
        for j in range(256):
            if len(tokens) >= want:
                break
            tokens.append(b[i] + b[j])
            merges.append(f"{b[i]} {b[j]}")
    for i in range(256):
        for j in range(256):
            for k in range(256):
                if len(tokens) >= want:
                    break
                tokens.append(b[i] + b[j] + b[k])
                merges.append(f"{b[i] + b[j]} {b[k]}")
            if len(tokens) >= want:
                break
        if len(tokens) >= want:
            break
    tokens += ["<|begin_of_text|>", "<|end_of_text|>"]
    types = [1] * (len(tokens) - 2) + [3, 3]  # normal, control
    return tokens, merges, types


def _rope_freqs(shape: Shape) -> np.ndarray:
    """llama.cpp's ``rope_freqs`` tensor of Llama 3's rope scaling (the divisor per
    frequency; low_freq_factor 1, high_freq_factor 4, original context 8192)."""
    factor, low, high, original = shape.rope_factor or 1.0, 1.0, 4.0, 8192
    inv = shape.rope_theta ** -(np.arange(0, shape.head_dim, 2, dtype=np.float64) / shape.head_dim)
    wavelen = 2 * math.pi / inv
    smooth = (original / wavelen - low) / (high - low)
    out = np.where(wavelen < original / high, 1.0,
                   np.where(wavelen > original / low, factor,
                            1.0 / ((1 - smooth) / factor + smooth)))
    return out.astype(np.float32)


def _tensors(shape: Shape) -> list[tuple[str, tuple[int, ...], bool]]:
    """(GGUF name, numpy shape, is a norm or bias) of every tensor, in file order."""
    s = shape
    qd, kvd = s.heads * s.head_dim, s.kv_heads * s.head_dim
    out: list[tuple[str, tuple[int, ...], bool]] = [("token_embd.weight", (s.vocab, s.hidden),
                                                     False)]
    for i in range(s.layers):
        p = f"blk.{i}."
        out += [(p + "attn_norm.weight", (s.hidden,), True),
                (p + "attn_q.weight", (qd, s.hidden), False),
                (p + "attn_k.weight", (kvd, s.hidden), False),
                (p + "attn_v.weight", (kvd, s.hidden), False)]
        if s.qkv_bias:
            out += [(p + "attn_q.bias", (qd,), True), (p + "attn_k.bias", (kvd,), True),
                    (p + "attn_v.bias", (kvd,), True)]
        out += [(p + "attn_output.weight", (s.hidden, qd), False),
                (p + "ffn_norm.weight", (s.hidden,), True),
                (p + "ffn_gate.weight", (s.ffn, s.hidden), False),
                (p + "ffn_up.weight", (s.ffn, s.hidden), False),
                (p + "ffn_down.weight", (s.hidden, s.ffn), False)]
    out.append(("output_norm.weight", (s.hidden,), True))
    if not s.tied:
        out.append(("output.weight", (s.vocab, s.hidden), False))
    return out


def _write(shape: Shape, path: Path, quant: str | None) -> None:
    """Write the random model as a GGUF: F16 matrices (``quant`` None) or the ``gguf``
    package's own ``quant`` blocks (Q8_0), norms and biases F32; one tensor in memory."""
    import gguf

    s = shape
    w = gguf.GGUFWriter(str(path), s.arch)
    w.add_name(f"random {s.title}")
    w.add_context_length(s.context)
    w.add_embedding_length(s.hidden)
    w.add_block_count(s.layers)
    w.add_feed_forward_length(s.ffn)
    w.add_head_count(s.heads)
    w.add_head_count_kv(s.kv_heads)
    w.add_key_length(s.head_dim)
    w.add_value_length(s.head_dim)
    w.add_rope_freq_base(s.rope_theta)
    w.add_layer_norm_rms_eps(1e-5 if s.arch == "llama" else 1e-6)
    w.add_rope_dimension_count(s.head_dim)
    w.add_file_type(1 if quant is None else 7)  # MOSTLY_F16 / MOSTLY_Q8_0
    tokens, merges, types = _vocabulary(s.vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("llama-bpe" if s.arch == "llama" else "qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(s.vocab - 2)
    w.add_eos_token_id(s.vocab - 1)
    w.add_add_bos_token(False)
    w.add_chat_template("{% for m in messages %}<|begin_of_text|>{{ m['role'] }}: "
                        "{{ m['content'] }}<|end_of_text|>{% endfor %}"
                        "{% if add_generation_prompt %}<|begin_of_text|>assistant: {% endif %}")
    names = _tensors(s)
    if s.rope_factor:
        names.append(("rope_freqs.weight", (s.head_dim // 2,), True))
    qtype = getattr(gguf.GGMLQuantizationType, quant) if quant else None

    def stored(name: str, dims: tuple[int, ...], small: bool) -> tuple[np.ndarray, object]:
        if name == "rope_freqs.weight":
            return _rope_freqs(s), None
        if small:
            values = (np.ones(dims, np.float32) if name.endswith("norm.weight")
                      else rng.normal(0, 0.02, dims).astype(np.float32))
            return values, None
        values = rng.normal(0, 0.02, dims).astype(np.float32)
        if qtype is None:
            return values.astype(np.float16), None
        return gguf.quants.quantize(values, qtype), qtype

    rng = np.random.default_rng(0)
    for name, dims, small in names:  # sizes only, first (the header precedes the data)
        if small or qtype is None:
            nbytes = int(np.prod(dims)) * (4 if small else 2)
            w.add_tensor_info(name, dims, np.dtype(np.float32 if small else np.float16),
                              nbytes)
        else:
            qshape = gguf.quant_shape_to_byte_shape(dims, qtype)
            w.add_tensor_info(name, qshape, np.dtype(np.uint8), int(np.prod(qshape)),
                              raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, dims, small in names:
        data, _ = stored(name, dims, small)
        w.write_tensor_data(data)
    w.close()


def ftype_id(lib: object, ftype: str) -> int:
    """llama.cpp's ``LLAMA_FTYPE_MOSTLY_<ftype>`` constant."""
    value = getattr(lib, f"LLAMA_FTYPE_MOSTLY_{ftype}", None)
    if value is None:
        raise SystemExit(f"llama.cpp has no file type {ftype!r} (try Q4_K_M, Q4_0, Q8_0)")
    return int(value)


def build(shape: Shape, folder: Path, ftype: str, lib: object | None,
          threads: int) -> Path:
    """The ``shape``'s GGUF in ``ftype`` under ``folder``, built if missing: F16, then
    llama.cpp's quantizer (``lib``: the ``llama_cpp`` module), the F16 file deleted after.
    Without ``lib`` the gguf package writes Q8_0 directly (``ftype`` is then Q8_0)."""
    folder.mkdir(parents=True, exist_ok=True)
    if lib is None:
        path = folder / f"random-{shape.title.replace(' ', '-')}-Q8_0-gguf.gguf"
        if not path.is_file():
            part = path.with_suffix(".part")
            _write(shape, part, "Q8_0")
            part.rename(path)
        return path
    path = folder / f"random-{shape.title.replace(' ', '-')}-{ftype}.gguf"
    if path.is_file():
        return path
    f16 = path.with_name(path.stem + "-F16.part")
    print(f"building {path.name}: writing F16 ({shape.title} shape, random weights)",
          flush=True)
    _write(shape, f16, None)
    params = lib.llama_model_quantize_default_params()  # type: ignore[attr-defined]
    params.ftype = ftype_id(lib, ftype)
    params.nthread = threads
    part = path.with_suffix(".part")
    print(f"building {path.name}: quantizing with llama.cpp", flush=True)
    rc = lib.llama_model_quantize(str(f16).encode(), str(part).encode(),  # type: ignore[attr-defined]
                                  params)
    f16.unlink()
    if rc != 0:
        part.unlink(missing_ok=True)
        raise SystemExit(f"llama_model_quantize failed ({rc}) for {path.name}")
    part.rename(path)
    return path


def bytes_per_token(path: Path, context: int) -> int:
    """Bytes a decode step reads at ``context`` tokens: every tensor of the file but the
    embedding table (one row of it; unless tied, when it is also the lm_head), plus the
    f16/bf16 KV of ``context`` tokens."""
    import gguf

    r = gguf.GGUFReader(str(path))
    names = {t.name for t in r.tensors}
    total = sum(int(t.n_bytes) for t in r.tensors
                if t.name != "token_embd.weight" or "output.weight" not in names)
    arch = r.fields["general.architecture"].contents()
    layers = int(r.fields[f"{arch}.block_count"].contents())
    kv = int(r.fields[f"{arch}.attention.head_count_kv"].contents())
    hd = int(r.fields[f"{arch}.attention.key_length"].contents())
    return total + context * layers * 2 * kv * hd * 2
