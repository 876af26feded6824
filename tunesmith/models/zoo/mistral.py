"""Mistral 7B v0.3 and Mistral NeMo 12B (Mistral AI).

Architecturally Llama-like; the data differs: a 32768-token (v0.3) or 131072-token
(NeMo, ``head_dim`` 128 < width / heads) vocabulary, RoPE theta 1e6, no sliding
window in these releases (the decoder supports one, as in Mistral 7B v0.1).
Values are those of the published ``config.json`` files.

Example::

    >>> from tunesmith.models import mistral
    >>> model = mistral.mistral_7b_v0_3(device="meta")
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tunesmith.models.builder import family_spec, size_builder
from tunesmith.models.family import Family, register_family
from tunesmith.models.spec import ModelSpec

__all__ = ["FAMILY", "SIZES", "mistral_7b_v0_3", "mistral_nemo_12b", "mistral_tiny", "spec"]


def _read_sliding_window(config: Mapping[str, Any]) -> dict[str, Any]:
    # The window applies to every layer; transformers' MistralConfig default is 4096.
    return {"sliding_window": config.get("sliding_window", 4096)}


def _write_sliding_window(spec: ModelSpec) -> dict[str, Any]:
    return {"sliding_window": spec.sliding_window}


FAMILY = register_family(
    Family(
        name="mistral",
        model_type="mistral",
        architecture="MistralForCausalLM",
        defaults={"max_position_embeddings": 131072, "bos_token_id": 1, "eos_token_id": 2},
        from_hf_config=_read_sliding_window,
        to_hf_config=_write_sliding_window,
    )
)

_COMMON: dict[str, Any] = {
    "model_type": FAMILY.model_type,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "rms_norm_eps": 1e-5,
    "rope_theta": 1000000.0,
    "sliding_window": None,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "bfloat16",
}

SIZES: dict[str, dict[str, Any]] = {
    "mistral_7b_v0_3": {"vocab_size": 32768, "hidden_size": 4096, "intermediate_size": 14336,
                        "num_hidden_layers": 32, "num_attention_heads": 32,
                        "max_position_embeddings": 32768},
    "mistral_nemo_12b": {"vocab_size": 131072, "hidden_size": 5120, "intermediate_size": 14336,
                         "num_hidden_layers": 40, "num_attention_heads": 32,
                         "max_position_embeddings": 1024000},
    # A sliding window shorter than test sequences, so the tiny model exercises it.
    "mistral_tiny": {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
                     "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                     "head_dim": 16, "max_position_embeddings": 512, "sliding_window": 8,
                     "torch_dtype": None},
}  # fmt: skip


def spec(size: str, **overrides: Any) -> ModelSpec:
    """The :class:`ModelSpec` of a size in :data:`SIZES`, e.g. ``spec("mistral_7b_v0_3")``."""
    return family_spec(_COMMON, SIZES, size, overrides)


mistral_7b_v0_3 = size_builder(
    __name__, spec, "mistral_7b_v0_3", "Mistral 7B v0.3 (7.25B parameters)."
)
mistral_nemo_12b = size_builder(
    __name__, spec, "mistral_nemo_12b", "Mistral NeMo 12B (12.2B parameters)."
)
mistral_tiny = size_builder(
    __name__,
    spec,
    "mistral_tiny",
    "A 2-layer random Mistral for tests (vocab 256, sliding window 8).",
)
