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
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from tunesmith.models.family import (
    FLAG_FIELDS,
    OPTIONAL_KEYS,
    Family,
    UnsupportedModelError,
    families,
    family_for,
)
from tunesmith.models.fp8_weights import block_fp8_size
from tunesmith.models.key_renames import KeyRenames
from tunesmith.models.mxfp4_weights import is_mxfp4_config
from tunesmith.modules.decoder import NORM_LAYOUTS
from tunesmith.modules.feed_forward import ACTIVATIONS
from tunesmith.modules.gpt_oss_experts import ClampedExperts
from tunesmith.modules.logits import LogitTransform
from tunesmith.modules.mla import MLAConfig
from tunesmith.modules.norms import NORM_STYLES
from tunesmith.modules.routers import DeepSeekRouting

__all__ = [
    "SIZE_LIMITS",
    "SUPPORTED_MODEL_TYPES",  # noqa: F822 (module __getattr__, follows the family table)
    "ModelSpec",
    "UnsupportedModelError",
    "check_sizes",
    "layer_types_from_config",
    "layer_types_to_config",
    "partial_rotary_from_config",
    "spec_from_hf_config",
    "use_sliding_window_from_config",
    "use_sliding_window_to_config",
]

# RoPE variants implemented by tunesmith.modules.rope.
_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
_ROPE_KEYS: dict[str, tuple[str, ...]] = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings"),
    "longrope": ("short_factor", "long_factor", "original_max_position_embeddings"),
}


SIZE_LIMITS: dict[str, tuple[int, int]] = {
    "vocab_size": (1, 2**24),
    "hidden_size": (1, 2**17),
    "intermediate_size": (1, 2**19),
    "num_hidden_layers": (1, 1024),
    "num_attention_heads": (1, 2048),
    "num_key_value_heads": (1, 2048),
    "head_dim": (2, 4096),
    "max_position_embeddings": (1, 2**25),
    "sliding_window": (1, 2**25),
    "num_experts": (0, 4096),
    "num_experts_per_tok": (0, 4096),
    "moe_intermediate_size": (0, 2**19),
    "decoder_sparse_step": (1, 1024),
    "attention_chunk_size": (1, 2**25),
}
"""Sizes a spec (and a ``config.json``) may have: ``(lowest, highest)``, generous bounds that
no real model reaches (Llama 3.1 405B: 126 layers, hidden 16384, vocab 128256), so a hostile
or corrupt config fails before anything is allocated."""


def check_sizes(values: Mapping[str, Any], where: str = "") -> None:
    """Refuse a size in ``values`` (spec fields or ``config.json`` keys) that is not an
    integer within :data:`SIZE_LIMITS`; missing keys and ``None`` are skipped.

    Example::

        >>> check_sizes({"num_hidden_layers": 10_000_000})
        Traceback (most recent call last):
        ValueError: num_hidden_layers = 10000000 is over the limit 1024 (no real model is ...
    """
    for key, (low, high) in SIZE_LIMITS.items():
        value = values.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{where}{key} must be an integer, got {value!r}")
        if not low <= value <= high:
            side = "over the limit" if value > high else "under the minimum"
            raise ValueError(
                f"{where}{key} = {value} is {side} {high if value > high else low} "
                f"(no real model is that size; is the config corrupt?)"
            )
    layers = values.get("mlp_only_layers") or ()
    if isinstance(layers, (list, tuple)) and len(layers) > SIZE_LIMITS["num_hidden_layers"][1]:
        raise ValueError(f"{where}mlp_only_layers lists {len(layers)} layers, over the limit")


