"""Qwen3 mixture-of-experts models (Alibaba), ``model_type`` ``"qwen3_moe"``.

Attention is Qwen3's (qk-norm, head_dim 128); every layer's MLP is a sparse MoE
block: 128 SwiGLU experts, softmax top-8 routing with renormalised weights
(``norm_topk_prob``) and a Switch-style load-balancing loss weighted by
``router_aux_loss_coef``. Values are those of the published ``config.json``.

Example::

    >>> from tunesmith.models import qwen3_moe
    >>> model = qwen3_moe.qwen3_30b_a3b(device="meta")
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tunesmith.models.builder import family_spec, size_builder
from tunesmith.models.family import Family, register_family
from tunesmith.models.spec import (
    ModelSpec,
    use_sliding_window_from_config,
    use_sliding_window_to_config,
)

__all__ = ["FAMILY", "SIZES", "qwen3_30b_a3b", "qwen3_235b_a22b", "qwen3_moe_tiny", "spec"]


def _read_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """Experts (transformers 5 names ``num_local_experts``) and a window on every layer."""
    return {
        **use_sliding_window_from_config(config, per_layer=False),
        "num_experts": config.get("num_experts", config.get("num_local_experts", 128)),
        "num_experts_per_tok": config.get("num_experts_per_tok", 8),
        "moe_intermediate_size": config.get("moe_intermediate_size", 768),
        "norm_topk_prob": bool(config.get("norm_topk_prob", False)),
        "router_aux_loss_coef": config.get("router_aux_loss_coef", 0.001),
        "decoder_sparse_step": config.get("decoder_sparse_step", 1),
        "mlp_only_layers": tuple(config.get("mlp_only_layers") or ()),
    }


def _write_config(spec: ModelSpec) -> dict[str, Any]:
    return {
        **use_sliding_window_to_config(spec, per_layer=False),
        "num_experts": spec.num_experts,
        "num_experts_per_tok": spec.num_experts_per_tok,
        "moe_intermediate_size": spec.moe_intermediate_size,
        "norm_topk_prob": spec.norm_topk_prob,
        "router_aux_loss_coef": spec.router_aux_loss_coef,
        "decoder_sparse_step": spec.decoder_sparse_step,
        "mlp_only_layers": list(spec.mlp_only_layers),
        "output_router_logits": False,
    }


# Qwen3 attention (qk-norm) with MoE layers; the chat template is Qwen3's.
FAMILY = register_family(
    Family(
        name="qwen3_moe",
        model_type="qwen3_moe",
        architecture="Qwen3MoeForCausalLM",
        implied={"qk_norm": True},
        flags=("attention_bias",),
        defaults={"max_position_embeddings": 32768},
        from_hf_config=_read_config,
        to_hf_config=_write_config,
        template="qwen3",
    )
)

_COMMON: dict[str, Any] = {
    "model_type": FAMILY.model_type,
    **FAMILY.implied,
    "vocab_size": 151936,
    "head_dim": 128,
    "num_key_value_heads": 4,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "max_position_embeddings": 40960,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "router_aux_loss_coef": 0.001,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "torch_dtype": "bfloat16",
}

SIZES: dict[str, dict[str, Any]] = {
    "qwen3_30b_a3b": {"hidden_size": 2048, "intermediate_size": 6144,
                      "moe_intermediate_size": 768, "num_hidden_layers": 48,
                      "num_attention_heads": 32},
    "qwen3_235b_a22b": {"hidden_size": 4096, "intermediate_size": 12288,
                        "moe_intermediate_size": 1536, "num_hidden_layers": 94,
                        "num_attention_heads": 64},
    # Layer 1 is dense (mlp_only_layers) so tests cover both kinds of layer.
    "qwen3_moe_tiny": {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
                       "moe_intermediate_size": 32, "num_hidden_layers": 3,
                       "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                       "num_experts": 8, "num_experts_per_tok": 2, "mlp_only_layers": (1,),
                       "max_position_embeddings": 512, "torch_dtype": None,
                       "bos_token_id": None, "eos_token_id": 2},
}  # fmt: skip


def spec(size: str, **overrides: Any) -> ModelSpec:
    """The :class:`ModelSpec` of a size in :data:`SIZES`, e.g. ``spec("qwen3_30b_a3b")``."""
    return family_spec(_COMMON, SIZES, size, overrides)


qwen3_30b_a3b = size_builder(
    __name__, spec, "qwen3_30b_a3b", "Qwen3-30B-A3B (30.5B parameters, 3.3B active per token)."
)
qwen3_235b_a22b = size_builder(
    __name__, spec, "qwen3_235b_a22b", "Qwen3-235B-A22B (235B parameters, 22B active per token)."
)
qwen3_moe_tiny = size_builder(
    __name__,
    spec,
    "qwen3_moe_tiny",
    "A 3-layer random Qwen3-MoE for tests (8 experts, top-2, layer 1 dense).",
)
