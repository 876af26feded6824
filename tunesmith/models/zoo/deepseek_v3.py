"""DeepSeek-V3 models (DeepSeek-AI; also DeepSeek-R1 and Moonshot's Moonlight), ``model_type``
``"deepseek_v3"``; Moonshot's Kimi K2 folders (``model_type`` ``"kimi_k2"``, architecture
``DeepseekV3ForCausalLM``, the same config keys) are read as this family and saved back as
``kimi_k2``.

Attention is multi-head latent attention (:mod:`tunesmith.modules.mla`: a low-rank query
unless ``q_lora_rank`` is null, keys and values expanded from a cached latent of
``kv_lora_rank``, RoPE on ``qk_rope_head_dim`` features, interleaved with ``rope_interleave``,
YaRN's ``mscale_all_dim`` on the softmax scale). The first ``first_k_dense_replace`` layers are
dense; the others are MoE layers (:mod:`tunesmith.modules.routers`): sigmoid scores with an
``e_score_correction_bias``, group-limited top-k (``n_group``, ``topk_group``), renormalised
(``norm_topk_prob``) and scaled (``routed_scaling_factor``) weights, and ``n_shared_experts``
shared experts beside the routed ones. transformers has no auxiliary loss for this family, so
``router_aux_loss_coef`` is 0. Multi-token-prediction layers (``num_nextn_predict_layers``) are
not part of the model: their tensors are skipped on load with a message.

:mod:`~tunesmith.models.zoo.deepseek_v2` reads ``deepseek_v2`` configs with the same code.
Values are those of the published ``config.json``.

Example::

    >>> from tunesmith.models import deepseek_v3
    >>> model = deepseek_v3.deepseek_v3_tiny(device="meta")
    >>> type(model.model.layers[1].self_attn).__name__
    'MultiHeadLatentAttention'
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tunesmith.models.builder import family_spec, size_builder
from tunesmith.models.family import Family, UnsupportedModelError, register_family
from tunesmith.models.spec import ModelSpec
from tunesmith.modules.mla import MLAConfig
from tunesmith.modules.routers import DeepSeekRouting

__all__ = ["FAMILY", "SIZES", "deepseek_v3_671b", "deepseek_v3_tiny", "moonlight_16b_a3b", "spec"]


def read_mla(config: Mapping[str, Any]) -> dict[str, Any]:
    """The attention fields of a DeepSeek config: ``mla`` and RoPE over ``qk_rope_head_dim``."""
    mla = MLAConfig(
        q_lora_rank=config.get("q_lora_rank"),
        kv_lora_rank=config.get("kv_lora_rank", 512),
        qk_nope_head_dim=config.get("qk_nope_head_dim", 128),
        qk_rope_head_dim=config.get("qk_rope_head_dim", 64),
        v_head_dim=config.get("v_head_dim", 128),
    )
    return {"mla": mla, "head_dim": mla.qk_rope_head_dim}


def write_mla(spec: ModelSpec) -> dict[str, Any]:
    mla = spec.mla
    if mla is None:
        raise UnsupportedModelError(f"{spec.model_type} attention is multi-head latent (mla)")
    if spec.head_dim != mla.qk_rope_head_dim:
        raise UnsupportedModelError(
            f"{spec.model_type}: head_dim ({spec.head_dim}) must be qk_rope_head_dim "
            f"({mla.qk_rope_head_dim}), the features RoPE rotates"
        )
    return {
        "q_lora_rank": mla.q_lora_rank,
        "kv_lora_rank": mla.kv_lora_rank,
        "qk_nope_head_dim": mla.qk_nope_head_dim,
        "qk_rope_head_dim": mla.qk_rope_head_dim,
        "v_head_dim": mla.v_head_dim,
    }


def read_experts(config: Mapping[str, Any], method: str) -> dict[str, Any]:
    """The MoE fields of a DeepSeek config routed by ``method``; ``first_k_dense_replace``
    becomes the dense layers ``mlp_only_layers``. transformers computes no auxiliary loss."""
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModelError(f"DeepSeek experts are SwiGLU only, got hidden_act {act!r}")
    freq = config.get("moe_layer_freq", 1)
    if freq != 1:
        raise UnsupportedModelError(
            f"moe_layer_freq={freq} is not supported (transformers makes every layer after "
            "first_k_dense_replace a MoE layer)"
        )
    layers = config["num_hidden_layers"]
    dense = min(config.get("first_k_dense_replace") or 0, layers)
    routing = DeepSeekRouting(
        method=method,
        n_group=config.get("n_group") or 1,
        topk_group=config.get("topk_group") or 1,
        routed_scaling_factor=float(config.get("routed_scaling_factor", 1.0)),
        n_shared_experts=config.get("n_shared_experts") or 0,
    )
    return {
        "num_experts": config.get("n_routed_experts", config.get("num_local_experts", 256)),
        "num_experts_per_tok": config.get("num_experts_per_tok", 8),
        "moe_intermediate_size": config.get("moe_intermediate_size", 2048),
        "norm_topk_prob": bool(config.get("norm_topk_prob", False)),
        "router_aux_loss_coef": 0.0,
        "decoder_sparse_step": 1,
        "mlp_only_layers": tuple(range(dense)),
        "moe_routing": routing,
    }


def write_experts(spec: ModelSpec) -> dict[str, Any]:
    routing = spec.moe_routing
    dense = len(spec.mlp_only_layers)
    if routing is None or spec.mlp_only_layers != tuple(range(dense)):
        raise UnsupportedModelError(
            f"{spec.model_type} needs moe_routing and dense layers 0..k-1 (first_k_dense_replace)"
        )
    return {
        "n_routed_experts": spec.num_experts,
        "num_experts_per_tok": spec.num_experts_per_tok,
        "moe_intermediate_size": spec.moe_intermediate_size,
        "n_shared_experts": routing.n_shared_experts,
        "routed_scaling_factor": routing.routed_scaling_factor,
        "n_group": routing.n_group,
        "topk_group": routing.topk_group,
        "topk_method": routing.method,
        "norm_topk_prob": spec.norm_topk_prob,
        "first_k_dense_replace": dense,
        "output_router_logits": False,
    }


def _read_config(config: Mapping[str, Any]) -> dict[str, Any]:
    method = config.get("topk_method", "noaux_tc")
    scoring = config.get("scoring_func", "sigmoid")
    if method != "noaux_tc" or scoring != "sigmoid":
        raise UnsupportedModelError(
            f"deepseek_v3 routing topk_method={method!r} scoring_func={scoring!r} is not "
            "supported (transformers runs noaux_tc with sigmoid scores)"
        )
    return {
        **read_mla(config),
        **read_experts(config, "noaux_tc"),
        "rope_interleaved": bool(config.get("rope_interleave", True)),
    }


def _write_config(spec: ModelSpec) -> dict[str, Any]:
    return {
        **write_mla(spec),
        **write_experts(spec),
        "scoring_func": "sigmoid",
        "rope_interleave": spec.rope_interleaved,
        "num_nextn_predict_layers": 0,
    }


FAMILY = register_family(
    Family(
        name="deepseek_v3",
        model_type="deepseek_v3",
        architecture="DeepseekV3ForCausalLM",
        flags=("attention_bias",),
        defaults={
            "max_position_embeddings": 4096,
            "bos_token_id": 0,
            "eos_token_id": 1,
            "num_key_value_heads": 128,
        },
        from_hf_config=_read_config,
        to_hf_config=_write_config,
        aliases=("kimi_k2",),  # Kimi K2 (Moonshot AI): DeepseekV3ForCausalLM under its own name
    )
)

_COMMON: dict[str, Any] = {
    "model_type": FAMILY.model_type,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "head_dim": 64,
    "norm_topk_prob": True,
    "router_aux_loss_coef": 0.0,
    "rope_interleaved": True,
    "torch_dtype": "bfloat16",
}

_V3_YARN = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
            "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}  # fmt: skip

SIZES: dict[str, dict[str, Any]] = {
    "deepseek_v3_671b": {
        "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
        "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
        "num_key_value_heads": 128, "max_position_embeddings": 163840, "rope_scaling": _V3_YARN,
        "mla": MLAConfig(1536, 512, 128, 64, 128), "num_experts": 256, "num_experts_per_tok": 8,
        "mlp_only_layers": (0, 1, 2),
        "moe_routing": DeepSeekRouting("noaux_tc", 8, 4, 2.5, 1),
        "bos_token_id": 0, "eos_token_id": 1,
    },
    # Moonlight-16B-A3B (Moonshot AI): DeepSeek-V3 layers without a low-rank query.
    "moonlight_16b_a3b": {
        "vocab_size": 163840, "hidden_size": 2048, "intermediate_size": 11264,
        "moe_intermediate_size": 1408, "num_hidden_layers": 27, "num_attention_heads": 16,
        "num_key_value_heads": 16, "max_position_embeddings": 8192, "rope_theta": 50000.0,
        "rms_norm_eps": 1e-5, "mla": MLAConfig(None, 512, 128, 64, 128), "num_experts": 64,
        "num_experts_per_tok": 6, "mlp_only_layers": (0,),
        "moe_routing": DeepSeekRouting("noaux_tc", 1, 1, 2.446, 2),
        "bos_token_id": 163584, "eos_token_id": 163585,
    },
    # Odd sizes on purpose: 5 heads, q low-rank, 6 experts in 3 groups (2 kept), top-3,
    # two shared experts, layer 0 dense, v_head_dim != qk head dim.
    "deepseek_v3_tiny": {
        "vocab_size": 256, "hidden_size": 40, "intermediate_size": 72,
        "moe_intermediate_size": 24, "num_hidden_layers": 3, "num_attention_heads": 5,
        "num_key_value_heads": 5, "head_dim": 8, "max_position_embeddings": 512,
        "mla": MLAConfig(24, 16, 12, 8, 10), "num_experts": 6, "num_experts_per_tok": 3,
        "mlp_only_layers": (0,), "moe_routing": DeepSeekRouting("noaux_tc", 3, 2, 2.5, 2),
        "torch_dtype": None, "bos_token_id": None, "eos_token_id": 2,
    },
}  # fmt: skip


def spec(size: str, **overrides: Any) -> ModelSpec:
    """The :class:`ModelSpec` of a size in :data:`SIZES`, e.g. ``spec("deepseek_v3_671b")``."""
    return family_spec(_COMMON, SIZES, size, overrides)


deepseek_v3_671b = size_builder(
    __name__, spec, "deepseek_v3_671b", "DeepSeek-V3 / R1 (671B parameters, 37B active per token)."
)
moonlight_16b_a3b = size_builder(
    __name__, spec, "moonlight_16b_a3b", "Moonlight-16B-A3B (16B parameters, 3B active per token)."
)
deepseek_v3_tiny = size_builder(
    __name__,
    spec,
    "deepseek_v3_tiny",
    "A 3-layer random DeepSeek-V3 for tests (MLA with a low-rank query, 6 experts in 3 groups, "
    "top-3, 2 shared experts, layer 0 dense).",
)
