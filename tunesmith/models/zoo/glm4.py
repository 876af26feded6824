"""GLM-4 (Zhipu AI), the ``-0414`` dense models, model_type ``glm4``.

Real differences from Llama: biases on q, k and v (not o); norms before and after each block
under GLM's own names (``sandwich_glm``); RoPE on the first half of each head only, in the
interleaved layout (pairs of features); the MLP's gate and up stored fused on disk as
``gate_up_proj`` (kept apart in memory, see :mod:`~tunesmith.models.fused_keys`). Values are
those of the published ``config.json``.

Example::

    >>> from tunesmith.models import glm4
    >>> spec = glm4.spec("glm4_9b")
    >>> spec.rotary_dim, spec.rope_interleaved, spec.qkv_bias
    (64, True, True)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tunesmith.models.builder import family_spec, size_builder
from tunesmith.models.family import Family, UnsupportedModelError, register_family
from tunesmith.models.spec import ModelSpec, partial_rotary_from_config

__all__ = ["FAMILY", "SIZES", "glm4_9b", "glm4_tiny", "spec"]

_IMPLIED: dict[str, Any] = {"norm_layout": "sandwich_glm", "rope_interleaved": True}


def _read(config: Mapping[str, Any]) -> dict[str, Any]:
    if not config.get("attention_bias", True):
        raise UnsupportedModelError("glm4: attention_bias=false (q, k, v without biases)")
    # transformers' Glm4Config: half of each head rotates unless a config says otherwise.
    return {**_IMPLIED, "partial_rotary_factor": partial_rotary_from_config(config, 0.5)}


def _write(spec: ModelSpec) -> dict[str, Any]:
    return {"attention_bias": True, "partial_rotary_factor": spec.partial_rotary_factor}


FAMILY = register_family(
    Family(
        name="glm4",
        model_type="glm4",
        architecture="Glm4ForCausalLM",
        implied={"qkv_bias": True},
        defaults={
            "max_position_embeddings": 131072,
            "rms_norm_eps": 1.5625e-07,
            "pad_token_id": 151329,
            "eos_token_id": [151329, 151336, 151338],
        },  # fmt: skip
        from_hf_config=_read,
        to_hf_config=_write,
        fused={"gate_up_proj": ("gate_proj", "up_proj")},
    )
)

_COMMON: dict[str, Any] = {
    "model_type": FAMILY.model_type,
    **FAMILY.implied,
    **_IMPLIED,
    "partial_rotary_factor": 0.5,
    "vocab_size": 151552,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 32768,
    "pad_token_id": 151329,
    "eos_token_id": (151329, 151336, 151338),
    "torch_dtype": "bfloat16",
}

SIZES: dict[str, dict[str, Any]] = {
    "glm4_9b": {"hidden_size": 4096, "intermediate_size": 13696, "num_hidden_layers": 40,
                "num_attention_heads": 32, "num_key_value_heads": 2, "head_dim": 128},
    "glm4_tiny": {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
                  "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                  "head_dim": 16, "max_position_embeddings": 512, "torch_dtype": None,
                  "pad_token_id": None, "eos_token_id": 2},
}  # fmt: skip


def spec(size: str, **overrides: Any) -> ModelSpec:
    """The :class:`ModelSpec` of a size in :data:`SIZES`, e.g. ``spec("glm4_9b")``."""
    return family_spec(_COMMON, SIZES, size, overrides)


glm4_9b = size_builder(__name__, spec, "glm4_9b", "GLM-4-9B-0414 (9.40B parameters).")
glm4_tiny = size_builder(
    __name__,
    spec,
    "glm4_tiny",
    "A 2-layer, 64-wide random GLM-4 for tests (vocab 256, half interleaved rotary).",
)
