"""Llama 4 text models (Meta), ``model_type`` ``"llama4_text"``, and the language model of
``llama4`` multimodal folders (the vision tower left out).

RoPE layers attend within chunks of ``attention_chunk_size`` positions (``chunked_attention``
layers) with a weightless RMS qk-norm; every ``no_rope_layer_interval``-th layer is a global
NoPE layer whose queries are scaled by position (``attn_temperature_tuning``, ``floor_scale``,
``attn_scale``). RoPE rotates interleaved pairs (transformers' complex form), with llama3
scaling where set. Every ``interleave_moe_layer_step``-th layer (``moe_layers``) is a mixture
of experts of width ``intermediate_size`` (:class:`~tunesmith.modules.llama4.Llama4MoE`:
sigmoid top-1, the score scaling the expert's input, a shared expert); the dense layers' MLP is
``intermediate_size_mlp`` wide. transformers computes no load-balancing loss for Llama 4, so
neither does tunesmith (``router_aux_loss_coef`` 0). Values are those of the published
``config.json`` files (their ``text_config``).

In memory the MLP is ``mlp`` and the router ``mlp.gate`` (as for every family); the files say
``feed_forward`` and ``feed_forward.router`` (``Family.renames``), and store the experts fused
(``gate_up_proj`` ``[E, hidden, 2 * inter]``, ``down_proj`` ``[E, inter, hidden]``).

Example::

    >>> from tunesmith.models import llama4
    >>> spec = llama4.spec("llama4_scout_17b_16e")
    >>> spec.layer_types[:4], spec.nope_layers[:2], spec.attention_chunk_size
    (('chunked_attention', 'chunked_attention', 'chunked_attention', 'full_attention'), (3, 7), 8192)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tunesmith.models.builder import family_spec, size_builder
from tunesmith.models.family import Family, register_family
from tunesmith.models.spec import ModelSpec

__all__ = [
    "FAMILY",
    "SIZES",
    "llama4_maverick_17b_128e",
    "llama4_scout_17b_16e",
    "llama4_tiny",
    "spec",
]


def _nope_layers(config: Mapping[str, Any]) -> tuple[int, ...]:
    """Layers without RoPE: ``no_rope_layers[i] == 0`` (1 means RoPE), by default every
    ``no_rope_layer_interval``-th layer."""
    n = config["num_hidden_layers"]
    flags = config.get("no_rope_layers") or [
        int((i + 1) % config.get("no_rope_layer_interval", 4) != 0) for i in range(n)
    ]
    if len(flags) != n:
        raise ValueError(f"no_rope_layers lists {len(flags)} layers, num_hidden_layers is {n}")
    return tuple(i for i, rope in enumerate(flags) if not rope)


def _layer_types(config: Mapping[str, Any], nope: tuple[int, ...]) -> tuple[str, ...] | None:
    """HF ``layer_types`` (by default RoPE layers chunked when there is a chunk size); None
    when no layer is chunked."""
    n, chunk = config["num_hidden_layers"], config.get("attention_chunk_size", 8192)
    types = config.get("layer_types") or [
        "chunked_attention" if i not in nope and chunk is not None else "full_attention"
        for i in range(n)
    ]
    if len(types) != n:
        raise ValueError(f"layer_types lists {len(types)} layers, num_hidden_layers is {n}")
    return tuple(types) if "chunked_attention" in types else None


def _moe_layers(config: Mapping[str, Any]) -> tuple[int, ...]:
    """The MoE layers: ``moe_layers``, else every ``interleave_moe_layer_step``-th."""
    step = config.get("interleave_moe_layer_step", 1)
    layers = config.get("moe_layers")
    return tuple(range(step - 1, config["num_hidden_layers"], step) if layers is None else layers)


def _read_config(config: Mapping[str, Any]) -> dict[str, Any]:
    nope = _nope_layers(config)
    types = _layer_types(config, nope)
    moe = set(_moe_layers(config))
    return {
        "intermediate_size": config.get("intermediate_size_mlp", 16384),
        "moe_intermediate_size": config["intermediate_size"],
        "num_experts": config.get("num_local_experts", 16),
        "num_experts_per_tok": config.get("num_experts_per_tok", 1),
        "mlp_only_layers": tuple(i for i in range(config["num_hidden_layers"]) if i not in moe),
        "router_aux_loss_coef": 0.0,  # transformers' Llama 4 has no load-balancing loss
        "moe_router": "llama4",
        "nope_layers": nope,
        "layer_types": types,
        "attention_chunk_size": config.get("attention_chunk_size", 8192) if types else None,
        "rope_interleaved": True,
        "qk_l2_norm": bool(config.get("use_qk_norm", True)),
        "attn_temperature_tuning": bool(config.get("attn_temperature_tuning", True)),
        "floor_scale": float(config.get("floor_scale", 8192)),
        "attn_scale": float(config.get("attn_scale", 0.1)),
    }


def _write_config(spec: ModelSpec) -> dict[str, Any]:
    n = spec.num_hidden_layers
    moe = [i for i in range(n) if spec.is_moe_layer(i)]
    return {
        "intermediate_size": spec.moe_intermediate_size,
        "intermediate_size_mlp": spec.intermediate_size,
        "num_local_experts": spec.num_experts,
        "num_experts_per_tok": spec.num_experts_per_tok,
        "moe_layers": moe,
        "interleave_moe_layer_step": 1,
        "router_aux_loss_coef": spec.router_aux_loss_coef,
        "output_router_logits": False,
        "no_rope_layers": [int(i not in spec.nope_layers) for i in range(n)],
        "layer_types": [
            "chunked_attention" if spec.layer_attention_chunk(i) else "full_attention"
            for i in range(n)
        ],
        "attention_chunk_size": spec.attention_chunk_size,
        "use_qk_norm": spec.qk_l2_norm,
        "attn_temperature_tuning": spec.attn_temperature_tuning,
        "floor_scale": int(spec.floor_scale) if spec.floor_scale.is_integer() else spec.floor_scale,
        "attn_scale": spec.attn_scale,
    }


FAMILY = register_family(
    Family(
        name="llama4",
        model_type="llama4_text",
        architecture="Llama4ForCausalLM",
        flags=("attention_bias",),
        # Llama4TextConfig's defaults: a multimodal config's text_config may leave them out.
        defaults={
            "vocab_size": 202048,
            "hidden_size": 5120,
            "intermediate_size": 8192,
            "num_hidden_layers": 48,
            "num_attention_heads": 40,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "max_position_embeddings": 131072,
            "rms_norm_eps": 1e-5,
            "bos_token_id": 1,
            "eos_token_id": 2,
        },
        from_hf_config=_read_config,
        to_hf_config=_write_config,
        renames={".mlp.gate.": ".feed_forward.router.", ".mlp.": ".feed_forward."},
        renames_in_peft=True,  # transformers' Llama 4 modules are feed_forward too
        multimodal_types=("llama4",),
        has_classifier=False,
    )
)

_COMMON: dict[str, Any] = {
    "model_type": FAMILY.model_type,
    "vocab_size": 202048,
    "hidden_size": 5120,
    "intermediate_size": 16384,
    "moe_intermediate_size": 8192,
    "num_hidden_layers": 48,
    "num_attention_heads": 40,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_interleaved": True,
    "num_experts_per_tok": 1,
    "router_aux_loss_coef": 0.0,
    "moe_router": "llama4",
    "attention_chunk_size": 8192,
    "attn_temperature_tuning": True,
    "floor_scale": 8192.0,
    "attn_scale": 0.1,
    "bos_token_id": 200000,
    "eos_token_id": (200001, 200007, 200008),
    "pad_token_id": 200018,
    "torch_dtype": "bfloat16",
}


def _pattern(layers: int, every: int = 4) -> dict[str, Any]:
    """NoPE (global) layers every ``every``-th, the others chunked RoPE layers."""
    nope = tuple(i for i in range(layers) if (i + 1) % every == 0)
    types = tuple("full_attention" if i in nope else "chunked_attention" for i in range(layers))
    return {"num_hidden_layers": layers, "nope_layers": nope, "layer_types": types}


SIZES: dict[str, dict[str, Any]] = {
    "llama4_scout_17b_16e": {**_pattern(48), "num_experts": 16, "qk_l2_norm": True,
                             "max_position_embeddings": 10485760,
                             "rope_scaling": {"rope_type": "llama3", "factor": 16.0,
                                              "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                              "original_max_position_embeddings": 8192}},
    "llama4_maverick_17b_128e": {**_pattern(48), "num_experts": 128, "qk_l2_norm": False,
                                 "max_position_embeddings": 1048576,
                                 "mlp_only_layers": tuple(range(0, 48, 2))},
    # Odd sizes: 3 experts, chunks of 3 (shorter than the test rows), layers 0, 1, 3, 4
    # chunked RoPE layers and 2, 5 NoPE; layers 1, 3, 5 MoE, 0, 2, 4 dense; a small floor
    # scale so the temperature moves within a few positions.
    "llama4_tiny": {"vocab_size": 256, "hidden_size": 48, "intermediate_size": 80,
                    "moe_intermediate_size": 40, "num_hidden_layers": 6,
                    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 12,
                    "num_experts": 3, "mlp_only_layers": (0, 2, 4), "nope_layers": (2, 5),
                    "layer_types": ("chunked_attention", "chunked_attention", "full_attention",
                                    "chunked_attention", "chunked_attention", "full_attention"),
                    "attention_chunk_size": 3, "qk_l2_norm": True, "floor_scale": 2.0,
                    "attn_scale": 0.5, "max_position_embeddings": 512, "torch_dtype": None,
                    "bos_token_id": None, "eos_token_id": 2, "pad_token_id": None},
}  # fmt: skip


def spec(size: str, **overrides: Any) -> ModelSpec:
    """The :class:`ModelSpec` of a size in :data:`SIZES`, e.g. ``spec("llama4_scout_17b_16e")``."""
    return family_spec(_COMMON, SIZES, size, overrides)


llama4_scout_17b_16e = size_builder(
    __name__,
    spec,
    "llama4_scout_17b_16e",
    "The language model of Llama 4 Scout 17B-16E (108B parameters, 17B active per token).",
)
llama4_maverick_17b_128e = size_builder(
    __name__,
    spec,
    "llama4_maverick_17b_128e",
    "The language model of Llama 4 Maverick 17B-128E (400B parameters, 17B active per token).",
)
llama4_tiny = size_builder(
    __name__,
    spec,
    "llama4_tiny",
    "A 6-layer random Llama 4 for tests (3 experts top-1, chunks of 3, NoPE layers 2 and 5).",
)
