"""Qwen3 dense models (Alibaba).

Real differences from Llama: a per-head RMSNorm on q and k before RoPE
(``qk_norm``), ``head_dim`` 128 independent of the width, RoPE theta 1e6, and tied
embeddings for 0.6B/1.7B/4B. Values are those of the published ``config.json``.

Example::

    >>> from tunesmith.models import qwen3
    >>> model = qwen3.qwen3_0_6b(device="meta")
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
    "qwen3_0_6b",
    "qwen3_1_7b",
    "qwen3_4b",
    "qwen3_8b",
    "qwen3_14b",
    "qwen3_32b",
    "qwen3_tiny",
    "spec",
]

# A qwen3 config.json always means qk-norm; head_dim defaults to 128 (Qwen3Config).
FAMILY = register_family(
    Family(
        name="qwen3",
        model_type="qwen3",
        architecture="Qwen3ForCausalLM",
        implied={"qk_norm": True},
        flags=("attention_bias",),
        defaults={"head_dim": 128, "max_position_embeddings": 32768},
        from_hf_config=partial(use_sliding_window_from_config, per_layer=True),
        to_hf_config=partial(use_sliding_window_to_config, per_layer=True),
        template="qwen3",
    )
)

_COMMON: dict[str, Any] = {
    "model_type": FAMILY.model_type,
    **FAMILY.implied,
    "vocab_size": 151936,
    "head_dim": 128,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "max_position_embeddings": 40960,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "torch_dtype": "bfloat16",
}
_TIED = {"tie_word_embeddings": True}

SIZES: dict[str, dict[str, Any]] = {
    "qwen3_0_6b": {**_TIED, "hidden_size": 1024, "intermediate_size": 3072,
                   "num_hidden_layers": 28, "num_attention_heads": 16},
    "qwen3_1_7b": {**_TIED, "hidden_size": 2048, "intermediate_size": 6144,
                   "num_hidden_layers": 28, "num_attention_heads": 16},
    "qwen3_4b": {**_TIED, "hidden_size": 2560, "intermediate_size": 9728,
                 "num_hidden_layers": 36, "num_attention_heads": 32},
    "qwen3_8b": {"hidden_size": 4096, "intermediate_size": 12288,
                 "num_hidden_layers": 36, "num_attention_heads": 32},
    "qwen3_14b": {"hidden_size": 5120, "intermediate_size": 17408,
                  "num_hidden_layers": 40, "num_attention_heads": 40},
    "qwen3_32b": {"hidden_size": 5120, "intermediate_size": 25600,
                  "num_hidden_layers": 64, "num_attention_heads": 64},
    # head_dim * heads != hidden_size on purpose, as in the real 0.6B.
    "qwen3_tiny": {**_TIED, "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
                   "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                   "head_dim": 32, "max_position_embeddings": 512, "torch_dtype": None,
                   "bos_token_id": None, "eos_token_id": 2},
}  # fmt: skip


def spec(size: str, **overrides: Any) -> ModelSpec:
    """The :class:`ModelSpec` of a size in :data:`SIZES`, e.g. ``spec("qwen3_8b")``."""
    return family_spec(_COMMON, SIZES, size, overrides)


qwen3_0_6b = size_builder(
    __name__, spec, "qwen3_0_6b", "Qwen3 0.6B (0.60B parameters, tied embeddings)."
)
qwen3_1_7b = size_builder(
    __name__, spec, "qwen3_1_7b", "Qwen3 1.7B (1.72B parameters, tied embeddings)."
)
qwen3_4b = size_builder(__name__, spec, "qwen3_4b", "Qwen3 4B (4.02B parameters, tied embeddings).")
qwen3_8b = size_builder(__name__, spec, "qwen3_8b", "Qwen3 8B (8.19B parameters).")
qwen3_14b = size_builder(__name__, spec, "qwen3_14b", "Qwen3 14B (14.8B parameters).")
qwen3_32b = size_builder(__name__, spec, "qwen3_32b", "Qwen3 32B (32.8B parameters).")
qwen3_tiny = size_builder(
    __name__,
    spec,
    "qwen3_tiny",
    "A 2-layer, 64-wide random Qwen3 for tests (vocab 256, qk-norm, head_dim 32, tied).",
)