def __getattr__(name: str) -> Any:
    # SUPPORTED_MODEL_TYPES follows the family table, including families registered later.
    if name == "SUPPORTED_MODEL_TYPES":
        return tuple(sorted(f.model_type for f in families()))
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclass(frozen=True)
class ModelSpec:
    """Architecture of a decoder-only transformer LM (field names follow HF configs).

    Attention biases: ``attention_bias`` puts a bias on q, k, v *and* o (Llama's
    flag); ``qkv_bias`` puts one on q, k, v only (Qwen2). ``qk_norm`` adds an
    RMSNorm on q and k before RoPE, per head (Qwen3, Gemma 3) or, with
    ``qk_norm_per_head=False``, over the whole projection (OLMo 2). A layer ``i`` is a
    mixture-of-experts layer when :meth:`is_moe_layer` says so (Qwen3-MoE rule).

    What only some families have (each family file reads and writes its own keys):

    - ``layer_types``: per layer ``"sliding_attention"`` (window ``sliding_window``) or
      ``"full_attention"``; None means every layer slides when ``sliding_window`` is set.
      ``rope_local_theta``: the RoPE base of sliding layers (Gemma 3), None = ``rope_theta``.
      ``nope_layers``: layers without RoPE (SmolLM3). ``partial_rotary_factor``: the share of
      each head that RoPE rotates (:attr:`rotary_dim`); ``rope_interleaved``: rotate pairs
      of features instead of halves (GLM-4).
    - ``norm_layout`` (:data:`~tunesmith.modules.decoder.NORM_LAYOUTS`: ``pre``, ``sandwich``,
      ``post``) and ``norm_style`` (:data:`~tunesmith.modules.norms.NORM_STYLES`).
    - ``hidden_act``: the MLP gate's activation (SwiGLU ``silu``, GeGLU ``gelu_pytorch_tanh``).
    - ``attention_multiplier``: the softmax scale (None: ``head_dim ** -0.5``);
      ``attn_logit_softcapping``: a soft-cap on attention scores.
    - ``embedding_multiplier``, ``residual_multiplier``: scale the embeddings and each block's
      output; ``logits_scaling`` divides and ``final_logit_softcapping`` caps the logits
      (see :attr:`logit_transform`).
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
    # What only some families have (see the class docs).
    layer_types: tuple[str, ...] | None = None
    partial_rotary_factor: float = 1.0
    rope_interleaved: bool = False
    rope_local_theta: float | None = None
    nope_layers: tuple[int, ...] = ()
    norm_layout: str = "pre"
    norm_style: str = "plain"
    qk_norm_per_head: bool = True
    hidden_act: str = "silu"
    attention_multiplier: float | None = None
    attn_logit_softcapping: float | None = None
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    final_logit_softcapping: float | None = None
    # DeepSeek-V2/V3: multi-head latent attention and routing with shared experts (see
    # tunesmith.models.zoo.deepseek_v3); None for every other family.
    mla: MLAConfig | None = None
    moe_routing: DeepSeekRouting | None = None
    # Llama 4: chunked local attention on "chunked_attention" layers (see layer_types), a
    # weightless RMS ("L2") qk-norm on RoPE layers, attention temperature tuning on NoPE
    # layers (see tunesmith.models.zoo.llama4); off for every other family.
    attention_chunk_size: int | None = None
    qk_l2_norm: bool = False
    attn_temperature_tuning: bool = False
    floor_scale: float = 8192.0
    attn_scale: float = 0.1
    moe_router: str = "softmax"  # "llama4": Llama4MoE (sigmoid top-k, shared expert)
    # gpt-oss: attention sinks (a learned logit per head in the softmax denominator) and its
    # experts (see tunesmith.modules.gpt_oss_experts.ClampedExperts); off for other families.
    attention_sinks: bool = False
    clamped_experts: ClampedExperts | None = None
    # Initialisation and tokens (carried through to config.json).
    initializer_range: float = 0.02
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None
    torch_dtype: str | None = None

    def __post_init__(self) -> None:
        family_for(self.model_type)  # an unknown model_type fails here, listing the known
        check_sizes(dataclasses.asdict(self))
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
        object.__setattr__(self, "nope_layers", tuple(self.nope_layers))
        if self.layer_types is not None:
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
        if isinstance(self.eos_token_id, list):
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))
        self._check_family_fields()

    def _check_family_fields(self) -> None:
        for name, value, known in (
            ("hidden_act", self.hidden_act, ACTIVATIONS),
            ("norm_layout", self.norm_layout, NORM_LAYOUTS),
            ("norm_style", self.norm_style, NORM_STYLES),
        ):
            if value not in known:
                raise UnsupportedModelError(
                    f"{name} {value!r} is not supported; supported: {', '.join(known)}"
                )
        n = self.num_hidden_layers
        if self.layer_types is not None:
            if len(self.layer_types) != n:
                raise ValueError(
                    f"layer_types lists {len(self.layer_types)} layers, the model has {n}"
                )
            kinds = set(self.layer_types) - {
                "full_attention",
                "sliding_attention",
                "chunked_attention",
            }
            if kinds:
                raise UnsupportedModelError(
                    f"layer_types {sorted(kinds)} are not supported (full_attention, "
                    "sliding_attention)"
                )
            if "sliding_attention" in self.layer_types and self.sliding_window is None:
                raise ValueError("layer_types has sliding_attention layers but no sliding_window")
            if "chunked_attention" in self.layer_types and not self.attention_chunk_size:
                raise ValueError(
                    "layer_types has chunked_attention layers but no attention_chunk_size"
                )
        outside = [i for i in self.nope_layers if not (isinstance(i, int) and 0 <= i < n)]
        if outside:
            raise ValueError(f"nope_layers {outside} are not layers of a {n}-layer model")
        for name in ("embedding_multiplier", "residual_multiplier", "logits_scaling"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("attention_multiplier", "attn_logit_softcapping", "final_logit_softcapping"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0 or None, got {value!r}")
        if not 0 < self.partial_rotary_factor <= 1 or self.rotary_dim % 2:
            raise ValueError(
                f"partial_rotary_factor {self.partial_rotary_factor} must be in (0, 1] and "
                f"rotate an even number of features (head_dim {self.head_dim})"
            )
        if self.moe_router not in ("softmax", "llama4"):
            raise UnsupportedModelError(
                f"moe_router {self.moe_router!r} is not supported; supported: softmax, llama4"
            )
        if self.rope_local_theta is not None and not self.rope_local_theta > 0:
            raise ValueError(f"rope_local_theta must be > 0, got {self.rope_local_theta!r}")

    @property
    def rotary_dim(self) -> int:
        """The features of each head that RoPE rotates (``head_dim`` unless partial)."""
        return int(self.head_dim * self.partial_rotary_factor)

    def layer_attention_chunk(self, layer_idx: int) -> int | None:
        """The attention chunk of layer ``layer_idx`` (Llama 4's ``"chunked_attention"``
        layers: a query sees only the keys of its own ``attention_chunk_size`` positions), or
        None.

        Example::

            >>> from tunesmith.models import llama4
            >>> spec = llama4.spec("llama4_tiny")
            >>> spec.layer_attention_chunk(0), spec.layer_attention_chunk(2)
            (3, None)
        """
        if self.layer_types is not None and self.layer_types[layer_idx] == "chunked_attention":
            return self.attention_chunk_size
        return None

    def layer_sliding_window(self, layer_idx: int) -> int | None:
        """The window of layer ``layer_idx`` (None: full attention).

        Example::

            >>> from tunesmith.models import llama3
            >>> spec = llama3.spec("llama3_tiny").replace(
            ...     sliding_window=4, layer_types=("sliding_attention", "full_attention"))
            >>> spec.layer_sliding_window(0), spec.layer_sliding_window(1)
            (4, None)
        """
        if self.layer_types is None or self.layer_types[layer_idx] == "sliding_attention":
            return self.sliding_window
        return None

    @property
    def logit_transform(self) -> LogitTransform | None:
        """What the family does to ``lm_head``'s output (None: nothing)."""
        return LogitTransform.of(
            LogitTransform(1.0 / self.logits_scaling, self.final_logit_softcapping)
        )

    @property
    def fused_projections(self) -> Mapping[str, tuple[str, ...]]:
        """The projections this family's checkpoints store fused, by Hugging Face name, with
        the module names tunesmith keeps apart (``Family.fused``; Phi-3:
        ``{"qkv_proj": ("q_proj", "k_proj", "v_proj"), ...}``). ``apply_lora`` reads it (the
        model's ``spec``) to take those names as LoRA targets."""
        return family_for(self.model_type).fused

    @property
    def checkpoint_renames(self) -> KeyRenames:
        """How this family's files spell tensor names that differ from the modules'
        (``Family.renames``; empty for most families), see
        :mod:`~tunesmith.models.key_renames`."""
        return KeyRenames(family_for(self.model_type).renames)

    @property
    def is_moe(self) -> bool:
        """True when at least one layer is a mixture-of-experts layer."""
        return any(self.is_moe_layer(i) for i in range(self.num_hidden_layers))

    def approx_parameters(self) -> int:
        """About how many parameters the model has (weights of embeddings, attention, MLPs or
        experts and head; norms and biases left out): enough to tell whether it fits.

        Example::

            >>> from tunesmith.models import llama3
            >>> llama3.spec("llama3_2_1b").approx_parameters() // 10**8
            12
        """
        width, q, kv = self.hidden_size, self.num_attention_heads, self.num_key_value_heads
        attention = 2 * width * (q + kv) * self.head_dim
        if self.mla is not None:
            attention = self.mla.parameters(width, q)
        dense = 3 * width * self.intermediate_size
        experts = self.num_experts * (3 * width * self.moe_intermediate_size + width)
        if self.moe_routing is not None:  # shared experts beside the routed ones
            experts += 3 * width * self.moe_intermediate_size * self.moe_routing.n_shared_experts
        if self.moe_router == "llama4":  # its shared expert, as wide as a routed one
            experts += 3 * width * self.moe_intermediate_size
        layers = sum(
            experts if self.is_moe_layer(i) else dense for i in range(self.num_hidden_layers)
        )
        embeddings = self.vocab_size * width * (1 if self.tie_word_embeddings else 2)
        return embeddings + self.num_hidden_layers * attention + layers

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
        family = family_for(self.model_type)
        config: dict[str, Any] = {
            "architectures": [family.architecture],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": self.hidden_act,
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
        for name in FLAG_FIELDS:
            value = getattr(self, name)
            if name in family.flags:
                config[family.flag_key(name)] = value
            elif value != family.implied.get(name, False):
                raise UnsupportedModelError(_inexpressible(name, value, family))
        config.update(family.to_hf_config(self))
        # What only some families have must come back when the written config is read.
        back = {**_family_fields(config), **family.from_hf_config(config)}
        if self.sliding_window is not None and back.get("sliding_window") != self.sliding_window:
            raise UnsupportedModelError(f"{self.model_type} configs have no sliding window")
        if self.num_experts and back.get("num_experts") != self.num_experts:
            raise UnsupportedModelError(f"{self.model_type} has no mixture-of-experts layers")
        for name, default in _FAMILY_FIELDS.items():
            value = getattr(self, name)
            if back.get(name, default) != value:
                raise UnsupportedModelError(
                    f"{name}={value!r} cannot be expressed by model_type {self.model_type!r}"
                )
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
        classifier = family_for(self.model_type).classifier_architecture
        if classifier is None:
            warnings.warn(
                f"transformers has no sequence-classification class for {self.model_type}: "
                "this reward/value model's folder loads with tunesmith (reward_model_from_hf), "
                "not with transformers",
                stacklevel=2,
            )
        return {
            "architectures": [classifier] if classifier else [],
            "num_labels": num_labels,
            "id2label": {str(i): label for i, label in enumerate(labels)},
            "label2id": {label: i for i, label in enumerate(labels)},
        }


# ---------------------------------------------------------------------------------------------
# config.json -> ModelSpec
# ---------------------------------------------------------------------------------------------

_FAMILY_FIELDS: dict[str, Any] = {
    f.name: f.default
    for f in dataclasses.fields(ModelSpec)
    if f.name
    in (
        "layer_types",
        "partial_rotary_factor",
        "rope_interleaved",
        "rope_local_theta",
        "nope_layers",
        "norm_layout",
        "norm_style",
        "qk_norm_per_head",
        "attention_multiplier",
        "attn_logit_softcapping",
        "embedding_multiplier",
        "residual_multiplier",
        "logits_scaling",
        "final_logit_softcapping",
        "mla",
        "moe_routing",
        "attention_chunk_size",
        "qk_l2_norm",
        "attn_temperature_tuning",
        "floor_scale",
        "attn_scale",
        "moe_router",
    )
}
"""Spec fields only a family's own hooks read and write, with their defaults: a spec whose
value a family's config cannot carry back is refused when written."""
_FAMILY_FIELDS.update(attention_sinks=False, clamped_experts=None)  # gpt-oss


def _family_fields(config: dict[str, Any]) -> dict[str, Any]:
    """The fields of :data:`_FAMILY_FIELDS` the generic reader takes from a config (the
    sliding layers' RoPE base of per-layer-type ``rope_parameters``), before the family's own."""
    local = _rope_from_config(config)[2]
    return {} if local is None else {"rope_local_theta": local}


_REQUIRED_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
)


