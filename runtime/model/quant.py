"""int8 weights for the whole model: calibrate, smooth, quantize (``weights="int8"``).

Owner: the model runner, once at load, on a model built in float. Why each step:

* Projections then run int8 x int8 GEMMs with activations quantized per row at each call
  (``runtime.model.matmul``). A few input channels of an LLM's activations are orders of
  magnitude larger than the rest, so a row's int8 grid is set by those and the others
  lose their precision: per-row quantization alone costs SmolLM2 +2.7% perplexity.
* SmoothQuant (Xiao et al. 2023) moves that range into the weights: for each input
  channel j, ``s_j = max|x_j|^alpha / max|W_:,j|^(1 - alpha)``, then ``x / s`` and
  ``W * s`` give the same product with both sides easy to quantize. ``max|x_j|`` comes from
  one dense forward over :data:`CALIBRATION` at load (:func:`calibrate`, which GGUF
  blocks' outlier split uses too; kept per machine, so only a machine's first load of a
  model runs it). ``1/s`` is folded where it costs nothing: into the RMSNorm weight
  before q/k/v and before gate/up, into the ``up`` rows before ``down``, into the ``v``
  rows before ``o_proj`` (one factor per kv head and dim, shared by the query heads of a
  group); the lm_head divides its input at run time (the final norm's output is also
  returned as hidden states, so it must stay unscaled).
* Weights are then quantized per output row (symmetric int8). The embedding table, tied
  to the lm_head or not, is stored the same way and dequantized row by row on lookup.

Measured on SmolLM2-135M (docs/models.md): perplexity +0.7% against fp32 on the shipped
text, where per-row activations without smoothing cost +2.7% and fbgemm's per-tensor
activations +33%.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import zlib
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pie_ctx.proto.errors import InvalidArgument
from runtime.model import machine_cache
from runtime.model.blocks import BlockEmbedding
from runtime.model.layers import LayerWeights
from runtime.model.matmul import Int8Weight, Projection

__all__ = ["ALPHA", "CALIBRATION", "WEIGHT_FORMATS", "QuantEmbedding", "calibrate",
           "calibration_tokens", "quantize_int8"]

# fp32: unquantized, in the compute dtype; gguf: a GGUF's own blocks (the formats of
# runtime.model.formats; runtime.model.gguf_weights)
WEIGHT_FORMATS = ("fp32", "int8", "gguf")

ALPHA = 0.5  # SmoothQuant's migration strength (0.3-0.8 measured; 0.5 was best)

# Chat turns and prose the model sees at load to measure its activation ranges: the kinds of
# text it serves (questions, instructions, code, answers), none of it from the evaluation text.
CALIBRATION: list[tuple[str, str]] = [
    ("What is the capital of France?", "The capital of France is Paris."),
    ("Write a haiku about the sea.", "Grey waves fold and break,\nsalt wind carries gull voices,"
                                     "\nthe tide keeps its time."),
    ("How do I reverse a list in Python?", "Use `items.reverse()` to reverse it in place, or "
                                           "`items[::-1]` to get a reversed copy."),
    ("Explain gravity to a child.", "Gravity is an invisible pull. The Earth pulls everything "
                                    "toward it, which is why a ball you throw comes back down."),
    ("Give me three tips for a job interview.", "1. Research the company.\n2. Prepare short "
                                                "stories about your work.\n3. Ask questions."),
    ("Summarise the water cycle in one sentence.", "Water evaporates, condenses into clouds, "
                                                   "falls as rain or snow, and flows back to "
                                                   "the sea."),
    ("Extract the name and age as JSON: Maria is 34.", '{"name": "Maria", "age": 34}'),
    ("Translate 'thank you very much' into German.", "Vielen Dank."),
]
PROSE = (
    "The library opened at nine, but the queue had started long before. People came for the "
    "warmth, for the newspapers, for the quiet tables by the tall windows where the light fell "
    "in long bright bars across the floor. A librarian with a grey cardigan unlocked the doors, "
    "nodded to the regulars, and went back to sorting the returns: a cookbook, two thrillers, "
    "a guide to growing tomatoes on a balcony, and a battered atlas whose maps still showed "
    "countries that no longer existed."
)


def calibration_tokens(tokenizer: Any) -> list[int]:
    """The calibration text rendered with the model's chat template and tokenized."""
    ids: list[int] = []
    for user, assistant in CALIBRATION:
        chat = tokenizer.render_chat([{"role": "user", "content": user},
                                      {"role": "assistant", "content": assistant}])
        ids += tokenizer.encode(chat) if isinstance(chat, str) else list(chat)
    return ids + tokenizer.encode(PROSE)


