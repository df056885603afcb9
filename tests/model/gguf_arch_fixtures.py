"""Tiny random GGUF files of the architectures people download, written as llama.cpp does.

Owner: tests/model. Each file comes from a seeded random transformers model of the
architecture (hidden 64, 2 layers), written with ``gguf.GGUFWriter`` under llama.cpp's
tensor names (``gguf.get_tensor_name_map``) and metadata keys, with llama.cpp's own
conversions: Q/K rows permuted for the ``llama`` architecture (Llama 3.x, Mistral), Gemma's
norm weights stored as ``1 + w``, Llama 3's rope scaling as a ``rope_freqs`` tensor, Phi-3's
fused ``attn_qkv`` and ``ffn_up`` (gate and up). Projections are stored Q8_0, the rest F32.

The vocabulary is small and of the architecture's kind: byte-level BPE (``gpt2``) for
Llama 3 and Qwen, sentencepiece (``llama``: ``<0xNN>`` byte pieces and scores) for Mistral,
Phi-3 and Gemma, with the control tokens each chat template writes. The chat templates are
short versions of the real models' (their tool sections kept as the models write them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
import transformers
from transformers import PreTrainedModel

from runtime.model.loader.gguf_file import permute_qk, unpermute_qk
from runtime.model.loader.gguf_tokenizer import byte_to_unicode

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS = 64, 128, 2, 4, 2

LLAMA3_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content'] %}"
    "{%- set messages = messages[1:] %}{%- else %}{%- set system_message = '' %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    "{%- if tools is not none %}{{- 'Environment: ipython\\n' }}{%- endif %}"
    "{{- 'Cutting Knowledge Date: December 2023\\n\\n' }}{{- system_message }}{{- '<|eot_id|>' }}"
    "{%- if tools is not none %}{{- '<|start_header_id|>user<|end_header_id|>\\n\\n' }}"
    "{{- 'Given the following functions, please respond with a JSON for a function call with '"
    " ~ 'its proper arguments that best answers the given prompt.\\n\\n' }}"
    "{{- 'Respond in the format {\"name\": function name, \"parameters\": dictionary of argument "
    "name and its value}.' }}{{- 'Do not use variables.\\n\\n' }}"
    "{%- for t in tools %}{{- t | tojson(indent=4) }}{{- '\\n\\n' }}{%- endfor %}"
    "{{- '<|eot_id|>' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role in ['ipython', 'tool'] %}"
    "{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' }}{{- message['content'] | tojson }}"
    "{{- '<|eot_id|>' }}"
    "{%- elif 'tool_calls' in message %}{%- set tool_call = message.tool_calls[0].function %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{{- '<|python_tag|>{\"name\": \"' + tool_call.name + '\", \"parameters\": ' }}"
    "{{- tool_call.arguments | tojson }}{{- '}' }}{{- '<|eom_id|>' }}"
    "{%- else %}{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' "
    "+ message['content'] | trim + '<|eot_id|>' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif %}"
)

QWEN_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}"
    "{%- else %}{{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}"
    "{%- endif %}"
    "{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query."
    "\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": "
    "<function-name>, \"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>assistant' }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls | default([]) %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' }}{{- tool_call.name }}{{- '\", \"arguments\": ' }}"
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}{{- '<|im_start|>user\\n<tool_response>\\n' }}"
    "{{- message.content }}{{- '\\n</tool_response><|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Qwen3's template is Qwen2.5's with thinking: <think> blocks and enable_thinking.
QWEN3_TEMPLATE = QWEN_TEMPLATE.replace(
    "{{- '<|im_start|>assistant\\n' }}{%- endif %}",
    "{{- '<|im_start|>assistant\\n' }}{%- if enable_thinking is defined and enable_thinking is "
    "false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}")

MISTRAL_TEMPLATE = (
    "{{- bos_token }}{%- for message in messages %}"
    "{%- if message['role'] == 'user' %}{{- '[INST] ' + message['content'] + ' [/INST]' }}"
    "{%- elif message['role'] == 'assistant' %}{{- ' ' + message['content'] + eos_token }}"
    "{%- endif %}{%- endfor %}"
)
PHI3_TEMPLATE = (
    "{% for message in messages %}{{ '<|' + message['role'] + '|>\\n' + message['content'] "
    "+ '<|end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}"
    "{% endif %}"
)
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)


@dataclass(frozen=True)
class Vocab:
    """A GGUF tokenizer: ``model`` ``gpt2`` (byte-level BPE) or ``llama`` (sentencepiece)."""

    model: str
    pre: str | None
    tokens: list[str]
    types: list[int]
    bos: int
    eos: int
    merges: list[str] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    eot: int | None = None  # Llama 3's <|eot_id|>


def byte_level_vocab(control: list[str], pre: str, bos: str, eos: str,
                     eot: str | None = None) -> Vocab:
    """Control tokens, the 256 byte symbols and a few merges."""
    merges = ["h e", "l l", "he ll", "hell o", "Ġ w", "Ġw o", "1 2", "Ġ t", "o o"]
    tokens = control + [byte_to_unicode()[b] for b in range(256)] + [m.replace(" ", "")
                                                                       for m in merges]
    types = [3] * len(control) + [1] * (len(tokens) - len(control))
    return Vocab("gpt2", pre, tokens, types, tokens.index(bos), tokens.index(eos), merges=merges,
                 eot=None if eot is None else tokens.index(eot))


def sentencepiece_vocab(control: list[str], bos: str, eos: str) -> Vocab:
    """``<unk>``, the control tokens, 256 byte pieces, then scored pieces."""
    pieces = ["▁", "e", "h", "l", "o", "t", "▁h", "he", "ll", "▁he", "llo", "▁hello", "▁t",
              "▁the", "th", "r", "▁w", "w", "a", "s", "i", "n"]
    tokens = ["<unk>", *control] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [2] + [3] * len(control) + [6] * 256 + [1] * len(pieces)
    scores = [0.0] * (1 + len(control) + 256) + [-float(i) for i in range(len(pieces))]
    return Vocab("llama", None, tokens, types, tokens.index(bos), tokens.index(eos),
                 scores=scores)


@dataclass(frozen=True)
class ArchCase:
    """One architecture: its transformers config, llama.cpp name, vocabulary, template and
    the extra metadata llama.cpp writes for it."""

    name: str
    gguf_arch: str
    vocab: Vocab
    template: str
    config: dict[str, Any]
    hf_class: str
    meta: dict[str, Any] = field(default_factory=dict)
    tensors: dict[str, np.ndarray] = field(default_factory=dict)  # written as they are
    rope_freqs: bool = False  # Llama 3 rope scaling, stored as llama.cpp's rope_freqs
    norm_shift: float = 0.0  # Gemma: llama.cpp stores norm weights as 1 + w


_LLAMA3_CONTROL = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                   "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"]
_QWEN_CONTROL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>",
                 "<think>", "</think>"]
_LLAMA3_SCALING = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def _case(name: str) -> ArchCase:
    llama3 = byte_level_vocab(_LLAMA3_CONTROL, "llama-bpe", "<|begin_of_text|>", "<|eot_id|>",
                              eot="<|eot_id|>")
    qwen = byte_level_vocab(_QWEN_CONTROL, "qwen2", "<|endoftext|>", "<|im_end|>")
    spm = sentencepiece_vocab(["<s>", "</s>"], "<s>", "</s>")
    common = dict(hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                  num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                  max_position_embeddings=4096, rms_norm_eps=1e-5)
    if name == "llama3.2":  # tied embeddings, llama3 rope scaling (factor 32)
        return ArchCase(name, "llama", llama3, LLAMA3_TEMPLATE,
                        common | dict(rope_theta=500000.0, tie_word_embeddings=True,
                                      max_position_embeddings=131072,
                                      rope_scaling=_LLAMA3_SCALING), "LlamaForCausalLM",
                        rope_freqs=True)
    if name == "llama3.1":  # untied, factor 8
        return ArchCase(name, "llama", llama3, LLAMA3_TEMPLATE,
                        common | dict(rope_theta=500000.0, tie_word_embeddings=False,
                                      max_position_embeddings=131072,
                                      rope_scaling=_LLAMA3_SCALING | {"factor": 8.0}),
                        "LlamaForCausalLM", rope_freqs=True)
    if name == "qwen2.5":  # q/k/v bias, tied (the small ones)
        return ArchCase(name, "qwen2", qwen, QWEN_TEMPLATE,
                        common | dict(rope_theta=1000000.0, tie_word_embeddings=True),
                        "Qwen2ForCausalLM")
    if name == "qwen3":  # q/k norms, head_dim apart from hidden / heads
        return ArchCase(name, "qwen3", qwen, QWEN3_TEMPLATE,
                        common | dict(rope_theta=1000000.0, tie_word_embeddings=True,
                                      head_dim=32), "Qwen3ForCausalLM")
    if name == "mistral":  # a llama GGUF with a sentencepiece vocabulary
        return ArchCase(name, "llama", spm, MISTRAL_TEMPLATE,
                        common | dict(rope_theta=1000000.0, tie_word_embeddings=False),
                        "LlamaForCausalLM")
    if name == "phi3":  # fused qkv and gate_up, untied, no sliding window
        phi = sentencepiece_vocab(["<s>", "</s>", "<|user|>", "<|assistant|>", "<|end|>"],
                                  "<s>", "<|end|>")
        return ArchCase(name, "phi3", phi, PHI3_TEMPLATE, common | dict(rope_theta=10000.0,
                                                     tie_word_embeddings=False),
                        "Phi3ForCausalLM", meta={"rope.scaling.original_context_length": 4096})
    if name == "phi3-4k":  # Phi-3-mini-4k: a sliding window (2047 there, 8 here)
        phi = sentencepiece_vocab(["<s>", "</s>", "<|user|>", "<|assistant|>", "<|end|>"],
                                  "<s>", "<|end|>")
        return ArchCase(name, "phi3", phi, PHI3_TEMPLATE,
                        common | dict(rope_theta=10000.0, tie_word_embeddings=False,
                                      sliding_window=8), "Phi3ForCausalLM",
                        meta={"rope.scaling.original_context_length": 4096,
                              "attention.sliding_window": 8})
    if name in ("phi3.5", "phi4-mini"):  # LongRoPE; Phi-4-mini: 3/4 of each head rotated, tied
        rotary = 16 if name == "phi3.5" else 12
        short = np.linspace(1.0, 1.5, rotary // 2).round(3)
        long = np.linspace(1.0, 20.0, rotary // 2).round(3)
        attn = math.sqrt(1 + math.log(131072 / 4096) / math.log(4096))
        vocab = sentencepiece_vocab(["<s>", "</s>", "<|user|>", "<|assistant|>", "<|end|>"],
                                    "<s>", "<|end|>") if name == "phi3.5" else byte_level_vocab(
            ["<|endoftext|>", "<|user|>", "<|assistant|>", "<|end|>"], "gpt-4o",
            "<|endoftext|>", "<|end|>")
        return ArchCase(name, "phi3", vocab, PHI3_TEMPLATE,
                        common | dict(rope_theta=10000.0, tie_word_embeddings=name != "phi3.5",
                                      max_position_embeddings=131072,
                                      original_max_position_embeddings=4096,
                                      partial_rotary_factor=rotary / 16,
                                      rope_scaling={"rope_type": "longrope",
                                                    "short_factor": short.tolist(),
                                                    "long_factor": long.tolist()}),
                        "Phi3ForCausalLM",
                        meta={"rope.scaling.original_context_length": 4096,
                              "rope.scaling.attn_factor": attn, "rope.dimension_count": rotary},
                        tensors={"rope_factors_short.weight": short.astype(np.float32),
                                 "rope_factors_long.weight": long.astype(np.float32)})
    gemma = sentencepiece_vocab(["<pad>", "<eos>", "<bos>", "<start_of_turn>",
                                 "<end_of_turn>"], "<bos>", "<eos>")
    if name == "gemma2":
        return ArchCase(name, "gemma2", gemma, GEMMA_TEMPLATE,
                        common | dict(rope_theta=10000.0, head_dim=16, sliding_window=8,
                                      tie_word_embeddings=True), "Gemma2ForCausalLM",
                        meta={"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
                              "attention.sliding_window": 8}, norm_shift=1.0)
    if name == "gemma3":  # 6 layers: five sliding, one global, as Gemma 3 alternates them
        return ArchCase(name, "gemma3", gemma, GEMMA_TEMPLATE,
                        common | dict(rope_theta=1000000.0, head_dim=16, sliding_window=8,
                                      tie_word_embeddings=True, num_hidden_layers=6),
                        "Gemma3ForCausalLM", meta={"attention.sliding_window": 8},
                        norm_shift=1.0)
    if name == "gemma3-4b":  # Gemma 3 4B and up: linear rope scaling (x8) on global layers
        return ArchCase(name, "gemma3", gemma, GEMMA_TEMPLATE,
                        common | dict(rope_theta=1000000.0, head_dim=16, sliding_window=8,
                                      tie_word_embeddings=True, num_hidden_layers=6,
                                      rope_scaling={"rope_type": "linear", "factor": 8.0}),
                        "Gemma3ForCausalLM",
                        meta={"attention.sliding_window": 8, "rope.scaling.factor": 8.0,
                              "rope.scaling.type": "linear"}, norm_shift=1.0)
    raise ValueError(name)


NATIVE_CASES = ("llama3.2", "llama3.1", "qwen2.5", "qwen3", "mistral", "phi3")
TRANSFORMERS_CASES = ("gemma2", "gemma3", "gemma3-4b", "phi3-4k", "phi3.5", "phi4-mini")


def case(name: str) -> ArchCase:
    """The :class:`ArchCase` called ``name`` (see :data:`NATIVE_CASES`)."""
    return _case(name)


def make_model(c: ArchCase, seed: int = 0) -> PreTrainedModel:
    """The seeded random transformers model of ``c`` (eval, fp32, eager attention)."""
    torch.manual_seed(seed)
    cfg_cls = {"LlamaForCausalLM": transformers.LlamaConfig,
               "Qwen2ForCausalLM": transformers.Qwen2Config,
               "Qwen3ForCausalLM": transformers.Qwen3Config,
               "Phi3ForCausalLM": transformers.Phi3Config,
               "Gemma2ForCausalLM": transformers.Gemma2Config,
               "Gemma3ForCausalLM": transformers.Gemma3TextConfig}[c.hf_class]
    cfg = cfg_cls(vocab_size=len(c.vocab.tokens), bos_token_id=c.vocab.bos,
                  eos_token_id=c.vocab.eos, pad_token_id=None, **c.config)
    model = getattr(transformers, c.hf_class)(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(0.1 * torch.randn_like(p) + (0.0 if c.norm_shift else 1.0))
            else:
                p.normal_(0.0, 0.15)
    return model.eval()


def _rope_freqs(theta: float, head_dim: int, scaling: dict[str, Any]) -> np.ndarray:
    """llama.cpp's ``rope_freqs`` (the divisor of each frequency) for llama3 rope scaling."""
    inv = theta ** -(np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv
    old = scaling["original_max_position_embeddings"]
    low_wl, high_wl = old / scaling["low_freq_factor"], old / scaling["high_freq_factor"]
    smooth = (old / wavelen - scaling["low_freq_factor"]) / (
        scaling["high_freq_factor"] - scaling["low_freq_factor"])
    factor = scaling["factor"]
    out = np.where(wavelen < high_wl, 1.0, np.where(wavelen > low_wl, factor,
                                                    1.0 / ((1 - smooth) / factor + smooth)))
    return out.astype(np.float32)


def write_gguf(c: ArchCase, model: PreTrainedModel, path: Path) -> Path:
    """Write ``model`` as llama.cpp would convert it (see the module docstring).

    The matrices stored Q8_0 are set in ``model`` to their dequantized values, so that
    ``model`` is then exactly the file's model: the oracle of every test on the file."""
    cfg = model.config
    arch = c.gguf_arch
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_string("general.name", c.name)
    for key, value in {"context_length": cfg.max_position_embeddings,
                       "embedding_length": cfg.hidden_size, "block_count": cfg.num_hidden_layers,
                       "feed_forward_length": cfg.intermediate_size,
                       "attention.head_count": cfg.num_attention_heads,
                       "attention.head_count_kv": cfg.num_key_value_heads,
                       "attention.key_length": head_dim, "attention.value_length": head_dim,
                       "rope.dimension_count": head_dim, "vocab_size": cfg.vocab_size}.items():
        if key in c.meta:
            continue  # the case's own value
        w.add_uint32(f"{arch}.{key}", int(value))
    w.add_float32(f"{arch}.rope.freq_base", float(c.config["rope_theta"]))
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", float(c.config["rms_norm_eps"]))
    for key, value in c.meta.items():
        add = (w.add_string if isinstance(value, str) else w.add_float32
               if isinstance(value, float) else w.add_uint32)
        add(f"{arch}.{key}", value)
    v = c.vocab
    w.add_string("tokenizer.ggml.model", v.model)
    if v.pre is not None:
        w.add_string("tokenizer.ggml.pre", v.pre)
    w.add_array("tokenizer.ggml.tokens", v.tokens)
    w.add_array("tokenizer.ggml.token_type", v.types)
    if v.merges:
        w.add_array("tokenizer.ggml.merges", v.merges)
    if v.scores:
        w.add_array("tokenizer.ggml.scores", v.scores)
    w.add_uint32("tokenizer.ggml.bos_token_id", v.bos)
    w.add_uint32("tokenizer.ggml.eos_token_id", v.eos)
    w.add_uint32("tokenizer.ggml.padding_token_id", v.eos)
    if v.eot is not None:
        w.add_uint32("tokenizer.ggml.eot_token_id", v.eot)
    if v.model == "llama":
        w.add_uint32("tokenizer.ggml.unknown_token_id", 0)
    w.add_bool("tokenizer.ggml.add_bos_token", v.model == "llama")
    w.add_string("tokenizer.chat_template", c.template)

    names = gguf.get_tensor_name_map(
        next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch), cfg.num_hidden_layers)
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        stem, _, suffix = hf_name.rpartition(".")
        gname = f"{names.get_name(stem)}.{suffix}"
        array = tensor.float().numpy()
        if arch == "llama" and ".attn_q." in gname:
            array = permute_qk(array, cfg.num_attention_heads)
        elif arch == "llama" and ".attn_k." in gname:
            array = permute_qk(array, cfg.num_key_value_heads)
        if gname.endswith("norm.weight"):
            array = array + c.norm_shift
        if array.ndim == 2 and gname.startswith("blk.") and array.shape[1] % 32 == 0:
            fmt = gguf.GGMLQuantizationType.Q8_0
            blocks = gguf.quants.quantize(np.ascontiguousarray(array), fmt)
            w.add_tensor(gname, blocks, raw_dtype=fmt)
            stored = gguf.quants.dequantize(blocks, fmt).reshape(array.shape)
            if arch == "llama" and ".attn_q." in gname:  # back to HF's row order
                stored = unpermute_qk(stored, cfg.num_attention_heads)
            elif arch == "llama" and ".attn_k." in gname:
                stored = unpermute_qk(stored, cfg.num_key_value_heads)
            with torch.no_grad():
                tensor.copy_(torch.from_numpy(np.ascontiguousarray(stored)))
        else:
            w.add_tensor(gname, np.ascontiguousarray(array, dtype=np.float32))
    for gname, array in c.tensors.items():
        w.add_tensor(gname, array)
    if c.rope_freqs:
        w.add_tensor("rope_freqs.weight", _rope_freqs(c.config["rope_theta"], head_dim,
                                                      c.config["rope_scaling"]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