def _rope_from_config(config: dict[str, Any]) -> tuple[float, dict[str, Any] | None, float | None]:
    """(rope_theta, rope_scaling, rope_local_theta) from a 4.x (``rope_theta``/``rope_scaling``)
    or 5.x (``rope_parameters``) config; a scaling dict of type "default" becomes None.

    5.x per-layer-type parameters (``{"full_attention": {...}, "sliding_attention": {...}}``)
    give the full layers' RoPE and the sliding layers' base (``rope_local_theta``; None when
    both are the same plain RoPE), whose scaling must be plain."""
    params = config.get("rope_parameters") or {}
    local_theta = None
    if params and any(isinstance(v, dict) for v in params.values()):
        unknown = sorted(set(params) - {"full_attention", "sliding_attention"})
        if unknown:
            raise UnsupportedModelError(f"rope_parameters for layer types {unknown}")
        local = dict(params.get("sliding_attention") or {})
        params = dict(params.get("full_attention") or {})
        if local.get("rope_type", "default") != "default":
            raise UnsupportedModelError(
                f"a scaled RoPE on sliding layers (rope_type {local['rope_type']!r}) is "
                "not supported"
            )
        if local.get("rope_theta") is not None:
            local_theta = float(local["rope_theta"])
        config = {k: v for k, v in config.items() if k not in ("rope_scaling", "rope_parameters")}
        config["rope_parameters"] = params
    scaling = dict(config.get("rope_scaling") or params)
    theta = scaling.pop("rope_theta", None)
    if theta is None:
        theta = config.get("rope_theta", params.get("rope_theta", 10000.0))
    if "type" in scaling and "rope_type" not in scaling:  # very old configs
        scaling["rope_type"] = scaling.pop("type")
    scaling.pop("type", None)
    scaling.pop("partial_rotary_factor", None)  # read by the families that have it
    rope_type = scaling.get("rope_type", "default")
    if rope_type not in _ROPE_TYPES:
        raise UnsupportedModelError(
            f"rope_type {rope_type!r} is not supported; supported: {', '.join(_ROPE_TYPES)}"
        )
    if rope_type in ("llama3", "yarn", "longrope"):
        # transformers fills these in from max_position_embeddings when absent.
        max_pos = config.get("max_position_embeddings")
        if scaling.get("original_max_position_embeddings") is None:  # 4.x Phi-3: top level
            scaling["original_max_position_embeddings"] = (
                config.get("original_max_position_embeddings") or max_pos
            )
        if rope_type in ("yarn", "longrope") and scaling.get("factor") is None and max_pos:
            scaling["factor"] = max_pos / scaling["original_max_position_embeddings"]
    if local_theta == float(theta) and rope_type == "default":  # the same RoPE everywhere
        local_theta = None
    return float(theta), (scaling if rope_type != "default" else None), local_theta