@dataclass(slots=True)
class QuantEmbedding:
    """An embedding table held as :class:`Int8Weight` (one scale per token row)."""

    table: Int8Weight  # [vocab, hidden]
    divisor: torch.Tensor | None = None  # [hidden]: rows are stored multiplied by this
    dtype: torch.dtype = torch.float32

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        """Tensor[T] ids -> Tensor[T, hidden] in ``dtype``."""
        rows = self.table.q.index_select(0, tokens).float()
        rows.mul_(self.table.scale.index_select(0, tokens)[:, None])
        if self.divisor is not None:
            rows.div_(self.divisor)
        return rows.to(self.dtype)


class _Recorder:
    """Stands in for a projection during calibration and keeps ``max|x|`` per input channel.
    ``product`` False: only the input is wanted (the lm_head, whose output the pass drops:
    a 128k vocabulary made its logits the pass's biggest product); it returns no columns."""

    def __init__(self, proj: Projection, product: bool = True) -> None:
        self.proj, self.product = proj, product
        self.amax: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        m = x.detach().abs().amax(dim=0).float()
        self.amax = m if self.amax is None else torch.maximum(self.amax, m)
        return self.proj(x) if self.product else x.new_empty((x.shape[0], 0))


_NAMES = ("qkv", "o_proj", "gate_up", "down")


# the code whose numbers a calibration pass's amax are: its forward and this module
_CALIBRATION_CODE = [Path(__file__).with_name(n) for n in (
    "quant.py", "reference.py", "model.py", "layers.py", "rope.py", "matmul.py")] + [
    Path(__file__).parents[1] / "kv" / "layout.py"]


def calibrate(model: Any, tokens: list[int]) -> tuple[list[dict[str, torch.Tensor]], torch.Tensor]:
    """Each projection's input ``max|x|`` per channel over one dense pass of ``tokens``.

    What both users of a calibration start from: ``quantize_int8`` (SmoothQuant's factors)
    and ``runtime.model.gguf_weights.use_blocks`` (``blocks_q8``'s outlier channels,
    ``runtime.model.blocks.outlier_channels``). The pass is one dense forward of the
    float model (~10 s for the default model on a busy 2-core machine), so its result is
    kept per machine (:mod:`runtime.model.machine_cache`, kind ``"calibration"``), keyed
    by a digest of the model's weights and config, its dtype, the tokens, and the code of
    the pass; a hit returns the same bits the pass would.

    Args:
        model: a :class:`runtime.model.model.Transformer` with float weights (or built on
            a GGUF's block weights, whose exact kernel the pass runs), on CPU.
        tokens: the token ids to run (:func:`calibration_tokens`).

    Returns:
        (per layer ``{"qkv" | "o_proj" | "gate_up" | "down": Tensor[in] fp32}``,
        the lm_head's Tensor[hidden] fp32).
    """
    if machine_cache.mode() == "off":  # (no digest of the weights either)
        return _dense_pass(model, tokens)
    sizes = [{n: getattr(lw, n).shape[1] for n in _NAMES} for lw in model.layers]
    head_size = model.config.hidden_size
    inputs = {"weights": _weights_digest(model), "config": model.config, "dtype": model.dtype,
              "device": model.device,
              "tokens": hashlib.blake2b(array("q", tokens).tobytes(), digest_size=16).hexdigest(),
              "code": machine_cache.source_digest(*_CALIBRATION_CODE)}
    (layers, head), _ = machine_cache.cached(
        "calibration", inputs, lambda: _dense_pass(model, tokens), _encode_amax,
        lambda data: _decode_amax(data, sizes, head_size))
    return layers, head


