"""Model families as data, one generic builder, and Hugging Face checkpoints in and out.

Example::

    >>> from tunesmith.models import build_model, qwen3
    >>> model = build_model(qwen3.spec("qwen3_tiny"))
    >>> model = qwen3.qwen3_8b(device="meta")           # real size, instant

From Hugging Face folders::

    model = from_hf("path/to/Qwen3-8B")
    rm = reward_model_from_hf("path/to/Qwen3-8B")
"""

import importlib
from typing import Any

# Importing the zoo imports every family file in it, which registers its Family entry.
from tunesmith.models import zoo
from tunesmith.models.builder import build_model
from tunesmith.models.family import Family, families, family_for, register_family
from tunesmith.models.spec import ModelSpec, UnsupportedModelError, spec_from_hf_config

__all__ = [
    "SUPPORTED_MODEL_TYPES",  # noqa: F822 (module __getattr__, follows the family table)
    "Family",
    "ModelSpec",
    "RewardModel",
    "UnsupportedModelError",
    "build_model",
    "build_reward_model",
    "families",
    "family_for",
    "from_hf",
    "register_family",
    "reward_model_from_hf",
    "spec_from_hf_config",
    "zoo",
]


# Imported on first use: the checkpoint code pulls in safetensors I/O most users of
# the builders never need, and importing it lazily keeps this package free of cycles.
_LAZY = {
    "from_hf": "tunesmith.models.hf",
    "RewardModel": "tunesmith.models.reward",
    "build_reward_model": "tunesmith.models.reward",
    "reward_model_from_hf": "tunesmith.models.reward",
}


def __getattr__(name: str) -> Any:
    if name == "SUPPORTED_MODEL_TYPES":
        return tuple(sorted(f.model_type for f in families()))
    if name in zoo.FAMILY_FILES:  # a family file: tunesmith.models.qwen3
        return zoo.FAMILY_FILES[name]
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'tunesmith.models' has no attribute {name!r}")