def _inexpressible(name: str, value: Any, family: Family) -> str:
    able = [
        f.model_type for f in families() if name in f.flags or f.implied.get(name, False) == value
    ]
    hint = f" (model types that can: {', '.join(able)})" if able else ""
    return f"{name}={value} cannot be expressed by model_type {family.model_type!r}{hint}"


def use_sliding_window_from_config(config: Mapping[str, Any], *, per_layer: bool) -> dict[str, Any]:
    """``sliding_window`` and ``layer_types`` of a config in the ``use_sliding_window``
    convention (Qwen2/Qwen3): no window unless ``use_sliding_window``.

    With ``per_layer`` the config's ``layer_types``, else ``max_window_layers`` (the first
    sliding layer, transformers' default 28), decide which layers slide; without, every layer
    does. A family's ``from_hf_config`` returns it (or updates its own fields with it).

    Example::

        >>> use_sliding_window_from_config({"use_sliding_window": False}, per_layer=True)
        {'sliding_window': None, 'layer_types': None}
        >>> use_sliding_window_from_config({"use_sliding_window": True, "sliding_window": 4,
        ...     "max_window_layers": 1, "num_hidden_layers": 2}, per_layer=True)["layer_types"]
        ('full_attention', 'sliding_attention')
    """
    window = config.get("sliding_window", 4096) if config.get("use_sliding_window") else None
    if window is None or not per_layer:
        return {"sliding_window": window, "layer_types": None}
    first = config.get("max_window_layers", 28)

    def default(i: int) -> str:
        return "sliding_attention" if i >= first else "full_attention"

    return layer_types_from_config(config, window, default)