def _weights_digest(model: Any) -> str:
    """A digest of every float tensor the dense pass reads (a CRC-32 of each one's bytes:
    ~0.2 s for the default model's 540 MB, against seconds for the pass)."""
    parts = [("embed", model.embed), ("final_norm", model.final_norm)]
    head = getattr(model.lm_head, "weight", None)
    if head is not model.embed:
        parts.append(("lm_head", head))
    for i, lw in enumerate(model.layers):
        parts += [(f"{i}.norm{j}", t) for j, t in enumerate(lw.norms())]
        for n in _NAMES:
            proj = getattr(lw, n)
            parts += [(f"{i}.{n}", proj.weight), (f"{i}.{n}.bias", proj.bias)]
    h = hashlib.blake2b(digest_size=16)
    if isinstance(model.embed, BlockEmbedding):  # the lookups read the table's blocks
        parts[0] = ("embed", model.embed.table)
    for name, t in list(parts):
        if t is not None and dataclasses.is_dataclass(t) and not isinstance(t, torch.Tensor):
            # a GGUF block weight the model was built on: its arrays (the pass reads them)
            parts += [(f"{name}.{f.name}", getattr(t, f.name)) for f in dataclasses.fields(t)
                      if isinstance(getattr(t, f.name), torch.Tensor)]
            h.update(f"{name}:{type(t).__name__};".encode())
    for name, t in parts:
        if t is None:
            h.update(f"{name}:none;".encode())
            continue
        if dataclasses.is_dataclass(t) and not isinstance(t, torch.Tensor):
            continue  # digested by its arrays above
        if not isinstance(t, torch.Tensor):
            raise InvalidArgument(f"calibration runs on a float model; {name} is "
                                  f"{type(t).__name__}")
        flat = t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy()
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}:{zlib.crc32(flat)};".encode())
    return h.hexdigest()


def _encode_amax(value: tuple[list[dict[str, torch.Tensor]], torch.Tensor]) -> dict[str, Any]:
    def b64(t: torch.Tensor) -> str:
        return base64.b64encode(t.float().contiguous().numpy().tobytes()).decode()

    layers, head = value
    return {"layers": [{n: b64(t) for n, t in amax.items()} for amax in layers],
            "head": b64(head)}


def _decode_amax(data: Any, sizes: list[dict[str, int]],
                 head_size: int) -> tuple[list[dict[str, torch.Tensor]], torch.Tensor]:
    """The amax stored by :func:`_encode_amax`; ValueError unless they have ``sizes``."""

    def tensor(text: str, size: int) -> torch.Tensor:
        raw = base64.b64decode(text, validate=True)
        if len(raw) != 4 * size:
            raise ValueError(f"{len(raw)} bytes where {size} floats belong")
        return torch.frombuffer(bytearray(raw), dtype=torch.float32)

    layers = data["layers"]
    if len(layers) != len(sizes) or any(set(a) != set(s) for a, s in zip(layers, sizes, strict=True)):
        raise ValueError("another model's layers")
    return ([{n: tensor(a[n], s[n]) for n in _NAMES} for a, s in zip(layers, sizes, strict=True)],
            tensor(data["head"], head_size))


def _dense_pass(model: Any, tokens: list[int]) -> tuple[list[dict[str, torch.Tensor]], torch.Tensor]:
    """:func:`calibrate`'s pass itself: every projection's input recorded over one dense
    forward of ``tokens``."""
    from runtime.model.reference import dense_forward  # the reference imports the model

    recorders = [{n: _Recorder(getattr(lw, n)) for n in _NAMES} for lw in model.layers]
    head = _Recorder(model.lm_head, product=False)
    for lw, recs in zip(model.layers, recorders, strict=True):
        for n, r in recs.items():
            setattr(lw, n, r)
    model.lm_head = head
    try:
        dense_forward(model, tokens)
    finally:
        for lw, recs in zip(model.layers, recorders, strict=True):
            for n, r in recs.items():
                setattr(lw, n, r.proj)
        model.lm_head = head.proj
    return ([{n: r.amax for n, r in recs.items()} for recs in recorders],  # type: ignore[misc]
            head.amax)  # type: ignore[return-value]


def _smoothing(amax: torch.Tensor, weight: torch.Tensor, alpha: float) -> torch.Tensor:
    """SmoothQuant's per-input-channel factor for activations ``amax`` [in] and W [out, in]."""
    w = weight.float().abs().amax(dim=0).clamp_min(1e-5)  # [in]
    return (amax.clamp_min(1e-5) ** alpha / w ** (1 - alpha)).clamp_min(1e-5)


