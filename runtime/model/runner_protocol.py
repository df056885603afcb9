"""``Runner``: what the engine needs of a model runner, as a typed protocol.

Owns nothing; it names the surface the engine's parts call (``StepExecutor``: ``forward``;
``Adapters``: the adapter table; ``Engine.info``: ``kind``, ``weight_format``,
``deterministic``, the attention ``backend``), so the three runners (``runtime.model.runner.ModelRunner``, the
transformers backend's, and ``runtime.distributed``'s tensor-parallel one) can be checked
against one type. A runner that can never step again raises ``RunnerLost``
(``runtime.model.failures``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from runtime.model.batch import SeqInput

__all__ = ["Runner"]


class Runner(Protocol):
    """A model runner as the engine uses it."""

    kind: str  # EngineInfo.backend: "native" | "transformers"
    weight_format: str  # "fp32" | "int8" | "gguf"
    deterministic: bool  # batch-invariant numerics run (EngineInfo.deterministic)
    backend: Any  # the attention backend (its ``name`` is shown in EngineInfo)
    adapters: dict[str, Any]  # loaded LoRA adapters by name

    def forward(self, batch: list[SeqInput], *, return_hidden: bool = False) -> Any:
        """Logits ``[rows, vocab]`` of the batch's probe rows (and the hidden states)."""
        ...

    def load_adapter(self, name: str, path: str, model_name: str = "") -> Any:
        """Load a PEFT LoRA adapter from ``path`` under ``name``."""
        ...

    def unload_adapter(self, name: str) -> Any:
        """Unload the adapter ``name``."""
        ...

    def has_adapter_key(self, key: int) -> bool:
        """Whether an adapter with this key is loaded."""
        ...
