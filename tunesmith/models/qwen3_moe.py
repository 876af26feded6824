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

from typing import Any

import torch

from tunesmith.models.builder import build_model, family_spec
from tunesmith.models.spec import ModelSpec
from tunesmith.modules.decoder import TransformerLM

__all__ = ["SIZES", "qwen3_30b_a3b", "qwen3_235b_a22b", "qwen3_moe_tiny", "spec"]

_COMMON: dict[str, Any] = {
    "model_type": "qwen3_moe",
    "qk_norm": True,
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


def _build(size: str, device: Any, dtype: torch.dtype | None, overrides: Any) -> TransformerLM:
    return build_model(spec(size, **overrides), device=device, dtype=dtype)


def qwen3_30b_a3b(
    *, device: Any = None, dtype: torch.dtype | None = None, **overrides: Any
) -> TransformerLM:
    """Qwen3-30B-A3B (30.5B parameters, 3.3B active per token)."""
    return _build("qwen3_30b_a3b", device, dtype, overrides)


def qwen3_235b_a22b(
    *, device: Any = None, dtype: torch.dtype | None = None, **overrides: Any
) -> TransformerLM:
    """Qwen3-235B-A22B (235B parameters, 22B active per token)."""
    return _build("qwen3_235b_a22b", device, dtype, overrides)


def qwen3_moe_tiny(
    *, device: Any = None, dtype: torch.dtype | None = None, **overrides: Any
) -> TransformerLM:
    """A 3-layer random Qwen3-MoE for tests (8 experts, top-2, layer 1 dense)."""
    return _build("qwen3_moe_tiny", device, dtype, overrides)
