"""SmolLM3 (Hugging Face).

Architecturally Llama-like, with layers that use no positional encoding at all (NoPE):
by default every fourth layer (``no_rope_layer_interval``), or as listed per layer in
``no_rope_layers`` (1 = RoPE, 0 = none). A sliding window, when ``use_sliding_window`` is
set, applies to the layers ``layer_types`` names. Values are those of the published
``config.json``.

Example::

    >>> from tunesmith.models import smollm3
    >>> smollm3.spec("smollm3_3b").nope_layers[:3]
    (3, 7, 11)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tunesmith.models.builder import family_spec, size_builder
from tunesmith.models.family import Family, register_family
from tunesmith.models.spec import ModelSpec, layer_types_from_config, layer_types_to_config

__all__ = ["FAMILY", "SIZES", "smollm3_3b", "smollm3_tiny", "spec"]


def _read(config: Mapping[str, Any]) -> dict[str, Any]:
    n = config["num_hidden_layers"]
    rope = config.get("no_rope_layers")
    if rope is None:
        every = config.get("no_rope_layer_interval", 4)
        rope = [int((i + 1) % every != 0) for i in range(n)]
    if len(rope) != n:
        raise ValueError(f"no_rope_layers lists {len(rope)} layers, num_hidden_layers is {n}")
    nope = tuple(i for i, uses_rope in enumerate(rope) if not uses_rope)
    window = config.get("sliding_window") if config.get("use_sliding_window") else None

    def default(i: int) -> str:  # transformers: the NoPE layers slide
        return "sliding_attention" if i in nope else "full_attention"

    return {"nope_layers": nope, **layer_types_from_config(config, window, default)}


def _write(spec: ModelSpec) -> dict[str, Any]:
    return {
        "no_rope_layers": [int(i not in spec.nope_layers) for i in range(spec.num_hidden_layers)],
        "use_sliding_window": spec.sliding_window is not None,
        "sliding_window": spec.sliding_window,
        "layer_types": layer_types_to_config(spec),
    }


FAMILY = register_family(
    Family(
        name="smollm3",
        model_type="smollm3",
        architecture="SmolLM3ForCausalLM",
        flags=("attention_bias", "mlp_bias"),
        defaults={
            "max_position_embeddings": 32768,
            "bos_token_id": 128000,
            "eos_token_id": 128001,
            "pad_token_id": 128004,
            "tie_word_embeddings": True,
        },  # fmt: skip
        from_hf_config=_read,
        to_hf_config=_write,
    )
)

_COMMON: dict[str, Any] = {
    "model_type": FAMILY.model_type,
    "vocab_size": 128256,
    "rms_norm_eps": 1e-6,
    "rope_theta": 5000000.0,
    "max_position_embeddings": 65536,
    "tie_word_embeddings": True,
    "bos_token_id": 128000,
    "eos_token_id": 128012,
    "pad_token_id": 128004,
    "torch_dtype": "bfloat16",
}

SIZES: dict[str, dict[str, Any]] = {
    "smollm3_3b": {"hidden_size": 2048, "intermediate_size": 11008, "num_hidden_layers": 36,
                   "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 128,
                   "nope_layers": tuple(range(3, 36, 4))},
    "smollm3_tiny": {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
                     "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
                     "head_dim": 16, "max_position_embeddings": 512, "torch_dtype": None,
                     "bos_token_id": None, "eos_token_id": 2, "pad_token_id": None,
                     "nope_layers": (1, 3)},
}  # fmt: skip


def spec(size: str, **overrides: Any) -> ModelSpec:
    """The :class:`ModelSpec` of a size in :data:`SIZES`, e.g. ``spec("smollm3_3b")``."""
    return family_spec(_COMMON, SIZES, size, overrides)


smollm3_3b = size_builder(
    __name__,
    spec,
    "smollm3_3b",
    "SmolLM3 3B (3.08B parameters, tied embeddings, every fourth layer NoPE).",
)
smollm3_tiny = size_builder(
    __name__,
    spec,
    "smollm3_tiny",
    "A 4-layer, 64-wide random SmolLM3 for tests (vocab 256, layers 1 and 3 NoPE).",
)
