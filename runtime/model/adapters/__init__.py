"""LoRA adapters: reading PEFT folders (``peft``) and the batched delta (``delta``).

Owner: the model runner holds the loaded adapters (``ModelRunner.load_adapter``); the
engine decides who may use them. An adapter's identity (``LoraAdapter.key``, a hash of its
weights) enters the page hash in one place, ``runtime.kv.hashing.adapter_extras``.
"""

from runtime.model.adapters.delta import FusedAdapter, LoraBatch, fuse
from runtime.model.adapters.peft import TARGETS, LoraAdapter, load_peft

__all__ = ["TARGETS", "FusedAdapter", "LoraAdapter", "LoraBatch", "fuse", "load_peft"]
