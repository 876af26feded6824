"""Mixtral sparse mixture-of-experts models (Mistral AI), ``model_type`` ``"mixtral"``.

Mistral attention (grouped-query, RoPE theta 1e6, a sliding window on every layer when
``sliding_window`` is set) with a sparse MoE block on every layer: ``num_local_experts``
SwiGLU experts of width ``intermediate_size``, softmax top-k routing with the top-k weights
renormalised to sum to one, and a Switch-style load-balancing loss weighted by
``router_aux_loss_coef``. The files keep the original release's names
(``block_sparse_moe.gate``, ``block_sparse_moe.experts.{i}.w1/w2/w3`` = gate/down/up), which
tunesmith renames on load and save (``Family.renames``); in memory, and in PEFT folders, the
names are transformers' (``mlp.gate``, ``mlp.experts``). A ``router_jitter_noise`` (random
noise on the router's input in training) is refused: nothing published uses it.
Values are those of the published ``config.json`` files.

Example::

    >>> from tunesmith.models import mixtral
    >>> model = mixtral.mixtral_8x7b(device="meta")
    >>> model.spec.num_experts, model.spec.num_experts_per_tok
    (8, 2)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tunesmith.models.builder import family_spec, size_builder
from tunesmith.models.family import Family, UnsupportedModelError, register_family
from tunesmith.models.spec import ModelSpec

__all__ = ["FAMILY", "SIZES", "mixtral_8x7b", "mixtral_8x22b", "mixtral_tiny", "spec"]

# Our names -> the files' names (transformers' MixtralForCausalLM conversion, both ways).
RENAMES: dict[str, str] = {
    ".mlp.gate.": ".block_sparse_moe.gate.",
    ".mlp.experts.{i}.gate_proj.": ".block_sparse_moe.experts.{i}.w1.",
    ".mlp.experts.{i}.down_proj.": ".block_sparse_moe.experts.{i}.w2.",
    ".mlp.experts.{i}.up_proj.": ".block_sparse_moe.experts.{i}.w3.",
}


def _read_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """Experts (``num_local_experts`` of width ``intermediate_size``, renormalised top-k) and
    a window on every layer."""
    jitter = config.get("router_jitter_noise", 0.0) or 0.0
    if jitter:
        raise UnsupportedModelError(
            f"mixtral: router_jitter_noise {jitter} (random noise on the router input) is not "
            "supported; set it to 0.0"
        )
    width = config.get("intermediate_size", 14336)
    return {
        "sliding_window": config.get("sliding_window"),
        "num_experts": config.get("num_local_experts", 8),
        "num_experts_per_tok": config.get("num_experts_per_tok", 2),
        "moe_intermediate_size": width,
        "norm_topk_prob": True,
        "router_aux_loss_coef": config.get("router_aux_loss_coef", 0.001),
    }


def _write_config(spec: ModelSpec) -> dict[str, Any]:
    if spec.intermediate_size != spec.moe_intermediate_size:
        raise UnsupportedModelError(
            f"mixtral: intermediate_size ({spec.intermediate_size}) is the experts' width "
            f"and must equal moe_intermediate_size ({spec.moe_intermediate_size})"
        )
    if not spec.norm_topk_prob or spec.mlp_only_layers or spec.decoder_sparse_step != 1:
        raise UnsupportedModelError(
            "mixtral: every layer is a MoE layer with renormalised top-k weights "
            "(norm_topk_prob=True, no mlp_only_layers, decoder_sparse_step=1)"
        )
    return {
        "sliding_window": spec.sliding_window,
        "num_local_experts": spec.num_experts,
        "num_experts_per_tok": spec.num_experts_per_tok,
        "router_aux_loss_coef": spec.router_aux_loss_coef,
        "router_jitter_noise": 0.0,
        "output_router_logits": False,
    }


FAMILY = register_family(
    Family(
        name="mixtral",
        model_type="mixtral",
        architecture="MixtralForCausalLM",
        defaults={"max_position_embeddings": 131072, "bos_token_id": 1, "eos_token_id": 2},
        from_hf_config=_read_config,
        to_hf_config=_write_config,
        renames=RENAMES,
    )
)

_COMMON: dict[str, Any] = {
    "model_type": FAMILY.model_type,
    "vocab_size": 32000,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "rms_norm_eps": 1e-5,
    "rope_theta": 1000000.0,
    "sliding_window": None,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "bfloat16",
}

SIZES: dict[str, dict[str, Any]] = {
    "mixtral_8x7b": {"hidden_size": 4096, "intermediate_size": 14336,
                     "moe_intermediate_size": 14336, "num_hidden_layers": 32,
                     "num_attention_heads": 32, "max_position_embeddings": 32768,
                     "router_aux_loss_coef": 0.02},
    "mixtral_8x22b": {"hidden_size": 6144, "intermediate_size": 16384,
                      "moe_intermediate_size": 16384, "num_hidden_layers": 56,
                      "num_attention_heads": 48, "max_position_embeddings": 65536,
                      "router_aux_loss_coef": 0.001},
    # Odd on purpose: 5 experts, top-3, a window shorter than test sequences.
    "mixtral_tiny": {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 32,
                     "moe_intermediate_size": 32, "num_hidden_layers": 2,
                     "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                     "num_experts": 5, "num_experts_per_tok": 3, "sliding_window": 8,
                     "router_aux_loss_coef": 0.02, "max_position_embeddings": 512,
                     "torch_dtype": None},
}  # fmt: skip


def spec(size: str, **overrides: Any) -> ModelSpec:
    """The :class:`ModelSpec` of a size in :data:`SIZES`, e.g. ``spec("mixtral_8x7b")``."""
    return family_spec(_COMMON, SIZES, size, overrides)


mixtral_8x7b = size_builder(
    __name__, spec, "mixtral_8x7b", "Mixtral 8x7B (46.7B parameters, 12.9B active per token)."
)
mixtral_8x22b = size_builder(
    __name__, spec, "mixtral_8x22b", "Mixtral 8x22B (141B parameters, 39B active per token)."
)
mixtral_tiny = size_builder(
    __name__,
    spec,
    "mixtral_tiny",
    "A 2-layer random Mixtral for tests (5 experts, top-3, sliding window 8).",
)
