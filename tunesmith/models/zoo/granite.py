"""Granite 3 dense models (IBM).

Architecturally Llama-like, with four scalars from its config: ``embedding_multiplier``
scales the embeddings, ``residual_multiplier`` each block's output before it joins the
residual stream, ``attention_multiplier`` is the softmax scale, and the logits are divided by
``logits_scaling`` (in every loss path too). Values are those of the published
``config.json`` files.

Example::

    >>> from tunesmith.models import granite
    >>> granite.spec("granite3_3_2b").logit_transform
    LogitTransform(scale=0.125, softcap=None)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tunesmith.models.builder import family_spec, size_builder
from tunesmith.models.family import Family, register_family
from tunesmith.models.spec import ModelSpec

__all__ = ["FAMILY", "SIZES", "granite3_3_2b", "granite3_3_8b", "granite_tiny", "spec"]


def _read(config: Mapping[str, Any]) -> dict[str, Any]:
    # transformers' GraniteConfig defaults every multiplier to 1.0, the softmax scale too.
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    scale = float(config.get("attention_multiplier", 1.0))
    return {
        "embedding_multiplier": float(config.get("embedding_multiplier", 1.0)),
        "residual_multiplier": float(config.get("residual_multiplier", 1.0)),
        "logits_scaling": float(config.get("logits_scaling", 1.0)),
        "attention_multiplier": None if scale == head_dim**-0.5 else scale,
    }


def _write(spec: ModelSpec) -> dict[str, Any]:
    return {
        "embedding_multiplier": spec.embedding_multiplier,
        "residual_multiplier": spec.residual_multiplier,
        "logits_scaling": spec.logits_scaling,
        "attention_multiplier": spec.attention_multiplier or spec.head_dim**-0.5,
    }


FAMILY = register_family(
    Family(
        name="granite",
        model_type="granite",
        architecture="GraniteForCausalLM",
        flags=("attention_bias", "mlp_bias"),
        defaults={"max_position_embeddings": 2048, "bos_token_id": 1, "eos_token_id": 2},
        from_hf_config=_read,
        to_hf_config=_write,
        has_classifier=False,  # transformers has no GraniteForSequenceClassification
    )
)

_COMMON: dict[str, Any] = {
    "model_type": FAMILY.model_type,
    "vocab_size": 49159,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000000.0,
    "max_position_embeddings": 131072,
    "tie_word_embeddings": True,
    "embedding_multiplier": 12.0,
    "residual_multiplier": 0.22,
    "bos_token_id": 0,
    "eos_token_id": 0,
    "pad_token_id": 0,
    "torch_dtype": "bfloat16",
}

SIZES: dict[str, dict[str, Any]] = {
    "granite3_3_2b": {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 40,
                      "num_attention_heads": 32, "attention_multiplier": 0.015625,
                      "logits_scaling": 8.0},
    "granite3_3_8b": {"hidden_size": 4096, "intermediate_size": 12800, "num_hidden_layers": 40,
                      "num_attention_heads": 32, "head_dim": 128,
                      "attention_multiplier": 0.0078125, "logits_scaling": 16.0},
    "granite_tiny": {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
                     "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                     "head_dim": 16, "max_position_embeddings": 512, "torch_dtype": None,
                     "bos_token_id": None, "eos_token_id": 2, "pad_token_id": None,
                     "embedding_multiplier": 3.0, "residual_multiplier": 0.5,
                     "attention_multiplier": 0.1, "logits_scaling": 4.0},
}  # fmt: skip


def spec(size: str, **overrides: Any) -> ModelSpec:
    """The :class:`ModelSpec` of a size in :data:`SIZES`, e.g. ``spec("granite3_3_8b")``."""
    return family_spec(_COMMON, SIZES, size, overrides)


granite3_3_2b = size_builder(
    __name__, spec, "granite3_3_2b", "Granite 3.3 2B (2.53B parameters, tied embeddings)."
)
granite3_3_8b = size_builder(
    __name__, spec, "granite3_3_8b", "Granite 3.3 8B (8.17B parameters, tied embeddings)."
)
granite_tiny = size_builder(
    __name__,
    spec,
    "granite_tiny",
    "A 2-layer, 64-wide random Granite for tests (vocab 256, every multiplier set).",
)
