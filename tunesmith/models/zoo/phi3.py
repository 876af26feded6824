"""Phi-3 and Phi-4-mini (Microsoft), model_type ``phi3``.

Architecturally Llama-like; the checkpoints store q, k and v as one ``qkv_proj`` and the
MLP's gate and up as one ``gate_up_proj`` (tunesmith keeps them apart in memory and fuses
them again on save, see :mod:`~tunesmith.models.fused_keys`). Phi-4-mini rotates only the
first 3/4 of each head (``partial_rotary_factor``) and stretches its context with LongRoPE
(short factors up to 4096 positions, long ones past it). A sliding window, when set,
applies to every layer. Values are those of the published ``config.json`` files.

Example::

    >>> from tunesmith.models import phi3
    >>> spec = phi3.spec("phi4_mini")
    >>> spec.rotary_dim, spec.rope_scaling["rope_type"]
    (96, 'longrope')
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tunesmith.models.builder import family_spec, size_builder
from tunesmith.models.family import Family, register_family
from tunesmith.models.spec import ModelSpec, partial_rotary_from_config

__all__ = ["FAMILY", "SIZES", "phi3_mini_4k", "phi3_tiny", "phi4_mini", "spec"]


def _read(config: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "sliding_window": config.get("sliding_window"),
        "partial_rotary_factor": partial_rotary_from_config(config),
    }


def _write(spec: ModelSpec) -> dict[str, Any]:
    original = (spec.rope_scaling or {}).get("original_max_position_embeddings")
    return {
        "sliding_window": spec.sliding_window,
        "partial_rotary_factor": spec.partial_rotary_factor,
        "original_max_position_embeddings": original or spec.max_position_embeddings,
    }


FAMILY = register_family(
    Family(
        name="phi3",
        model_type="phi3",
        architecture="Phi3ForCausalLM",
        defaults={
            "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-5,
            "bos_token_id": 1,
            "eos_token_id": 32000,
            "pad_token_id": 32000,
        },  # fmt: skip
        from_hf_config=_read,
        to_hf_config=_write,
        template="phi4",
        fused={
            "qkv_proj": ("q_proj", "k_proj", "v_proj"),
            "gate_up_proj": ("gate_proj", "up_proj"),
        },
    )
)

# Phi-4-mini's LongRoPE factors (one per rotated frequency: 48 of a 96-feature rotation).
_PHI4_MINI_LONG = [
    1.0, 1.118320672, 1.250641126, 1.398617824, 1.564103225, 1.74916897, 1.956131817,
    2.187582649, 2.446418898, 2.735880826, 3.059592084, 3.421605075, 3.826451687, 4.279200023,
    4.785517845, 5.351743533, 5.984965424, 6.693110555, 7.485043894, 8.370679318, 9.36110372,
    10.4687158, 11.70738129, 13.09260651, 14.64173252, 16.37415215, 18.31155283, 20.47818807,
    22.90118105, 25.61086418, 28.64115884, 32.03, 32.1, 32.13, 32.23, 32.6, 32.61, 32.64,
    32.66, 32.7, 32.71, 32.93, 32.97, 33.28, 33.49, 33.5, 44.16, 47.77,
]  # fmt: skip

_COMMON: dict[str, Any] = {
    "model_type": FAMILY.model_type,
    "hidden_size": 3072,
    "intermediate_size": 8192,
    "num_hidden_layers": 32,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "torch_dtype": "bfloat16",
}

SIZES: dict[str, dict[str, Any]] = {
    "phi3_mini_4k": {"vocab_size": 32064, "num_attention_heads": 32, "num_key_value_heads": 32,
                     "head_dim": 96, "max_position_embeddings": 4096, "sliding_window": 2047,
                     "bos_token_id": 1, "eos_token_id": 32000, "pad_token_id": 32000},
    "phi4_mini": {"vocab_size": 200064, "num_attention_heads": 24, "num_key_value_heads": 8,
                  "head_dim": 128, "partial_rotary_factor": 0.75, "tie_word_embeddings": True,
                  "max_position_embeddings": 131072, "sliding_window": 262144,
                  "rope_scaling": {"rope_type": "longrope", "long_factor": _PHI4_MINI_LONG,
                                   "short_factor": [1.0] * 48, "factor": 32.0,
                                   "original_max_position_embeddings": 4096},
                  "bos_token_id": 199999, "eos_token_id": 200020, "pad_token_id": 199999},
    # Partial rotary and LongRoPE switching at 8 positions: both matter in the test rows.
    "phi3_tiny": {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
                  "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                  "head_dim": 16, "partial_rotary_factor": 0.5, "max_position_embeddings": 64,
                  "rope_scaling": {"rope_type": "longrope", "long_factor": [1.0, 2.0, 4.0, 8.0],
                                   "short_factor": [1.0, 1.0, 1.5, 2.0], "factor": 8.0,
                                   "original_max_position_embeddings": 8},
                  "torch_dtype": None, "bos_token_id": None, "eos_token_id": 2},
}  # fmt: skip


def spec(size: str, **overrides: Any) -> ModelSpec:
    """The :class:`ModelSpec` of a size in :data:`SIZES`, e.g. ``spec("phi4_mini")``."""
    return family_spec(_COMMON, SIZES, size, overrides)


phi3_mini_4k = size_builder(
    __name__, spec, "phi3_mini_4k", "Phi-3-mini-4k (3.82B parameters, window 2047)."
)
phi4_mini = size_builder(
    __name__,
    spec,
    "phi4_mini",
    "Phi-4-mini (3.84B parameters, tied embeddings, partial rotary, LongRoPE to 128k).",
)
phi3_tiny = size_builder(
    __name__,
    spec,
    "phi3_tiny",
    "A 2-layer, 64-wide random Phi-3 for tests (half rotary, LongRoPE past 8 positions).",
)
