"""Model families as data, one generic builder, and Hugging Face checkpoints in and out.

Example::

    >>> from tunesmith.models import build_model, qwen3
    >>> model = build_model(qwen3.spec("qwen3_tiny"))
    >>> model = qwen3.qwen3_8b(device="meta")           # real size, instant
    >>> model = from_hf("path/to/Qwen3-8B")              # doctest: +SKIP
"""

from typing import Any

from tunesmith.models import llama3, mistral, qwen2_5, qwen3, qwen3_moe
from tunesmith.models.builder import build_model
from tunesmith.models.spec import (
    SUPPORTED_MODEL_TYPES,
    ModelSpec,
    UnsupportedModelError,
    spec_from_hf_config,
)

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "ModelSpec",
    "UnsupportedModelError",
    "build_model",
    "from_hf",
    "llama3",
    "mistral",
    "qwen2_5",
    "qwen3",
    "qwen3_moe",
    "spec_from_hf_config",
]


def __getattr__(name: str) -> Any:
    # Imported on first use: the checkpoint code pulls in safetensors I/O most users of
    # the builders never need, and importing it lazily keeps this package free of cycles.
    if name == "from_hf":
        from tunesmith.models.hf import from_hf

        return from_hf
    raise AttributeError(f"module 'tunesmith.models' has no attribute {name!r}")
