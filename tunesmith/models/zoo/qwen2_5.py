"""Qwen2.5 (Alibaba), ``model_type`` ``"qwen2"``.

Real differences from Llama: a bias on the q/k/v projections (not on o_proj),
RoPE theta 1e6 without scaling, and tied embeddings for 0.5B/1.5B/3B. Values are
those of the published ``-Instruct`` ``config.json`` files (the base checkpoints
share the architecture; load exact base configs with ``from_hf``).

Example::

    >>> from tunesmith.models import qwen2_5
    >>> model = qwen2_5.qwen2_5_0_5b(device="meta")
"""

from __future__ import annotations

from functools import partial
from typing import Any

from tunesmith.models.builder import family_spec, size_builder
from tunesmith.models.family import Family, register_family
from tunesmith.models.spec import (
    ModelSpec,
    use_sliding_window_from_config,
    use_sliding_window_to_config,
)

__all__ = [
    "FAMILY",
    "SIZES",
    "qwen2_5_0_5b",
    "qwen2_5_1_5b",
    "qwen2_5_3b",
    "qwen2_5_7b",
    "qwen2_5_14b",
    "qwen2_5_32b",
    "qwen2_5_72b",
    "qwen2_5_tiny",
    "spec",
]

# A qwen2 config.json always means q/k/v bias (no o/mlp bias, no qk-norm).
FAMILY = register_family(
    Family(
        name="qwen2_5",
        model_type="qwen2",
        architecture="Qwen2ForCausalLM",
        implied={"qkv_bias": True},
        defaults={"max_position_embeddings": 32768},
        from_hf_config=partial(use_sliding_window_from_config, per_layer=True),
        to_hf_config=partial(use_sliding_window_to_config, per_layer=True),
        template="qwen2_5",
    )
)

_COMMON: dict[str, Any] = {
    "model_type": FAMILY.model_type,
    **FAMILY.implied,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "max_position_embeddings": 32768,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "torch_dtype": "bfloat16",
}
_SMALL = {"vocab_size": 151936, "tie_word_embeddings": True}
_LARGE = {"vocab_size": 152064}

SIZES: dict[str, dict[str, Any]] = {
    "qwen2_5_0_5b": {**_SMALL, "hidden_size": 896, "intermediate_size": 4864,
                     "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
                     "head_dim": 64},
    "qwen2_5_1_5b": {**_SMALL, "hidden_size": 1536, "intermediate_size": 8960,
                     "num_hidden_layers": 28, "num_attention_heads": 12, "num_key_value_heads": 2,
                     "head_dim": 128},
    "qwen2_5_3b": {**_SMALL, "hidden_size": 2048, "intermediate_size": 11008,
                   "num_hidden_layers": 36, "num_attention_heads": 16, "num_key_value_heads": 2,
                   "head_dim": 128},
    "qwen2_5_7b": {**_LARGE, "hidden_size": 3584, "intermediate_size": 18944,
                   "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
                   "head_dim": 128},
    "qwen2_5_14b": {**_LARGE, "hidden_size": 5120, "intermediate_size": 13824,
                    "num_hidden_layers": 48, "num_attention_heads": 40, "num_key_value_heads": 8,
                    "head_dim": 128},
    "qwen2_5_32b": {**_LARGE, "hidden_size": 5120, "intermediate_size": 27648,
                    "num_hidden_layers": 64, "num_attention_heads": 40, "num_key_value_heads": 8,
                    "head_dim": 128},
    "qwen2_5_72b": {**_LARGE, "hidden_size": 8192, "intermediate_size": 29568,
                    "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
                    "head_dim": 128},
    "qwen2_5_tiny": {"vocab_size": 256, "tie_word_embeddings": True, "hidden_size": 64,
                     "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                     "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 512,
                     "torch_dtype": None, "bos_token_id": None, "eos_token_id": 2},
}  # fmt: skip


def spec(size: str, **overrides: Any) -> ModelSpec:
    """The :class:`ModelSpec` of a size in :data:`SIZES`, e.g. ``spec("qwen2_5_7b")``."""
    return family_spec(_COMMON, SIZES, size, overrides)


qwen2_5_0_5b = size_builder(
    __name__, spec, "qwen2_5_0_5b", "Qwen2.5 0.5B (0.49B parameters, tied embeddings)."
)
qwen2_5_1_5b = size_builder(
    __name__, spec, "qwen2_5_1_5b", "Qwen2.5 1.5B (1.54B parameters, tied embeddings)."
)
qwen2_5_3b = size_builder(
    __name__, spec, "qwen2_5_3b", "Qwen2.5 3B (3.09B parameters, tied embeddings)."
)
qwen2_5_7b = size_builder(__name__, spec, "qwen2_5_7b", "Qwen2.5 7B (7.61B parameters).")
qwen2_5_14b = size_builder(__name__, spec, "qwen2_5_14b", "Qwen2.5 14B (14.7B parameters).")
qwen2_5_32b = size_builder(__name__, spec, "qwen2_5_32b", "Qwen2.5 32B (32.8B parameters).")
qwen2_5_72b = size_builder(__name__, spec, "qwen2_5_72b", "Qwen2.5 72B (72.7B parameters).")
qwen2_5_tiny = size_builder(
    __name__,
    spec,
    "qwen2_5_tiny",
    "A 2-layer, 64-wide random Qwen2.5 for tests (vocab 256, qkv bias, tied).",
)
