"""DeepSeek-V2 models (DeepSeek-AI), ``model_type`` ``"deepseek_v2"``: the layers of
:mod:`~tunesmith.models.zoo.deepseek_v3` (multi-head latent attention, shared experts,
``first_k_dense_replace`` dense layers) read by the same code, with V2's routing: softmax
scores, ``topk_method`` ``greedy`` or ``group_limited_greedy`` (groups ranked by their best
expert), no correction bias, weights never renormalised (transformers ignores V2's
``norm_topk_prob``), times ``routed_scaling_factor``. RoPE is always interleaved. transformers
has no auxiliary loss for it (V2's ``aux_loss_alpha`` / ``seq_aux`` are not read), so
``router_aux_loss_coef`` is 0. Values are those of the published ``config.json``.

Example::

    >>> from tunesmith.models import deepseek_v2
    >>> deepseek_v2.spec("deepseek_v2_lite").moe_routing.method
    'greedy'
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tunesmith.models.builder import family_spec, size_builder
from tunesmith.models.family import Family, UnsupportedModelError, register_family
from tunesmith.models.spec import ModelSpec
from tunesmith.models.zoo.deepseek_v3 import read_experts, read_mla, write_experts, write_mla
from tunesmith.modules.mla import MLAConfig
from tunesmith.modules.routers import DeepSeekRouting

__all__ = ["FAMILY", "SIZES", "deepseek_v2_lite", "deepseek_v2_tiny", "spec"]

_METHODS = ("greedy", "group_limited_greedy")


def _read_config(config: Mapping[str, Any]) -> dict[str, Any]:
    method = config.get("topk_method", "greedy")
    scoring = config.get("scoring_func", "softmax")
    if method not in _METHODS or scoring != "softmax":
        raise UnsupportedModelError(
            f"deepseek_v2 routing topk_method={method!r} scoring_func={scoring!r} is not "
            f"supported (transformers runs {' or '.join(_METHODS)} over softmax scores)"
        )
    return {**read_mla(config), **read_experts(config, method), "rope_interleaved": True}


def _write_config(spec: ModelSpec) -> dict[str, Any]:
    if not spec.rope_interleaved:
        raise UnsupportedModelError("deepseek_v2 RoPE is always interleaved (rope_interleaved)")
    return {**write_mla(spec), **write_experts(spec), "scoring_func": "softmax"}


FAMILY = register_family(
    Family(
        name="deepseek_v2",
        model_type="deepseek_v2",
        architecture="DeepseekV2ForCausalLM",
        flags=("attention_bias", "mlp_bias"),
        defaults={"max_position_embeddings": 2048, "bos_token_id": 1, "eos_token_id": 2},
        from_hf_config=_read_config,
        to_hf_config=_write_config,
    )
)

_COMMON: dict[str, Any] = {
    "model_type": FAMILY.model_type,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "head_dim": 64,
    "router_aux_loss_coef": 0.0,
    "rope_interleaved": True,
    "torch_dtype": "bfloat16",
}

SIZES: dict[str, dict[str, Any]] = {
    "deepseek_v2_lite": {
        "vocab_size": 102400, "hidden_size": 2048, "intermediate_size": 10944,
        "moe_intermediate_size": 1408, "num_hidden_layers": 27, "num_attention_heads": 16,
        "num_key_value_heads": 16, "max_position_embeddings": 163840,
        "rope_scaling": {"rope_type": "yarn", "factor": 40.0, "beta_fast": 32, "beta_slow": 1,
                         "mscale": 0.707, "mscale_all_dim": 0.707,
                         "original_max_position_embeddings": 4096},
        "mla": MLAConfig(None, 512, 128, 64, 128), "num_experts": 64, "num_experts_per_tok": 6,
        "mlp_only_layers": (0,), "moe_routing": DeepSeekRouting("greedy", 1, 1, 1.0, 2),
        "bos_token_id": 100000, "eos_token_id": 100001,
    },
    # Odd sizes: 3 heads, no low-rank query, 5 experts, top-2, layer 0 dense.
    "deepseek_v2_tiny": {
        "vocab_size": 256, "hidden_size": 36, "intermediate_size": 56,
        "moe_intermediate_size": 20, "num_hidden_layers": 2, "num_attention_heads": 3,
        "num_key_value_heads": 3, "head_dim": 6, "max_position_embeddings": 512,
        "mla": MLAConfig(None, 14, 10, 6, 8), "num_experts": 5, "num_experts_per_tok": 2,
        "mlp_only_layers": (0,), "moe_routing": DeepSeekRouting("greedy", 1, 1, 1.5, 1),
        "torch_dtype": None, "bos_token_id": None, "eos_token_id": 2,
    },
}  # fmt: skip


def spec(size: str, **overrides: Any) -> ModelSpec:
    """The :class:`ModelSpec` of a size in :data:`SIZES`, e.g. ``spec("deepseek_v2_lite")``."""
    return family_spec(_COMMON, SIZES, size, overrides)


deepseek_v2_lite = size_builder(
    __name__,
    spec,
    "deepseek_v2_lite",
    "DeepSeek-V2-Lite (15.7B parameters, 2.4B active per token).",
)
deepseek_v2_tiny = size_builder(
    __name__,
    spec,
    "deepseek_v2_tiny",
    "A 2-layer random DeepSeek-V2 for tests (MLA without a low-rank query, 5 experts, top-2).",
)
