"""ModelSpec: the architecture of a decoder-only LM as plain data.

A spec holds everything the builder needs, in the vocabulary of Hugging Face
``config.json`` files, so that :func:`spec_from_hf_config` and
:meth:`ModelSpec.to_hf_config` are simple, lossless translations.

Example::

    >>> spec = spec_from_hf_config({"model_type": "qwen3", "vocab_size": 151936,
    ...     "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
    ...     "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
    ...     "tie_word_embeddings": True})
    >>> spec.qk_norm, spec.tie_word_embeddings
    (True, True)
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "ModelSpec",
    "UnsupportedModelError",
    "spec_from_hf_config",
]

# model_type -> the transformers class that reads the same checkpoint.
_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}
SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(_ARCHITECTURES)
# The same checkpoint body with a ``score`` head instead of ``lm_head`` (reward models).
_SEQ_CLS_ARCHITECTURES = {
    model_type: name.replace("ForCausalLM", "ForSequenceClassification")
    for model_type, name in _ARCHITECTURES.items()
}

# Families whose attention always applies a per-head RMSNorm to q and k.
_QK_NORM_TYPES = ("qwen3", "qwen3_moe")
# RoPE variants implemented by tunesmith.modules.rope.
_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
_ROPE_KEYS: dict[str, tuple[str, ...]] = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings"),
}


class UnsupportedModelError(ValueError):
    """A config asks for a model type or feature tunesmith does not implement."""


@dataclass(frozen=True)
class ModelSpec:
    """Architecture of a decoder-only transformer LM (field names follow HF configs).

    Attention biases: ``attention_bias`` puts a bias on q, k, v *and* o (Llama's
    flag); ``qkv_bias`` puts one on q, k, v only (Qwen2). ``qk_norm`` adds a
    per-head RMSNorm on q and k before RoPE (Qwen3). A layer ``i`` is a
    mixture-of-experts layer when :meth:`is_moe_layer` says so (Qwen3-MoE rule).
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    attention_bias: bool = False
    qkv_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    # Mixture of experts (num_experts == 0 means a dense model).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    router_aux_loss_coef: float = 0.001
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # Initialisation and tokens (carried through to config.json).
    initializer_range: float = 0.02
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None
    torch_dtype: str | None = None

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model_type {self.model_type!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type not in _ROPE_TYPES:
            raise UnsupportedModelError(
                f"rope_type {rope_type!r} is not supported; supported: {', '.join(_ROPE_TYPES)}"
            )
        missing = [k for k in _ROPE_KEYS[rope_type] if (self.rope_scaling or {}).get(k) is None]
        if missing:
            raise ValueError(f"rope_scaling of type {rope_type!r} lacks {missing}")
        if self.num_experts and not (0 < self.num_experts_per_tok <= self.num_experts):
            raise ValueError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) must be in "
                f"1..num_experts ({self.num_experts})"
            )
        if self.num_experts and self.moe_intermediate_size <= 0:
            raise ValueError("moe_intermediate_size must be positive for a MoE model")
        # Normalise list-valued fields so that specs compare equal however they were made.
        object.__setattr__(self, "mlp_only_layers", tuple(self.mlp_only_layers))
        if isinstance(self.eos_token_id, list):
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))

    @property
    def is_moe(self) -> bool:
        """True when at least one layer is a mixture-of-experts layer."""
        return any(self.is_moe_layer(i) for i in range(self.num_hidden_layers))

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Whether layer ``layer_idx`` uses experts (HF Qwen3-MoE rule)."""
        return (
            self.num_experts > 0
            and layer_idx not in self.mlp_only_layers
            and (layer_idx + 1) % self.decoder_sparse_step == 0
        )

    def replace(self, **changes: Any) -> ModelSpec:
        """A copy with some fields changed, e.g. ``spec.replace(num_hidden_layers=2)``."""
        return dataclasses.replace(self, **changes)

    def to_hf_config(self, *, num_labels: int | None = None) -> dict[str, Any]:
        """A ``config.json`` dict that transformers (4.x and 5.x) and vLLM load as is.

        RoPE is written in the widely read legacy form (``rope_theta`` plus a
        ``rope_scaling`` dict or null), which transformers 5 also accepts.

        With ``num_labels`` the config is that of the family's ``*ForSequenceClassification``
        (a reward model: ``score`` head of ``num_labels`` outputs, no ``lm_head``), with
        ``num_labels``, ``id2label`` and ``label2id`` as transformers reads them. It then needs
        ``pad_token_id``: transformers scores the last token of each row that is not padding.

        Example::

            >>> from tunesmith.models import llama3
            >>> spec = llama3.spec("llama3_tiny").replace(pad_token_id=0)
            >>> spec.to_hf_config(num_labels=1)["architectures"]
            ['LlamaForSequenceClassification']
        """
        config: dict[str, Any] = {
            "architectures": [_ARCHITECTURES[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": copy.deepcopy(self.rope_scaling),
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "initializer_range": self.initializer_range,
            "attention_dropout": 0.0,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": (
                list(self.eos_token_id)
                if isinstance(self.eos_token_id, tuple)
                else self.eos_token_id
            ),
            "pad_token_id": self.pad_token_id,
            "use_cache": True,
        }
        if self.torch_dtype is not None:
            config["torch_dtype"] = self.torch_dtype
        if self.model_type == "qwen2":
            if self.attention_bias or self.mlp_bias or not self.qkv_bias or self.qk_norm:
                raise UnsupportedModelError(
                    "a qwen2 config.json always means q/k/v bias, no o/mlp bias, no qk-norm; "
                    "this spec differs, so transformers would not rebuild it"
                )
        else:
            if self.qkv_bias:
                raise UnsupportedModelError(
                    f"qkv_bias without o_proj bias has no {self.model_type} config.json "
                    "equivalent (use model_type 'qwen2' or attention_bias)"
                )
            if self.qk_norm != (self.model_type in _QK_NORM_TYPES):
                raise UnsupportedModelError(
                    f"qk_norm={self.qk_norm} cannot be expressed by model_type {self.model_type!r}"
                )
        if self.model_type in ("llama", "qwen3", "qwen3_moe"):
            config["attention_bias"] = self.attention_bias
        elif self.attention_bias:
            raise UnsupportedModelError(f"{self.model_type} configs have no attention_bias flag")
        if self.model_type == "llama":
            config["mlp_bias"] = self.mlp_bias
        elif self.mlp_bias:
            raise UnsupportedModelError(f"{self.model_type} configs have no mlp_bias flag")
        if self.model_type == "mistral":
            config["sliding_window"] = self.sliding_window
        elif self.model_type in ("qwen2", "qwen3", "qwen3_moe"):
            config["use_sliding_window"] = self.sliding_window is not None
            config["sliding_window"] = self.sliding_window
            if self.model_type != "qwen3_moe":
                # Qwen2/Qwen3 slide only on layers >= max_window_layers: 0 = all of them.
                config["max_window_layers"] = 0 if self.sliding_window else self.num_hidden_layers
        elif self.sliding_window is not None:
            raise UnsupportedModelError(f"{self.model_type} configs have no sliding window")
        if self.model_type == "qwen3_moe":
            config.update(
                num_experts=self.num_experts,
                num_experts_per_tok=self.num_experts_per_tok,
                moe_intermediate_size=self.moe_intermediate_size,
                norm_topk_prob=self.norm_topk_prob,
                router_aux_loss_coef=self.router_aux_loss_coef,
                decoder_sparse_step=self.decoder_sparse_step,
                mlp_only_layers=list(self.mlp_only_layers),
                output_router_logits=False,
            )
        elif self.num_experts:
            raise UnsupportedModelError(f"{self.model_type} has no mixture-of-experts layers")
        if num_labels is not None:
            config.update(self._sequence_classification_fields(num_labels))
        return config

    def _sequence_classification_fields(self, num_labels: int) -> dict[str, Any]:
        """``config.json`` fields of a ``*ForSequenceClassification`` with ``num_labels``."""
        if isinstance(num_labels, bool) or not isinstance(num_labels, int) or num_labels < 1:
            raise ValueError(f"num_labels must be a positive int, got {num_labels!r}")
        if self.pad_token_id is None:
            raise ValueError(
                "a sequence-classification config.json needs pad_token_id (transformers "
                "scores the last token that is not padding); set it on the spec"
            )
        labels = [f"LABEL_{i}" for i in range(num_labels)]
        return {
            "architectures": [_SEQ_CLS_ARCHITECTURES[self.model_type]],
            "num_labels": num_labels,
            "id2label": {str(i): label for i, label in enumerate(labels)},
            "label2id": {label: i for i, label in enumerate(labels)},
        }


# ---------------------------------------------------------------------------------------------
# config.json -> ModelSpec
# ---------------------------------------------------------------------------------------------

_REQUIRED_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
)


def _rope_from_config(config: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from a 4.x (``rope_theta``/``rope_scaling``) or 5.x
    (``rope_parameters``) config; a scaling dict of type "default" becomes None."""
    params = config.get("rope_parameters") or {}
    if params and any(isinstance(v, dict) for v in params.values()):
        raise UnsupportedModelError(
            f"per-layer-type rope_parameters ({sorted(params)}) are not supported"
        )
    scaling = dict(config.get("rope_scaling") or params)
    theta = scaling.pop("rope_theta", None)
    if theta is None:
        theta = config.get("rope_theta", params.get("rope_theta", 10000.0))
    if "type" in scaling and "rope_type" not in scaling:  # very old configs
        scaling["rope_type"] = scaling.pop("type")
    scaling.pop("type", None)
    partial = scaling.pop("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise UnsupportedModelError(f"partial_rotary_factor={partial} is not supported")
    rope_type = scaling.get("rope_type", "default")
    if rope_type not in _ROPE_TYPES:
        raise UnsupportedModelError(
            f"rope_type {rope_type!r} is not supported; supported: {', '.join(_ROPE_TYPES)}"
        )
    if rope_type in ("llama3", "yarn"):
        # transformers fills these in from max_position_embeddings when absent.
        max_pos = config.get("max_position_embeddings")
        if scaling.get("original_max_position_embeddings") is None:
            scaling["original_max_position_embeddings"] = max_pos
        if rope_type == "yarn" and scaling.get("factor") is None and max_pos:
            scaling["factor"] = max_pos / scaling["original_max_position_embeddings"]
    return float(theta), (scaling if rope_type != "default" else None)


def _sliding_window_from_config(config: dict[str, Any], model_type: str) -> int | None:
    """The window applied to every layer, None for full attention; mixed layers are refused."""
    if model_type == "mistral":
        return config.get("sliding_window", 4096)  # transformers' MistralConfig default
    if model_type == "llama":
        return None
    window = config.get("sliding_window", 4096) if config.get("use_sliding_window") else None
    layer_types = config.get("layer_types")
    if layer_types is not None and window is not None and model_type != "qwen3_moe":
        kinds = set(layer_types)
    elif window is None or model_type == "qwen3_moe":
        kinds = {"sliding_attention" if window else "full_attention"}
    else:
        first = config.get("max_window_layers", 28)
        n = config["num_hidden_layers"]
        kinds = {"sliding_attention" if i >= first else "full_attention" for i in range(n)}
    if kinds == {"full_attention"}:
        return None
    if kinds == {"sliding_attention"}:
        return window
    raise UnsupportedModelError(
        f"{model_type}: sliding-window attention on only some layers "
        f"(use_sliding_window with max_window_layers/layer_types) is not supported"
    )


def spec_from_hf_config(config: dict[str, Any]) -> ModelSpec:
    """Translate a Hugging Face ``config.json`` dict into a :class:`ModelSpec`.

    Reads configs written by transformers 4.x and 5.x. Missing optional keys take
    transformers' defaults for that model type. Raises :class:`UnsupportedModelError`
    naming the model type or feature that tunesmith cannot build faithfully.

    Example::

        >>> import json
        >>> spec = spec_from_hf_config(json.load(open("Qwen3-0.6B/config.json")))  # doctest: +SKIP
    """
    if not isinstance(config, dict):
        raise TypeError(f"config must be a dict (parsed config.json), got {type(config).__name__}")
    config = dict(config)
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    missing = [k for k in _REQUIRED_KEYS if k not in config]
    if missing:
        raise ValueError(f"config.json for {model_type!r} lacks required key(s): {missing}")
    if config.get("quantization_config"):
        method = config["quantization_config"].get("quant_method", "?")
        raise UnsupportedModelError(
            f"pre-quantized checkpoints (quantization_config.quant_method={method!r}) are not "
            "supported; load the unquantized weights"
        )
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModelError(f"hidden_act {act!r} is not supported (only 'silu')")

    heads = config["num_attention_heads"]
    default_head_dim = 128 if model_type == "qwen3" else config["hidden_size"] // heads
    head_dim = config.get("head_dim") or default_head_dim
    rope_theta, rope_scaling = _rope_from_config(config)
    is_qwen2 = model_type == "qwen2"
    num_experts = 0
    moe: dict[str, Any] = {}
    if model_type == "qwen3_moe":
        num_experts = config.get("num_experts", config.get("num_local_experts", 128))
        moe = {
            "num_experts_per_tok": config.get("num_experts_per_tok", 8),
            "moe_intermediate_size": config.get("moe_intermediate_size", 768),
            "norm_topk_prob": bool(config.get("norm_topk_prob", False)),
            "router_aux_loss_coef": config.get("router_aux_loss_coef", 0.001),
            "decoder_sparse_step": config.get("decoder_sparse_step", 1),
            "mlp_only_layers": tuple(config.get("mlp_only_layers") or ()),
        }
    default_max_pos = {"llama": 2048, "mistral": 131072}.get(model_type, 32768)
    default_tokens = {"llama": (1, 2), "mistral": (1, 2)}.get(model_type, (None, None))
    return ModelSpec(
        model_type=model_type,
        vocab_size=config["vocab_size"],
        hidden_size=config["hidden_size"],
        intermediate_size=config["intermediate_size"],
        num_hidden_layers=config["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=config.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        rms_norm_eps=config.get("rms_norm_eps", 1e-6),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=config.get("max_position_embeddings", default_max_pos),
        attention_bias=False if is_qwen2 else bool(config.get("attention_bias", False)),
        qkv_bias=is_qwen2,
        mlp_bias=bool(config.get("mlp_bias", False)) if model_type == "llama" else False,
        qk_norm=model_type in _QK_NORM_TYPES,
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        sliding_window=_sliding_window_from_config(config, model_type),
        num_experts=num_experts,
        initializer_range=config.get("initializer_range", 0.02),
        bos_token_id=config.get("bos_token_id", default_tokens[0]),
        eos_token_id=config.get("eos_token_id", default_tokens[1]),
        pad_token_id=config.get("pad_token_id"),
        torch_dtype=_dtype_name(config.get("torch_dtype", config.get("dtype"))),
        **moe,
    )


def _dtype_name(value: Any) -> str | None:
    if value is None:
        return None
    return str(value).removeprefix("torch.")
