"""Shared pieces of the engine benchmarks: the HF baseline on the same weights, prompts,
and small statistics. Every benchmark prints a table and, as its last line, one JSON object.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

TEXT = ("Paged attention stores the key and value vectors of every token in fixed-size pages, "
        "so contexts that share a prefix can share the pages that hold it. ") * 400


def load_hf(folder: Path, device: Any = "cpu", dtype: torch.dtype = torch.float32) -> Any:
    """transformers' own model on the converted folder: the same weights as ours."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype)
    model.to(device).eval()
    return model


def prompt_tokens(tokenizer: Any, n: int, salt: str = "") -> list[int]:
    ids = tokenizer.encode(salt + TEXT)
    if len(ids) < n:
        raise ValueError("TEXT is too short for this prompt length")
    return ids[:n]


def kv_bytes_per_token(config: Any, itemsize: int = 4) -> int:
    return config.num_layers * 2 * config.num_kv_heads * config.head_dim * itemsize


def summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def table(rows: list[tuple[str, str]]) -> None:
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k.ljust(width)}  {v}")


def emit(result: dict[str, Any]) -> None:
    print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in result.items()}))
