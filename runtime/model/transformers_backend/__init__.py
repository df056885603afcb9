"""The transformers backend: any transformers causal LM over pie-ctx's page pool.

The native runner (``runtime.model.runner``) runs Llama, Qwen2 and Qwen3 with pie-ctx's own
layers and kernels; this backend runs every other causal LM transformers can load, with
transformers' own model class and pie-ctx's paged attention plugged into its
``AttentionInterface`` (see ``.attention``). Both serve the same engine, pages and SDK.
"""

from runtime.model.transformers_backend.runner import (
    TransformersModel,
    TransformersRunner,
    load_transformers_model,
)

__all__ = ["TransformersModel", "TransformersRunner", "load_transformers_model"]
