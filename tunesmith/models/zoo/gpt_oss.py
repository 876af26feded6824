"""gpt-oss (OpenAI), ``model_type`` ``"gpt_oss"``.

Every layer is attention with biases (q, k, v and o) and **attention sinks** (a learned logit
per head in the softmax denominator, ``self_attn.sinks``), alternating sliding-window (128)
and full layers, yarn RoPE; and a mixture of experts (:class:`ClampedExperts`): a router with
a bias whose top-k logits are softmaxed, experts with biases and the clamped SwiGLU
(``swiglu_alpha`` 1.702, ``swiglu_limit`` 7.0), stored as transformers' fused ``gate_up_proj``
(gate/up interleaved) and ``down_proj``. Published checkpoints hold MXFP4 experts
(``*_blocks``/``*_scales``), dequantized on load (:mod:`tunesmith.models.mxfp4_weights`).
The chat format (harmony) is the folder's own template. Values are those of the published
``config.json``.

Example::

    >>> from tunesmith.models import gpt_oss
    >>> model = gpt_oss.gpt_oss_20b(device="meta")
    >>> model.model.layers[0].self_attn.sinks.shape
    torch.Size([64])
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tunesmith.models.builder import family_spec, size_builder
from tunesmith.models.family import Family, register_family
from tunesmith.models.spec import ModelSpec, layer_types_from_config, layer_types_to_config
from tunesmith.modules.gpt_oss_experts import ClampedExperts

__all__ = ["FAMILY", "SIZES", "gpt_oss_20b", "gpt_oss_120b", "gpt_oss_tiny", "spec"]

# transformers' GptOssConfig defaults for what a config.json may leave out.
_ROPE_DEFAULT = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}


def _alternate(i: int) -> str:
    """transformers' default layer types: even layers slide, odd ones attend fully."""
    return "sliding_attention" if (i + 1) % 2 else "full_attention"


def _read_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """Experts, sinks, the window pattern, and yarn RoPE when the config names no RoPE."""
    fields = {
        **layer_types_from_config(config, config.get("sliding_window", 128), _alternate),
        "num_experts": config.get("num_local_experts", 128),
        "num_experts_per_tok": config.get("num_experts_per_tok", 4),
        "moe_intermediate_size": config["intermediate_size"],
        "router_aux_loss_coef": config.get("router_aux_loss_coef", 0.001),
        "attention_sinks": True,
        "clamped_experts": ClampedExperts(
            swiglu_alpha=config.get("swiglu_alpha", 1.702),
            swiglu_limit=config.get("swiglu_limit", 7.0),
        ),
    }
    if not any(config.get(k) for k in ("rope_parameters", "rope_scaling")):
        fields["rope_scaling"] = dict(_ROPE_DEFAULT)
    return fields


def _write_config(spec: ModelSpec) -> dict[str, Any]:
    if spec.intermediate_size != spec.moe_intermediate_size:
        raise ValueError(
            f"gpt_oss experts are intermediate_size wide: moe_intermediate_size "
            f"({spec.moe_intermediate_size}) must equal intermediate_size "
            f"({spec.intermediate_size})"
        )
    experts = spec.clamped_experts or ClampedExperts()
    return {
        "sliding_window": spec.sliding_window,
        "layer_types": layer_types_to_config(spec),
        "num_local_experts": spec.num_experts,
        "num_experts_per_tok": spec.num_experts_per_tok,
        "router_aux_loss_coef": spec.router_aux_loss_coef,
        "swiglu_alpha": experts.swiglu_alpha,
        "swiglu_limit": experts.swiglu_limit,
        "output_router_logits": False,
    }


FAMILY = register_family(
    Family(
        name="gpt_oss",
        model_type="gpt_oss",
        architecture="GptOssForCausalLM",
        flags=("attention_bias",),
        defaults={
            "rms_norm_eps": 1e-5,
            "max_position_embeddings": 131072,
            "head_dim": 64,
        },
        from_hf_config=_read_config,
        to_hf_config=_write_config,
        template=None,  # harmony: the folder's own chat template
        renames={".mlp.gate.": ".mlp.router."},  # transformers' GptOssTopKRouter
    )
)

_COMMON: dict[str, Any] = {
    "model_type": FAMILY.model_type,
    "vocab_size": 201088,
    "hidden_size": 2880,
    "intermediate_size": 2880,
    "moe_intermediate_size": 2880,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "attention_bias": True,
    "rms_norm_eps": 1e-5,
    "rope_theta": 150000.0,
    "rope_scaling": dict(_ROPE_DEFAULT),
    "max_position_embeddings": 131072,
    "sliding_window": 128,
    "num_experts_per_tok": 4,
    "router_aux_loss_coef": 0.9,
    "attention_sinks": True,
    "clamped_experts": ClampedExperts(),
    "eos_token_id": 200002,
    "pad_token_id": 199999,
    "torch_dtype": "bfloat16",
}


def _types(n: int) -> tuple[str, ...]:
    return tuple(_alternate(i) for i in range(n))


SIZES: dict[str, dict[str, Any]] = {
    "gpt_oss_20b": {"num_hidden_layers": 24, "num_experts": 32, "layer_types": _types(24)},
    "gpt_oss_120b": {"num_hidden_layers": 36, "num_experts": 128, "layer_types": _types(36)},
    # Odd sizes on purpose: 5 experts, top-3, a window shorter than test sequences.
    "gpt_oss_tiny": {"vocab_size": 256, "hidden_size": 48, "intermediate_size": 40,
                     "moe_intermediate_size": 40, "num_hidden_layers": 3,
                     "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 16,
                     "num_experts": 5, "num_experts_per_tok": 3, "sliding_window": 4,
                     "layer_types": _types(3), "max_position_embeddings": 512,
                     "rope_scaling": {**_ROPE_DEFAULT, "factor": 4.0,
                                      "original_max_position_embeddings": 128},
                     "torch_dtype": None, "eos_token_id": 2, "pad_token_id": 0},
}  # fmt: skip


def spec(size: str, **overrides: Any) -> ModelSpec:
    """The :class:`ModelSpec` of a size in :data:`SIZES`, e.g. ``spec("gpt_oss_20b")``."""
    return family_spec(_COMMON, SIZES, size, overrides)


gpt_oss_20b = size_builder(
    __name__, spec, "gpt_oss_20b", "gpt-oss-20b (21B parameters, 3.6B active per token)."
)
gpt_oss_120b = size_builder(
    __name__, spec, "gpt_oss_120b", "gpt-oss-120b (117B parameters, 5.1B active per token)."
)
gpt_oss_tiny = size_builder(
    __name__,
    spec,
    "gpt_oss_tiny",
    "A 3-layer random gpt-oss for tests (5 experts, top-3, window 4, sinks).",
)
