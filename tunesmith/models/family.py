"""Model families as data: one :class:`Family` entry per HF ``model_type``, in one table.

A family file declares its entry once with :func:`register_family`; ``spec.py`` (config.json
<-> :class:`~tunesmith.models.spec.ModelSpec`) and ``from_hf`` look families up here by
``model_type`` and never name one. What every family shares (sizes, heads, RoPE, tokens ...)
is translated generically; an entry holds only what differs:

- ``implied``: spec fields the ``model_type`` itself means (Qwen3: ``{"qk_norm": True}``);
- ``flags``: boolean spec fields its config.json carries as keys (Llama: ``attention_bias``);
- ``defaults``: transformers' values for keys a config.json may omit;
- ``from_hf_config`` / ``to_hf_config``: code for real differences (sliding window, experts).

Example::

    >>> from tunesmith.models.family import Family, family_for, register_family, unregister_family
    >>> family_for("qwen3").architecture
    'Qwen3ForCausalLM'
    >>> toy = register_family(Family("toy", "toy", "LlamaForCausalLM"))
    >>> family_for("toy") is toy
    True
    >>> unregister_family("toy") is toy  # a family file registers for good; an example cleans up
    True
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tunesmith.models.spec import ModelSpec

__all__ = [
    "FLAG_FIELDS",
    "OPTIONAL_KEYS",
    "Family",
    "UnsupportedModelError",
    "families",
    "family_for",
    "language_model_config",
    "register_family",
    "unregister_family",
]

FLAG_FIELDS: tuple[str, ...] = ("qkv_bias", "qk_norm", "attention_bias", "mlp_bias")
"""Boolean spec switches a config.json either carries as a key (``flags``) or means by its
``model_type`` (``implied``); any other family must leave them False."""

OPTIONAL_KEYS: tuple[str, ...] = (
    "rms_norm_eps",
    "max_position_embeddings",
    "initializer_range",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
)
"""config.json keys read as they are when present, else from ``Family.defaults``, else the
:class:`ModelSpec` default. ``head_dim`` may also be defaulted (else width / heads)."""


DEFAULTABLE_KEYS: tuple[str, ...] = (
    *OPTIONAL_KEYS,
    "head_dim",
    "tie_word_embeddings",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
)
"""Keys a family may give transformers' defaults for (``Family.defaults``): the optional ones,
and the sizes, which a multimodal config's ``text_config`` often leaves at transformers'
defaults (Gemma 3 4B's names neither its vocabulary nor its heads)."""


class UnsupportedModelError(ValueError):
    """A config asks for a model type or feature tunesmith does not implement."""


def _no_fields(config: Mapping[str, Any]) -> dict[str, Any]:
    return {}


def _no_keys(spec: ModelSpec) -> dict[str, Any]:
    return {}


@dataclass(frozen=True)
class Family:
    """One model family: its HF ``model_type`` and how its config.json differs from the rest.

    Args:
        name: tunesmith's name for it (the family file, e.g. ``"qwen2_5"``).
        model_type: the ``model_type`` of its HF ``config.json`` (e.g. ``"qwen2"``).
        architecture: the transformers causal-LM class (``"Qwen2ForCausalLM"``); the reward
            model class is the same with ``ForSequenceClassification``.
        implied: spec fields every config of this type means (``{"qkv_bias": True}``).
        flags: names in :data:`FLAG_FIELDS` the config.json carries as keys of the same name,
            or of the name ``flag_keys`` gives (GLM-4.5: ``{"qkv_bias": "attention_bias"}``).
        defaults: transformers' values for keys in :data:`OPTIONAL_KEYS` (or ``head_dim``,
            ``tie_word_embeddings``) when a config.json omits them.
        from_hf_config: config.json dict -> further spec fields (sliding window, experts).
        to_hf_config: spec -> further config.json keys; it may raise
            :class:`UnsupportedModelError` for what it cannot write. A spec with a sliding
            window (experts) is refused unless ``from_hf_config`` reads the written config
            back to the same ``sliding_window`` (``num_experts``).
        template: its chat template: a shipped name (``tunesmith/data/templates/<name>.jinja``)
            or the path of a ``.jinja`` file; None when the family ships none.
        multimodal_types: ``model_type``s of multimodal configs whose ``text_config`` is this
            family's language model (``gemma3`` for ``gemma3_text``): tunesmith loads that
            model and leaves the other towers out (see :func:`language_model_config`).
        classifier: the transformers ``*ForSequenceClassification`` class when it is not the
            causal-LM class renamed (Gemma 3: ``Gemma3TextForSequenceClassification``);
            ``has_classifier`` False when transformers has none (Granite).
        fused: projections its checkpoints store fused, by HF module name, with the module
            names tunesmith keeps apart, in row order (Phi-3:
            ``{"qkv_proj": ("q_proj", "k_proj", "v_proj")}``); see
            :mod:`~tunesmith.models.fused_keys`.
        renames: pieces of tensor names its files spell differently from the modules (ours ->
            the file's, ``{i}`` an index; Mixtral: ``{".mlp.gate.": ".block_sparse_moe.gate."}``),
            renamed on load and save; see :mod:`~tunesmith.models.key_renames`.
        renames_in_peft: transformers' modules carry the files' names too (Llama 4's
            ``feed_forward``), so PEFT folders are renamed as well (else they keep ours).
        aliases: other ``model_type``s whose config.json is this family's (Kimi K2's
            ``kimi_k2``, a ``DeepseekV3ForCausalLM``): read as this family, the spec keeping
            the folder's ``model_type``, so a save writes it back.

    Example::

        >>> Family("toy", "toy", "ToyForCausalLM", flags=("attention_bias",),
        ...        defaults={"max_position_embeddings": 2048}).flags
        ('attention_bias',)
    """

    name: str
    model_type: str
    architecture: str
    implied: Mapping[str, Any] = field(default_factory=dict)
    flags: tuple[str, ...] = ()
    flag_keys: Mapping[str, str] = field(default_factory=dict)
    defaults: Mapping[str, Any] = field(default_factory=dict)
    from_hf_config: Callable[[Mapping[str, Any]], dict[str, Any]] = _no_fields
    to_hf_config: Callable[[ModelSpec], dict[str, Any]] = _no_keys
    template: str | None = None
    fused: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    renames: Mapping[str, str] = field(default_factory=dict)
    renames_in_peft: bool = False
    aliases: tuple[str, ...] = ()
    multimodal_types: tuple[str, ...] = ()
    classifier: str | None = None
    has_classifier: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "flags", tuple(self.flags))
        object.__setattr__(self, "aliases", tuple(self.aliases))
        unknown = [f for f in self.flags if f not in FLAG_FIELDS]
        if unknown:
            raise ValueError(f"family {self.name!r}: flags {unknown} not in {FLAG_FIELDS}")
        unread = sorted(set(self.flag_keys) - set(self.flags))
        if unread:
            raise ValueError(f"family {self.name!r}: flag_keys {unread} are not flags")
        both = sorted(set(self.flags) & set(self.implied))
        if both:
            raise ValueError(f"family {self.name!r}: {both} both implied and read as flags")
        short = [name for name, parts in self.fused.items() if len(tuple(parts)) < 2]
        if short:
            raise ValueError(f"family {self.name!r}: fused {short} must name two parts or more")
        bad = [k for k in self.defaults if k not in DEFAULTABLE_KEYS]
        if bad:
            raise ValueError(f"family {self.name!r}: defaults for {bad} are not read")

    def flag_key(self, name: str) -> str:
        """The config.json key of flag ``name`` (its own name unless ``flag_keys`` renames it).

        Example::

            >>> family_for("glm4_moe").flag_key("qkv_bias"), family_for("llama").flag_key("mlp_bias")
            ('attention_bias', 'mlp_bias')
        """
        return self.flag_keys.get(name, name)

    @property
    def classifier_architecture(self) -> str | None:
        """The transformers reward-model (``*ForSequenceClassification``) class:
        ``classifier``, else the causal-LM class renamed; None for a family transformers gives
        none (its reward models load with tunesmith only).

        Example::

            >>> family_for("qwen3").classifier_architecture
            'Qwen3ForSequenceClassification'
            >>> family_for("gemma3_text").classifier_architecture
            'Gemma3TextForSequenceClassification'
            >>> family_for("granite").classifier_architecture is None
            True
        """
        if not self.has_classifier:
            return None
        return self.classifier or self.architecture.replace(
            "ForCausalLM", "ForSequenceClassification"
        )


