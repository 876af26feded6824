"""Gemma 2 (Google).

Real differences from Llama: embeddings scaled by ``sqrt(hidden_size)``; a GeGLU MLP
(``gelu_pytorch_tanh``); RMSNorms with weight ``1 + w`` (stored centred on 0) before *and*
after attention and the MLP (``sandwich``); a softmax scale of ``query_pre_attn_scalar ** -0.5``;
attention scores and final logits soft-capped (``cap * tanh(x / cap)``, caps 50 and 30);
sliding-window (4096) and global layers alternating, the first one sliding; tied embeddings.
Values are those of the published ``config.json`` files.

Example::

    >>> from tunesmith.models import gemma2
    >>> model = gemma2.gemma2_2b(device="meta")
    >>> model.model.layers[0].attention_type, model.model.layers[1].attention_type
    ('sliding_attention', 'full_attention')
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tunesmith.models.builder import family_spec, size_builder
from tunesmith.models.family import Family, UnsupportedModelError, register_family
from tunesmith.models.spec import ModelSpec, layer_types_from_config, layer_types_to_config

__all__ = ["FAMILY", "SIZES", "gemma2_2b", "gemma2_9b", "gemma2_27b", "gemma2_tiny", "spec"]

# What every Gemma config means, whatever it says: the sandwich of (1 + w) norms, GeGLU's default.
GEMMA_IMPLIED: dict[str, Any] = {"norm_layout": "sandwich", "norm_style": "unit_offset"}


def alternating(i: int) -> str:
    """Gemma 2's default layer types: even layers slide, odd ones attend globally."""
    return "sliding_attention" if (i + 1) % 2 else "full_attention"


def read_gemma(config: Mapping[str, Any], default_type: Any, caps: tuple[Any, Any]) -> dict:
    """The spec fields of a Gemma 2/3 text config; ``caps`` are the defaults of
    ``attn_logit_softcapping`` and ``final_logit_softcapping`` (an explicit null turns one off)."""
    if config.get("use_bidirectional_attention"):
        raise UnsupportedModelError(
            f"{config.get('model_type')}: use_bidirectional_attention (an encoder) is not "
            "supported; tunesmith trains causal LMs"
        )
    return {
        **GEMMA_IMPLIED,
        "hidden_act": config.get("hidden_activation") or "gelu_pytorch_tanh",
        "embedding_multiplier": config["hidden_size"] ** 0.5,
        "attention_multiplier": config.get("query_pre_attn_scalar", 256) ** -0.5,
        "attn_logit_softcapping": config.get("attn_logit_softcapping", caps[0]),
        "final_logit_softcapping": config.get("final_logit_softcapping", caps[1]),
        **layer_types_from_config(config, config.get("sliding_window", 4096), default_type),
    }


def write_gemma(spec: ModelSpec) -> dict[str, Any]:
    """The config.json keys only Gemma 2/3 have (see :func:`read_gemma`)."""
    scalar = (spec.attention_multiplier or spec.head_dim**-0.5) ** -2
    if abs(scalar - round(scalar)) > 1e-6:
        raise UnsupportedModelError(
            f"{spec.model_type}: attention_multiplier {spec.attention_multiplier} is not "
            "query_pre_attn_scalar ** -0.5 of a whole query_pre_attn_scalar"
        )
    return {
        "hidden_activation": spec.hidden_act,
        "query_pre_attn_scalar": round(scalar),
        "sliding_window": spec.sliding_window,
        "layer_types": layer_types_to_config(spec),
        "attn_logit_softcapping": spec.attn_logit_softcapping,
        "final_logit_softcapping": spec.final_logit_softcapping,
    }


def _read(config: Mapping[str, Any]) -> dict[str, Any]:
    return read_gemma(config, alternating, caps=(50.0, 30.0))


FAMILY = register_family(
    Family(
        name="gemma2",
        model_type="gemma2",
        architecture="Gemma2ForCausalLM",
        flags=("attention_bias",),
        defaults={
            "head_dim": 256,
            "max_position_embeddings": 8192,
            "rms_norm_eps": 1e-6,
            "bos_token_id": 2,
            "eos_token_id": 1,
            "pad_token_id": 0,
            "tie_word_embeddings": True,
        },
        from_hf_config=_read,
        to_hf_config=write_gemma,
        template="gemma",
    )
)

_COMMON: dict[str, Any] = {
    "model_type": FAMILY.model_type,
    **GEMMA_IMPLIED,
    "hidden_act": "gelu_pytorch_tanh",
    "vocab_size": 256000,
    "head_dim": 256,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": True,
    "sliding_window": 4096,
    "attention_multiplier": 256**-0.5,
    "attn_logit_softcapping": 50.0,
    "final_logit_softcapping": 30.0,
    "bos_token_id": 2,
    "eos_token_id": 1,
    "pad_token_id": 0,
    "torch_dtype": "bfloat16",
}


def _sizes(layers: int, width: int, **fields: Any) -> dict[str, Any]:
    types = tuple(alternating(i) for i in range(layers))
    return {"num_hidden_layers": layers, "hidden_size": width, "layer_types": types,
            "embedding_multiplier": width**0.5, **fields}  # fmt: skip


SIZES: dict[str, dict[str, Any]] = {
    "gemma2_2b": _sizes(26, 2304, intermediate_size=9216, num_attention_heads=8,
                        num_key_value_heads=4),
    "gemma2_9b": _sizes(42, 3584, intermediate_size=14336, num_attention_heads=16,
                        num_key_value_heads=8),
    "gemma2_27b": _sizes(46, 4608, intermediate_size=36864, num_attention_heads=32,
                         num_key_value_heads=16, head_dim=128, attention_multiplier=144**-0.5),
    # Window 4 < the test sequences, so the alternating layers really differ.
    "gemma2_tiny": _sizes(2, 64, vocab_size=256, intermediate_size=128, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=16, sliding_window=4,
                          max_position_embeddings=512, torch_dtype=None, bos_token_id=None,
                          eos_token_id=2, pad_token_id=None, attention_multiplier=16**-0.5),
}  # fmt: skip


def spec(size: str, **overrides: Any) -> ModelSpec:
    """The :class:`ModelSpec` of a size in :data:`SIZES`, e.g. ``spec("gemma2_9b")``."""
    return family_spec(_COMMON, SIZES, size, overrides)


gemma2_2b = size_builder(
    __name__, spec, "gemma2_2b", "Gemma 2 2B (2.61B parameters, tied embeddings)."
)
gemma2_9b = size_builder(
    __name__, spec, "gemma2_9b", "Gemma 2 9B (9.24B parameters, tied embeddings)."
)
gemma2_27b = size_builder(
    __name__, spec, "gemma2_27b", "Gemma 2 27B (27.2B parameters, tied embeddings, head_dim 128)."
)
gemma2_tiny = size_builder(
    __name__,
    spec,
    "gemma2_tiny",
    "A 2-layer, 64-wide random Gemma 2 for tests (vocab 256, window 4, both soft-caps).",
)