def use_sliding_window_to_config(spec: ModelSpec, *, per_layer: bool) -> dict[str, Any]:
    """The config.json keys of :func:`use_sliding_window_from_config` for ``spec``.

    Example::

        >>> from tunesmith.models import qwen3
        >>> use_sliding_window_to_config(qwen3.spec("qwen3_tiny"), per_layer=True)
        {'use_sliding_window': False, 'sliding_window': None, 'max_window_layers': 2}
    """
    keys: dict[str, Any] = {
        "use_sliding_window": spec.sliding_window is not None,
        "sliding_window": spec.sliding_window,
    }
    if per_layer:
        types = layer_types_to_config(spec)
        # Layers >= max_window_layers slide; transformers reads layer_types first.
        keys["max_window_layers"] = next(
            (i for i, kind in enumerate(types) if kind == "sliding_attention"), len(types)
        )
        if spec.layer_types is not None:
            keys["layer_types"] = types
    return keys


def layer_types_from_config(
    config: Mapping[str, Any], window: int | None, default: Callable[[int], str]
) -> dict[str, Any]:
    """``sliding_window`` and ``layer_types`` of a config that lists HF ``layer_types``
    (``"sliding_attention"`` / ``"full_attention"`` per layer), ``default(i)`` being layer
    ``i``'s type when it lists none. ``window`` None (or no sliding layer) means full attention
    everywhere; layer types are None when every layer is alike.

    Example::

        >>> alternate = lambda i: "sliding_attention" if i % 2 == 0 else "full_attention"
        >>> layer_types_from_config({"num_hidden_layers": 2}, 4, alternate)
        {'sliding_window': 4, 'layer_types': ('sliding_attention', 'full_attention')}
    """
    n = config["num_hidden_layers"]
    types = config.get("layer_types") or [default(i) for i in range(n)]
    if len(types) != n:
        raise ValueError(f"layer_types lists {len(types)} layers, num_hidden_layers is {n}")
    if window is None or "sliding_attention" not in types:
        return {"sliding_window": None, "layer_types": None}
    if set(types) == {"sliding_attention"}:
        return {"sliding_window": window, "layer_types": None}
    return {"sliding_window": window, "layer_types": tuple(types)}