# model_type -> Family, in registration order (the order of imports in tunesmith.models).
_FAMILIES: dict[str, Family] = {}


def register_family(family: Family) -> Family:
    """Add ``family`` to the table and return it; a name or ``model_type`` already there is refused.

    Example::

        >>> FAMILY = register_family(Family("toy", "toy", "LlamaForCausalLM"))
        >>> register_family(Family("toy", "toy", "LlamaForCausalLM"))
        Traceback (most recent call last):
        ValueError: family 'toy' (model_type 'toy') clashes with the registered family 'toy' ...
        >>> _ = unregister_family("toy")
    """
    if not isinstance(family, Family):
        raise TypeError(f"register_family expects a Family, got {type(family).__name__}")
    for other in _FAMILIES.values():
        wraps = set(other.multimodal_types) & {family.model_type, *family.multimodal_types}
        named = {other.model_type, *other.aliases} & {family.model_type, *family.aliases}
        if named or other.name == family.name or wraps:
            raise ValueError(
                f"family {family.name!r} (model_type {family.model_type!r}) clashes with the "
                f"registered family {other.name!r} (model_type {other.model_type!r})"
            )
    _FAMILIES[family.model_type] = family
    return family


def unregister_family(model_type: str) -> Family:
    """Remove and return the family of ``model_type`` (tests, or to replace a shipped one)."""
    return _FAMILIES.pop(family_for(model_type).model_type)


