"""Gemma 3 text models (Google): the ``gemma3_text`` checkpoints (1B) and the language model of
the others (their ``gemma3`` multimodal folders load as it, the vision tower left out).

Gemma 2's structure (scaled embeddings, GeGLU, ``1 + w`` sandwich norms,
``query_pre_attn_scalar``) with a per-head qk-norm, five sliding-window layers to one global
layer, a RoPE base of 10000 on sliding layers (``rope_local_base_freq``) and 1e6 on global ones
(scaled linearly by 8 from 4B up), and no soft-capping. Values are those of the published
``config.json`` files (the text part of the multimodal 4B/12B/27B ones).

Example::

    >>> from tunesmith.models import gemma3
    >>> spec = gemma3.spec("gemma3_1b")
    >>> spec.layer_types[:6], spec.rope_local_theta
    (('sliding_attention', 'sliding_attention', 'sliding_attention', 'sliding_attention', \
'sliding_attention', 'full_attention'), 10000.0)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tunesmith.models.builder import family_spec, size_builder
from tunesmith.models.family import Family, register_family
from tunesmith.models.spec import ModelSpec
from tunesmith.models.zoo.gemma2 import GEMMA_IMPLIED, read_gemma, write_gemma

__all__ = [
    "FAMILY",
    "SIZES",
    "gemma3_1b",
    "gemma3_4b",
    "gemma3_12b",
    "gemma3_27b",
    "gemma3_tiny",
    "spec",
]


def _pattern(every: int) -> Any:
    """Gemma 3's default layer types: every ``every``-th layer global, the others sliding."""
    return lambda i: "sliding_attention" if (i + 1) % every else "full_attention"


def _read(config: Mapping[str, Any]) -> dict[str, Any]:
    fields = read_gemma(config, _pattern(config.get("sliding_window_pattern", 6)), (None, None))
    # Gemma 3 configs carry attn_logit_softcapping, but transformers' Gemma 3 never applies it.
    fields["attn_logit_softcapping"] = None
    # 4.x configs name the sliding layers' RoPE base; 5.x ones carry it in rope_parameters,
    # which the generic reader already turned into rope_local_theta.
    if "rope_local_base_freq" in config or "rope_parameters" not in config:
        local = float(config.get("rope_local_base_freq", 10000.0))
        theta = config.get("rope_theta", 1000000.0)
        fields["rope_local_theta"] = None if local == theta else local
    return fields


def _write(spec: ModelSpec) -> dict[str, Any]:
    local = spec.rope_theta if spec.rope_local_theta is None else spec.rope_local_theta
    return {**write_gemma(spec), "rope_local_base_freq": local}


FAMILY = register_family(
    Family(
        name="gemma3",
        model_type="gemma3_text",
        architecture="Gemma3ForCausalLM",
        implied={"qk_norm": True},
        flags=("attention_bias",),
        # Gemma3TextConfig's defaults: multimodal configs' text_config leave sizes out.
        defaults={
            "vocab_size": 262208,
            "hidden_size": 2304,
            "intermediate_size": 9216,
            "num_hidden_layers": 26,
            "num_attention_heads": 8,
            "num_key_value_heads": 4,
            "head_dim": 256,
            "max_position_embeddings": 131072,
            "rms_norm_eps": 1e-6,
            "bos_token_id": 2,
            "eos_token_id": 1,
            "pad_token_id": 0,
            "tie_word_embeddings": True,
        },
        from_hf_config=_read,
        to_hf_config=_write,
        template="gemma",
        multimodal_types=("gemma3",),
        classifier="Gemma3TextForSequenceClassification",
    )
)

_COMMON: dict[str, Any] = {
    "model_type": FAMILY.model_type,
    **FAMILY.implied,
    **GEMMA_IMPLIED,
    "hidden_act": "gelu_pytorch_tanh",
    "vocab_size": 262208,
    "head_dim": 256,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "rope_local_theta": 10000.0,
    "rope_scaling": {"rope_type": "linear", "factor": 8.0},
    "max_position_embeddings": 131072,
    "tie_word_embeddings": True,
    "sliding_window": 1024,
    "attention_multiplier": 256**-0.5,
    "bos_token_id": 2,
    "eos_token_id": 1,
    "pad_token_id": 0,
    "torch_dtype": "bfloat16",
}


def _sizes(layers: int, width: int, **fields: Any) -> dict[str, Any]:
    types = tuple(_pattern(6)(i) for i in range(layers))
    return {"num_hidden_layers": layers, "hidden_size": width, "layer_types": types,
            "embedding_multiplier": width**0.5, **fields}  # fmt: skip


SIZES: dict[str, dict[str, Any]] = {
    "gemma3_1b": _sizes(26, 1152, intermediate_size=6912, num_attention_heads=4,
                        num_key_value_heads=1, vocab_size=262144, sliding_window=512,
                        rope_scaling=None, max_position_embeddings=32768),
    "gemma3_4b": _sizes(34, 2560, intermediate_size=10240, num_attention_heads=8,
                        num_key_value_heads=4),
    "gemma3_12b": _sizes(48, 3840, intermediate_size=15360, num_attention_heads=16,
                         num_key_value_heads=8),
    "gemma3_27b": _sizes(62, 5376, intermediate_size=21504, num_attention_heads=32,
                         num_key_value_heads=16, head_dim=128, attention_multiplier=168**-0.5),
    # Window 4 < the test sequences; two local layers then a global one.
    "gemma3_tiny": {**_sizes(3, 64, vocab_size=256, intermediate_size=128, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=16, sliding_window=4,
                             max_position_embeddings=512, torch_dtype=None, bos_token_id=None,
                             eos_token_id=2, pad_token_id=None, rope_scaling=None,
                             attention_multiplier=16**-0.5),
                    "layer_types": ("sliding_attention", "sliding_attention", "full_attention")},
}  # fmt: skip


def spec(size: str, **overrides: Any) -> ModelSpec:
    """The :class:`ModelSpec` of a size in :data:`SIZES`, e.g. ``spec("gemma3_1b")``."""
    return family_spec(_COMMON, SIZES, size, overrides)


gemma3_1b = size_builder(
    __name__, spec, "gemma3_1b", "Gemma 3 1B (1.00B parameters, tied embeddings, text only)."
)
gemma3_4b = size_builder(
    __name__,
    spec,
    "gemma3_4b",
    "The language model of Gemma 3 4B (3.88B parameters, tied embeddings).",
)
gemma3_12b = size_builder(
    __name__,
    spec,
    "gemma3_12b",
    "The language model of Gemma 3 12B (11.8B parameters, tied embeddings).",
)
gemma3_27b = size_builder(
    __name__,
    spec,
    "gemma3_27b",
    "The language model of Gemma 3 27B (27.0B parameters, tied embeddings).",
)
gemma3_tiny = size_builder(
    __name__,
    spec,
    "gemma3_tiny",
    "A 3-layer, 64-wide random Gemma 3 for tests (vocab 256, window 4, local RoPE base).",
)