def layer_types_to_config(spec: ModelSpec) -> list[str]:
    """HF ``layer_types`` of ``spec``: each layer's ``"sliding_attention"`` or
    ``"full_attention"``.

    Example::

        >>> from tunesmith.models import llama3
        >>> layer_types_to_config(llama3.spec("llama3_tiny"))
        ['full_attention', 'full_attention']
    """
    return [
        "full_attention" if spec.layer_sliding_window(i) is None else "sliding_attention"
        for i in range(spec.num_hidden_layers)
    ]


def spec_from_hf_config(config: dict[str, Any]) -> ModelSpec:
    """Translate a Hugging Face ``config.json`` dict into a :class:`ModelSpec`.

    Reads configs written by transformers 4.x and 5.x. The ``model_type`` picks the
    registered :class:`~tunesmith.models.family.Family`, whose ``defaults`` stand in for
    missing optional keys and whose hooks read what only it has. Raises
    :class:`UnsupportedModelError` naming the model type or feature that tunesmith cannot
    build faithfully.

    Example::

        >>> import json
        >>> from tunesmith.models import qwen3
        >>> with open("config.json", "w") as f:  # what a Qwen3 folder holds
        ...     json.dump(qwen3.spec("qwen3_tiny").to_hf_config(), f)
        >>> spec = spec_from_hf_config(json.load(open("config.json")))
        >>> spec == qwen3.spec("qwen3_tiny"), spec.qk_norm
        (True, True)
    """
    if not isinstance(config, dict):
        raise TypeError(f"config must be a dict (parsed config.json), got {type(config).__name__}")
    config = dict(config)
    family = family_for(config.get("model_type"))
    model_type = family.model_type
    if config["model_type"] in family.aliases:  # kept, so that a save writes it back
        model_type = config["model_type"]
    sizes = {k: v for k, v in family.defaults.items() if k not in OPTIONAL_KEYS}
    config = {**sizes, **config}  # transformers' defaults for sizes a config leaves out
    missing = [k for k in _REQUIRED_KEYS if k not in config]
    if missing:
        raise ValueError(f"config.json for {model_type!r} lacks required key(s): {missing}")
    check_sizes(config)  # before any hook or default reads a size
    dequantized = block_fp8_size(config) is not None or is_mxfp4_config(config)  # FP8, MXFP4
    if config.get("quantization_config") and not dequantized:
        method = config["quantization_config"].get("quant_method", "?")
        raise UnsupportedModelError(
            f"pre-quantized checkpoints (quantization_config.quant_method={method!r}) are not "
            "supported; load the unquantized weights"
        )
    act = config.get("hidden_act", "silu")
    if act not in ACTIVATIONS:
        raise UnsupportedModelError(
            f"hidden_act {act!r} is not supported; supported: {', '.join(ACTIVATIONS)}"
        )

    heads = config["num_attention_heads"]
    head_dim = (
        config.get("head_dim") or family.defaults.get("head_dim") or config["hidden_size"] // heads
    )
    rope_theta, rope_scaling, rope_local_theta = _rope_from_config(config)
    fields: dict[str, Any] = {
        "model_type": model_type,
        "vocab_size": config["vocab_size"],
        "hidden_size": config["hidden_size"],
        "intermediate_size": config["intermediate_size"],
        "num_hidden_layers": config["num_hidden_layers"],
        "num_attention_heads": heads,
        "num_key_value_heads": config.get("num_key_value_heads") or heads,
        "head_dim": head_dim,
        "rope_theta": rope_theta,
        "rope_scaling": rope_scaling,
        "tie_word_embeddings": bool(
            config.get("tie_word_embeddings", family.defaults.get("tie_word_embeddings", False))
        ),
        "torch_dtype": _dtype_name(config.get("torch_dtype", config.get("dtype"))),
        "hidden_act": act,
    }
    if rope_local_theta is not None:  # per-layer-type rope_parameters (the family may override)
        fields["rope_local_theta"] = rope_local_theta
    for key in OPTIONAL_KEYS:  # present > the family's default > ModelSpec's default
        if key in config:
            fields[key] = config[key]
        elif key in family.defaults:
            fields[key] = family.defaults[key]
    for name in FLAG_FIELDS:
        if name in family.flags:
            fields[name] = bool(config.get(family.flag_key(name), False))
        elif name in family.implied:
            fields[name] = family.implied[name]
    fields.update(family.from_hf_config(config))
    partial = partial_rotary_from_config(config)
    if partial != 1.0 and "partial_rotary_factor" not in fields:
        raise UnsupportedModelError(
            f"partial_rotary_factor={partial} is not supported for model_type {model_type!r}"
        )
    return ModelSpec(**fields)


def partial_rotary_from_config(config: Mapping[str, Any], default: float = 1.0) -> float:
    """The ``partial_rotary_factor`` of a config: at the top level (4.x) or in its
    ``rope_parameters`` / ``rope_scaling`` (5.x); ``default`` when absent.

    Example::

        >>> partial_rotary_from_config({"rope_parameters": {"partial_rotary_factor": 0.5}})
        0.5
    """
    for place in (config.get("rope_parameters"), config.get("rope_scaling")):
        if isinstance(place, Mapping) and place.get("partial_rotary_factor") is not None:
            return float(place["partial_rotary_factor"])
    value = config.get("partial_rotary_factor")
    return default if value is None else float(value)


def _dtype_name(value: Any) -> str | None:
    if value is None:
        return None
    return str(value).removeprefix("torch.")