def _quantize_layer(lw: LayerWeights, amax: dict[str, torch.Tensor], config: Any,
                    alpha: float) -> None:
    c = config
    qd, kvd, d = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.head_dim
    qkv_w = lw.qkv.weight.float().clone()  # type: ignore[union-attr]
    qkv_b = lw.qkv.bias.float().clone() if lw.qkv.bias is not None else None
    gu_w = lw.gate_up.weight.float().clone()  # type: ignore[union-attr]
    o_w = lw.o_proj.weight.float()  # type: ignore[union-attr]
    down_w = lw.down.weight.float()  # type: ignore[union-attr]
    inter = c.intermediate_size

    # o_proj's input channel (head h, dim j) comes from v of kv head h // G: one factor per
    # (kv head, dim), the largest over the group's query heads.
    group = c.num_heads // c.num_kv_heads
    a_o = amax["o_proj"].view(c.num_kv_heads, group, d).amax(dim=1)  # [KVH, D]
    w_o = o_w.abs().amax(dim=0).view(c.num_kv_heads, group, d).amax(dim=1).clamp_min(1e-5)
    s_v = (a_o.clamp_min(1e-5) ** alpha / w_o ** (1 - alpha)).clamp_min(1e-5)  # [KVH, D]
    s_o = s_v[:, None, :].expand(-1, group, -1).reshape(qd)  # [H*D]
    qkv_w[qd + kvd:] /= s_v.reshape(kvd, 1)
    if qkv_b is not None:
        qkv_b[qd + kvd:] /= s_v.reshape(kvd)
    s_down = _smoothing(amax["down"], down_w, alpha)  # [I]
    gu_w[inter:] /= s_down[:, None]  # up rows: silu(gate) * up / s
    s_qkv = _smoothing(amax["qkv"], qkv_w, alpha)  # [hidden]
    s_gu = _smoothing(amax["gate_up"], gu_w, alpha)  # [hidden]

    lw.input_norm = (lw.input_norm.float() / s_qkv).to(lw.input_norm.dtype)
    lw.post_norm = (lw.post_norm.float() / s_gu).to(lw.post_norm.dtype)
    lw.qkv = Projection(Int8Weight.quantize(qkv_w * s_qkv), None if qkv_b is None else
                        qkv_b.to(lw.qkv.bias.dtype))  # type: ignore[union-attr]
    lw.o_proj = Projection(Int8Weight.quantize(o_w * s_o), lw.o_proj.bias)
    lw.gate_up = Projection(Int8Weight.quantize(gu_w * s_gu))
    lw.down = Projection(Int8Weight.quantize(down_w * s_down), lw.down.bias)
    lw.smoothing = {"qkv_in": s_qkv, "v_out": s_v.reshape(kvd), "o_in": s_o, "gate_up_in": s_gu,
                    "up_out": s_down, "down_in": s_down}  # LoRA folds these in


class _SmoothedHead:
    """The lm_head as int8 over ``x / divisor`` (the final norm's output stays unscaled)."""

    __slots__ = ("proj", "divisor")

    def __init__(self, proj: Projection, divisor: torch.Tensor) -> None:
        self.proj, self.divisor = proj, divisor

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x / self.divisor)


def quantize_int8(model: Any, calibration: list[int], alpha: float = ALPHA) -> None:
    """Replace ``model``'s float projections, lm_head and embedding with smoothed int8
    ones, in place (see the module docstring); their kernels are chosen after
    (``runtime.model.numerics.finish_weights``).

    Args:
        model: a :class:`runtime.model.model.Transformer` built in float, on CPU.
        calibration: token ids to measure activation ranges on (:func:`calibration_tokens`).
        alpha: SmoothQuant migration strength.

    Raises:
        InvalidArgument: the model is not on CPU, is already int8, or no calibration tokens.
    """
    if model.device.type != "cpu":
        raise InvalidArgument("int8 weights run on CPU; on a GPU use dtype bfloat16")
    if model.weight_format != "fp32":
        raise InvalidArgument("the model is already int8")
    if not calibration:
        raise InvalidArgument("int8 weights need calibration tokens (calibration_tokens())")
    layer_amax, head_amax = calibrate(model, calibration)
    for lw, amax in zip(model.layers, layer_amax, strict=True):
        _quantize_layer(lw, amax, model.config, alpha)
    head_w = model.lm_head.weight.float()
    s_head = _smoothing(head_amax, head_w, alpha)  # [hidden]
    head = Int8Weight.quantize(head_w * s_head)
    tied = model.lm_head.weight is model.embed
    model.lm_head = _SmoothedHead(Projection(head, buckets=2), s_head)
    if tied:  # one int8 table serves both: E = table / s_head
        model.embed = QuantEmbedding(head, s_head, model.dtype)
    else:
        model.embed = QuantEmbedding(Int8Weight.quantize(model.embed), None, model.dtype)
    model.weight_format = "int8"
