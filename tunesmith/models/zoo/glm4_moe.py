"""GLM-4.5 mixture-of-experts models (Zhipu AI: GLM-4.5, GLM-4.5-Air), ``model_type``
``"glm4_moe"``.

The MoE layers are DeepSeek-V3's, read and written by the same code
(:func:`~tunesmith.models.zoo.deepseek_v3.read_experts`): sigmoid scores with an
``e_score_correction_bias``, group-limited top-k, renormalised and ``routed_scaling_factor``
weights, ``n_shared_experts`` shared experts, the first ``first_k_dense_replace`` layers dense.
Attention is plain grouped-query attention: biases on q, k and v (not o) when
``attention_bias``, a per-head RMSNorm on q and k when ``use_qk_norm``, RoPE in the rotate-half
layout on the first ``partial_rotary_factor`` (default one half) of each head.
Multi-token-prediction layers (``num_nextn_predict_layers``) are skipped on load with a message.
Values are those of the published ``config.json``.

Example::

    >>> from tunesmith.models import glm4_moe
    >>> spec = glm4_moe.spec("glm4_5_air")
    >>> spec.rotary_dim, spec.qkv_bias, spec.moe_routing.method, spec.mlp_only_layers
    (64, True, 'noaux_tc', (0,))
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tunesmith.models.builder import family_spec, size_builder
from tunesmith.models.family import Family, register_family
from tunesmith.models.spec import ModelSpec, partial_rotary_from_config
from tunesmith.models.zoo.deepseek_v3 import read_experts, write_experts
from tunesmith.modules.routers import DeepSeekRouting

__all__ = ["FAMILY", "SIZES", "glm4_5", "glm4_5_air", "glm4_moe_tiny", "spec"]


def _read_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """DeepSeek-V3's experts (always ``noaux_tc``) and half-rotary RoPE unless a config says."""
    return {
        **read_experts(config, "noaux_tc"),
        "partial_rotary_factor": partial_rotary_from_config(config, 0.5),
    }


def _write_config(spec: ModelSpec) -> dict[str, Any]:
    experts = {k: v for k, v in write_experts(spec).items() if k != "topk_method"}
    return {
        **experts,
        "partial_rotary_factor": spec.partial_rotary_factor,
        "num_nextn_predict_layers": 0,
    }


FAMILY = register_family(
    Family(
        name="glm4_moe",
        model_type="glm4_moe",
        architecture="Glm4MoeForCausalLM",
        flags=("qkv_bias", "qk_norm"),
        flag_keys={"qkv_bias": "attention_bias", "qk_norm": "use_qk_norm"},
        defaults={"max_position_embeddings": 131072, "rms_norm_eps": 1e-5},
        from_hf_config=_read_config,
        to_hf_config=_write_config,
        has_classifier=False,  # transformers has no Glm4MoeForSequenceClassification
    )
)

_COMMON: dict[str, Any] = {
    "model_type": FAMILY.model_type,
    "qkv_bias": True,
    "partial_rotary_factor": 0.5,
    "vocab_size": 151552,
    "head_dim": 128,
    "num_attention_heads": 96,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-5,
    "rope_theta": 1000000.0,
    "max_position_embeddings": 131072,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "router_aux_loss_coef": 0.0,
    "pad_token_id": 151329,
    "eos_token_id": (151329, 151336, 151338),
    "torch_dtype": "bfloat16",
}

SIZES: dict[str, dict[str, Any]] = {
    "glm4_5": {
        "hidden_size": 5120, "intermediate_size": 12288, "moe_intermediate_size": 1536,
        "num_hidden_layers": 92, "qk_norm": True, "num_experts": 160,
        "mlp_only_layers": (0, 1, 2), "moe_routing": DeepSeekRouting("noaux_tc", 1, 1, 2.5, 1),
    },
    "glm4_5_air": {
        "hidden_size": 4096, "intermediate_size": 10944, "moe_intermediate_size": 1408,
        "num_hidden_layers": 46, "num_experts": 128, "mlp_only_layers": (0,),
        "moe_routing": DeepSeekRouting("noaux_tc", 1, 1, 1.0, 1),
    },
    # Odd sizes on purpose: 5 heads over 1 kv head, a third of each 12-wide head rotated,
    # qk-norm, 6 experts in 2 groups (1 kept), top-2, two shared experts, layer 0 dense.
    "glm4_moe_tiny": {
        "vocab_size": 256, "hidden_size": 40, "intermediate_size": 72,
        "moe_intermediate_size": 24, "num_hidden_layers": 3, "num_attention_heads": 5,
        "num_key_value_heads": 1, "head_dim": 12, "partial_rotary_factor": 1 / 3,
        "qk_norm": True, "max_position_embeddings": 512, "num_experts": 6,
        "num_experts_per_tok": 2, "mlp_only_layers": (0,),
        "moe_routing": DeepSeekRouting("noaux_tc", 2, 1, 2.5, 2),
        "torch_dtype": None, "pad_token_id": None, "eos_token_id": 2,
    },
}  # fmt: skip


def spec(size: str, **overrides: Any) -> ModelSpec:
    """The :class:`ModelSpec` of a size in :data:`SIZES`, e.g. ``spec("glm4_5_air")``."""
    return family_spec(_COMMON, SIZES, size, overrides)


glm4_5 = size_builder(__name__, spec, "glm4_5", "GLM-4.5 (355B parameters, 32B active per token).")
glm4_5_air = size_builder(
    __name__, spec, "glm4_5_air", "GLM-4.5-Air (106B parameters, 12B active per token)."
)
glm4_moe_tiny = size_builder(
    __name__,
    spec,
    "glm4_moe_tiny",
    "A 3-layer random GLM-4.5 MoE for tests (5 heads over 1 kv head, a third of each head "
    "rotated, qk-norm, 6 experts in 2 groups, top-2, 2 shared experts, layer 0 dense).",
)