def families() -> tuple[Family, ...]:
    """Every registered family, in registration order."""
    return tuple(_FAMILIES.values())


def family_for(model_type: Any) -> Family:
    """The family of a config.json ``model_type``; :class:`UnsupportedModelError` lists the known.

    Example::

        >>> family_for("llama").name, family_for("kimi_k2").name  # a model_type or an alias
        ('llama3', 'deepseek_v3')
    """
    family = _FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if family is None:
        family = next((f for f in _FAMILIES.values() if model_type in f.aliases), None)
    if family is None:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported; supported: {', '.join(sorted(_FAMILIES))}"
        )
    return family


def language_model_config(config: Mapping[str, Any]) -> tuple[dict[str, Any], str | None]:
    """The config of the language model a config.json describes, and a note when that is not
    the whole model: a multimodal ``model_type`` some family lists in ``multimodal_types``
    gives its ``text_config`` (as that family's ``model_type``); any other config is its own.

    Example::

        >>> text, note = language_model_config(
        ...     {"model_type": "gemma3", "text_config": {"hidden_size": 8}})
        >>> text["model_type"], note
        ('gemma3_text', 'a multimodal gemma3 model: tunesmith loads its language model (gemma3_text) and leaves the other towers out')
    """
    model_type = config.get("model_type")
    for family in _FAMILIES.values():
        if model_type in family.multimodal_types:
            text = dict(config.get("text_config") or {})
            text.setdefault("model_type", family.model_type)
            if text["model_type"] != family.model_type:
                raise UnsupportedModelError(
                    f"{model_type}: text_config.model_type {text['model_type']!r} is not "
                    f"{family.model_type!r}"
                )
            for key in ("torch_dtype", "dtype", "tie_word_embeddings"):
                if key in config and key not in text:
                    text[key] = config[key]
            note = (
                f"a multimodal {model_type} model: tunesmith loads its language model "
                f"({family.model_type}) and leaves the other towers out"
            )
            return text, note
    return dict(config), None
