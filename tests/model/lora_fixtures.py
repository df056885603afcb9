"""Random PEFT LoRA adapters for the tests: saved as PEFT folders, with peft's
``PeftModel`` on HF transformers as the oracle.

Owner: tests. Built with peft itself (``get_peft_model`` + ``save_pretrained``), so the
folders are exactly what users bring; every A and B is re-drawn at random (peft
initialises B to zero, which would hide a wrong delta).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(hf_model: torch.nn.Module, folder: Path, *, rank: int = 8, alpha: float = 16,
                 seed: int = 0, targets: list[str] | None = None, std: float = 0.1,
                 **config: object) -> torch.nn.Module:
    """Save a random LoRA of ``hf_model`` to ``folder``; return the oracle PeftModel (the
    base model is copied: ``hf_model`` itself is left unwrapped)."""
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets or ALL_TARGETS,
                     lora_dropout=0.0, **config)  # type: ignore[arg-type]
    peft_model = get_peft_model(copy.deepcopy(hf_model), cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    peft_model.save_pretrained(str(folder))
    return peft_model.eval()


def edit_config(folder: Path, **fields: object) -> None:
    """Change fields of a saved ``adapter_config.json``."""
    path = folder / "adapter_config.json"
    cfg = json.loads(path.read_text())
    cfg.update(fields)
    path.write_text(json.dumps(cfg))
