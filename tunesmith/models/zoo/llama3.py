"""Llama 3.1 / 3.2 / 3.3 (Meta).

What sets the family apart is data only: a 128256-token vocabulary, RoPE theta
500000 with ``"llama3"`` frequency scaling (factor 8 for 3.1/3.3, 32 for 3.2),
and tied embeddings for the small 3.2 models. Values are those of the published
``config.json`` files (base models; 3.3 exists only as Instruct).

Example::

    >>> from tunesmith.models import llama3
    >>> model = llama3.llama3_2_1b(device="meta")       # real architecture, no memory
    >>> tiny = llama3.llama3_tiny()                      # random weights, for tests
"""

from __future__ import annotations

from typing import Any

from tunesmith.models.builder import family_spec, size_builder
from tunesmith.models.family import Family, register_family
from tunesmith.models.spec import ModelSpec

__all__ = [
    "FAMILY",
    "SIZES",
    "llama3_1_8b",
    "llama3_1_70b",
    "llama3_1_405b",
    "llama3_2_1b",
    "llama3_2_3b",
    "llama3_3_70b",
    "llama3_tiny",
    "spec",
]


def _rope_scaling(factor: float, original_max_position_embeddings: int = 8192) -> dict[str, Any]:
    return {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": original_max_position_embeddings,
    }


# Llama configs carry attention_bias and mlp_bias; transformers' LlamaConfig defaults.
FAMILY = register_family(
    Family(
        name="llama3",
        model_type="llama",
        architecture="LlamaForCausalLM",
        flags=("attention_bias", "mlp_bias"),
        defaults={"max_position_embeddings": 2048, "bos_token_id": 1, "eos_token_id": 2},
        template="llama3",
    )
)

_COMMON: dict[str, Any] = {
    "model_type": FAMILY.model_type,
    "vocab_size": 128256,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "max_position_embeddings": 131072,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "torch_dtype": "bfloat16",
}
_LLAMA31 = {"rope_scaling": _rope_scaling(8.0)}
_LLAMA32 = {"rope_scaling": _rope_scaling(32.0), "tie_word_embeddings": True}
_70B = {"hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80}

SIZES: dict[str, dict[str, Any]] = {
    "llama3_1_8b": {**_LLAMA31, "hidden_size": 4096, "intermediate_size": 14336,
                    "num_hidden_layers": 32, "num_attention_heads": 32},
    "llama3_1_70b": {**_LLAMA31, **_70B, "num_attention_heads": 64},
    "llama3_1_405b": {**_LLAMA31, "hidden_size": 16384, "intermediate_size": 53248,
                      "num_hidden_layers": 126, "num_attention_heads": 128},
    "llama3_2_1b": {**_LLAMA32, "hidden_size": 2048, "intermediate_size": 8192,
                    "num_hidden_layers": 16, "num_attention_heads": 32, "head_dim": 64},
    "llama3_2_3b": {**_LLAMA32, "hidden_size": 3072, "intermediate_size": 8192,
                    "num_hidden_layers": 28, "num_attention_heads": 24},
    "llama3_3_70b": {**_LLAMA31, **_70B, "num_attention_heads": 64,
                     "eos_token_id": (128001, 128008, 128009)},
    # Tiny random model for tests; the small original context makes the scaling matter.
    "llama3_tiny": {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
                    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                    "head_dim": 16, "max_position_embeddings": 512, "torch_dtype": None,
                    "rope_scaling": _rope_scaling(8.0, original_max_position_embeddings=64),
                    "bos_token_id": 1, "eos_token_id": 2},
}  # fmt: skip


def spec(size: str, **overrides: Any) -> ModelSpec:
    """The :class:`ModelSpec` of a size in :data:`SIZES`, e.g. ``spec("llama3_2_1b")``."""
    return family_spec(_COMMON, SIZES, size, overrides)


llama3_1_8b = size_builder(__name__, spec, "llama3_1_8b", "Llama 3.1 8B (8.03B parameters).")
llama3_1_70b = size_builder(__name__, spec, "llama3_1_70b", "Llama 3.1 70B (70.6B parameters).")
llama3_1_405b = size_builder(__name__, spec, "llama3_1_405b", "Llama 3.1 405B (405.9B parameters).")
llama3_2_1b = size_builder(
    __name__, spec, "llama3_2_1b", "Llama 3.2 1B (1.24B parameters, tied embeddings)."
)
llama3_2_3b = size_builder(
    __name__, spec, "llama3_2_3b", "Llama 3.2 3B (3.21B parameters, tied embeddings)."
)
llama3_3_70b = size_builder(
    __name__, spec, "llama3_3_70b", "Llama 3.3 70B Instruct (same architecture as 3.1 70B)."
)
llama3_tiny = size_builder(
    __name__,
    spec,
    "llama3_tiny",
    "A 2-layer, 64-wide random Llama 3 for tests (vocab 256, llama3 RoPE scaling).",
)
