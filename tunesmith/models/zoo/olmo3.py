"""OLMo 3 (Allen Institute for AI).

OLMo 2's structure (norms after each block, weights applied in float32, a qk-norm over the
whole projections) with sliding-window attention (4096) on three layers of every four, the
fourth global. A RoPE scaling (YaRN in the long-context releases) applies to the global
layers only; sliding layers keep plain RoPE. Values are those of the published
``config.json`` files.

Example::

    >>> from tunesmith.models import olmo3
    >>> olmo3.spec("olmo3_7b").layer_types[:4]
    ('sliding_attention', 'sliding_attention', 'sliding_attention', 'full_attention')
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from tunesmith.models.builder import family_spec, size_builder
from tunesmith.models.family import register_family
from tunesmith.models.spec import ModelSpec, layer_types_from_config, layer_types_to_config
from tunesmith.models.zoo.olmo2 import FAMILY as OLMO2
from tunesmith.models.zoo.olmo2 import OLMO_IMPLIED

__all__ = ["FAMILY", "SIZES", "olmo3_7b", "olmo3_tiny", "spec"]


def _every_fourth_global(i: int) -> str:
    return "sliding_attention" if (i + 1) % 4 else "full_attention"


def _read(config: Mapping[str, Any]) -> dict[str, Any]:
    window = config.get("sliding_window", 4096)
    fields = {**OLMO_IMPLIED, **layer_types_from_config(config, window, _every_fourth_global)}
    params = config.get("rope_parameters") or {}
    if "full_attention" not in params:  # 4.x keys: a scaled RoPE is the global layers' only,
        scaling = config.get("rope_scaling") or params  # sliding ones rotate plainly
        if scaling.get("rope_type", scaling.get("type", "default")) != "default":
            theta = config.get("rope_theta", scaling.get("rope_theta", 10000.0))
            fields["rope_local_theta"] = float(theta)
    return fields


def _write(spec: ModelSpec) -> dict[str, Any]:
    # Per layer type, as transformers 5 writes them: the sliding layers' base may differ.
    full = {"rope_type": "default", **(spec.rope_scaling or {}), "rope_theta": spec.rope_theta}
    local = spec.rope_theta if spec.rope_local_theta is None else spec.rope_local_theta
    return {
        "sliding_window": spec.sliding_window,
        "layer_types": layer_types_to_config(spec),
        "rope_scaling": None,
        "rope_parameters": {
            "full_attention": full,
            "sliding_attention": {"rope_type": "default", "rope_theta": local},
        },
    }


# OLMo 2's entry (what the type implies, its flags, transformers' defaults, the template) with
# OLMo 3's name, class and window hooks.
FAMILY = register_family(
    dataclasses.replace(
        OLMO2,
        name="olmo3",
        model_type="olmo3",
        architecture="Olmo3ForCausalLM",
        from_hf_config=_read,
        to_hf_config=_write,
    )
)


def _types(layers: int) -> tuple[str, ...]:
    return tuple(_every_fourth_global(i) for i in range(layers))


_COMMON: dict[str, Any] = {
    "model_type": FAMILY.model_type,
    **FAMILY.implied,
    **OLMO_IMPLIED,
    "vocab_size": 100278,
    "rms_norm_eps": 1e-6,
    "rope_theta": 500000.0,
    "sliding_window": 4096,
    "max_position_embeddings": 65536,
    "bos_token_id": None,
    "eos_token_id": 100257,
    "pad_token_id": 100277,
    "torch_dtype": "bfloat16",
}

SIZES: dict[str, dict[str, Any]] = {
    "olmo3_7b": {"hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
                 "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": 128,
                 "layer_types": _types(32), "rope_local_theta": 500000.0,
                 "rope_scaling": {"rope_type": "yarn", "factor": 8.0,
                                  "original_max_position_embeddings": 8192,
                                  "attention_factor": 1.2079441541679836,
                                  "beta_fast": 32, "beta_slow": 1}},
    # Window 4 < the test rows; three sliding layers then a global one.
    "olmo3_tiny": {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
                   "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
                   "head_dim": 16, "max_position_embeddings": 512, "sliding_window": 4,
                   "layer_types": _types(4), "torch_dtype": None, "eos_token_id": 2,
                   "pad_token_id": None},
}  # fmt: skip


def spec(size: str, **overrides: Any) -> ModelSpec:
    """The :class:`ModelSpec` of a size in :data:`SIZES`, e.g. ``spec("olmo3_7b")``."""
    return family_spec(_COMMON, SIZES, size, overrides)


olmo3_7b = size_builder(
    __name__, spec, "olmo3_7b", "OLMo 3 7B (7.30B parameters, YaRN to 64k on its global layers)."
)
olmo3_tiny = size_builder(
    __name__,
    spec,
    "olmo3_tiny",
    "A 4-layer, 64-wide random OLMo 3 for tests (window 4, the fourth layer global).",
)
