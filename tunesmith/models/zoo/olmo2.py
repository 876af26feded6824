"""OLMo 2 (Allen Institute for AI).

Real differences from Llama: RMSNorms *after* attention and after the MLP instead of before
them (``post`` layout), weights applied in float32 (``float_weight``), and a qk-norm over the
whole q and k projections (not per head), before RoPE. Values are those of the published
``config.json`` files.

Example::

    >>> from tunesmith.models import olmo2
    >>> layer = olmo2.olmo2_1b(device="meta").model.layers[0]
    >>> layer.norm_names, layer.self_attn.q_norm.weight.shape
    (('post_attention_layernorm', 'post_feedforward_layernorm'), torch.Size([2048]))
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tunesmith.models.builder import family_spec, size_builder
from tunesmith.models.family import Family, register_family
from tunesmith.models.spec import ModelSpec

__all__ = ["FAMILY", "SIZES", "olmo2_1b", "olmo2_7b", "olmo2_13b", "olmo2_tiny", "spec"]

OLMO_IMPLIED: dict[str, Any] = {
    "norm_layout": "post",
    "norm_style": "float_weight",
    "qk_norm_per_head": False,
}


def _read(config: Mapping[str, Any]) -> dict[str, Any]:
    return dict(OLMO_IMPLIED)


FAMILY = register_family(
    Family(
        name="olmo2",
        model_type="olmo2",
        architecture="Olmo2ForCausalLM",
        implied={"qk_norm": True},
        flags=("attention_bias",),
        defaults={
            "max_position_embeddings": 2048,
            "rms_norm_eps": 1e-5,
            "pad_token_id": 1,
            "eos_token_id": 50279,
        },  # fmt: skip
        from_hf_config=_read,
        template="olmo2",
    )
)

_COMMON: dict[str, Any] = {
    "model_type": FAMILY.model_type,
    **FAMILY.implied,
    **OLMO_IMPLIED,
    "vocab_size": 100352,
    "rms_norm_eps": 1e-6,
    "rope_theta": 500000.0,
    "max_position_embeddings": 4096,
    "bos_token_id": 100257,
    "eos_token_id": 100257,
    "pad_token_id": 100277,
    "torch_dtype": "float32",
}

SIZES: dict[str, dict[str, Any]] = {
    "olmo2_1b": {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                 "num_attention_heads": 16, "num_key_value_heads": 16, "head_dim": 128},
    "olmo2_7b": {"hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
                 "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": 128},
    "olmo2_13b": {"hidden_size": 5120, "intermediate_size": 13824, "num_hidden_layers": 40,
                  "num_attention_heads": 40, "num_key_value_heads": 40, "head_dim": 128},
    "olmo2_tiny": {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
                   "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                   "head_dim": 16, "max_position_embeddings": 512, "torch_dtype": None,
                   "bos_token_id": None, "eos_token_id": 2, "pad_token_id": None},
}  # fmt: skip


def spec(size: str, **overrides: Any) -> ModelSpec:
    """The :class:`ModelSpec` of a size in :data:`SIZES`, e.g. ``spec("olmo2_7b")``."""
    return family_spec(_COMMON, SIZES, size, overrides)


olmo2_1b = size_builder(__name__, spec, "olmo2_1b", "OLMo 2 1B (1.48B parameters).")
olmo2_7b = size_builder(__name__, spec, "olmo2_7b", "OLMo 2 7B (7.30B parameters).")
olmo2_13b = size_builder(__name__, spec, "olmo2_13b", "OLMo 2 13B (13.7B parameters).")
olmo2_tiny = size_builder(
    __name__,
    spec,
    "olmo2_tiny",
    "A 2-layer, 64-wide random OLMo 2 for tests (vocab 256, post-norms, qk-norm).",
)
