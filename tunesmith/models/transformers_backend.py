"""The transformers backend: any causal LM transformers builds, behind tunesmith's model protocol.

A folder whose ``model_type`` has no native family (or ``backend="transformers"``) is built with
transformers' own ``AutoModelForCausalLM`` (never remote code) and wrapped in a
:class:`TransformersLM`, which answers what the recipes ask of a model: ``forward(input_ids, *,
position_ids, document_ids, kv_cache, return_hidden_states, logits_to_keep,
output_router_logits)``, ``lm_head`` and ``logit_transform`` for the losses that own the head,
``init_kv_cache`` for generation, ``spec`` (a :class:`TransformersSpec`) for the sizes, and HF
parameter names (the wrapped model's own children are the wrapper's), so checkpoints and PEFT
adapters are written as transformers and peft read them.

What it cannot do is refused with the backend named (context and expert parallel, reward
models, packing on models with recurrent or convolution layers); tensor parallel follows the
model's own ``base_model_tp_plan`` where transformers defines one.

Example::

    >>> config = tiny_config("starcoder2")           # any model_type transformers knows
    >>> model = build_transformers_model(config)
    >>> model(torch.tensor([[1, 2, 3]])).shape
    torch.Size([1, 3, 128])
    >>> model.spec.backend, model.spec.model_type
    ('transformers', 'starcoder2')
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, get_args

import torch
from torch import nn

from tunesmith.models.family import UnsupportedModelError, families
from tunesmith.models.key_renames import KeyRenames
from tunesmith.models.safetensors_io import CheckpointError
from tunesmith.modules.decoder import mark_decoder_layers
from tunesmith.modules.logits import LogitTransform

logger = logging.getLogger(__name__)

__all__ = [
    "BACKENDS",
    "ATTENTION_IMPLEMENTATIONS",
    "BackendChoice",
    "TransformersCache",
    "TransformersLM",
    "TransformersSpec",
    "build_transformers_model",
    "choose_backend",
    "tiny_config",
    "transformers_from_hf",
]

Backend = Literal["auto", "native", "transformers"]
"""``from_hf(backend=)``: ``auto`` is native where a family exists, else transformers."""
BACKENDS: tuple[str, ...] = get_args(Backend)

ATTENTION_IMPLEMENTATIONS = {"auto": "sdpa", "sdpa": "sdpa", "eager": "eager",
                             "loop": "eager", "flex": "flex_attention"}  # fmt: skip
"""Our ``attention_backend`` names -> transformers' ``attn_implementation`` (the others,
``varlen`` and ``ring``, are native kernels)."""

_LOADING_PROBLEMS = ("missing_keys", "unexpected_keys", "mismatched_keys")
"""What transformers' loader tolerates (and reports) that a checkpoint may not have."""

_ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")
"""``config.layer_types`` entries that are attention (packing is per-document masking)."""

CANNOT = "no context parallel, no expert parallel, no reward-model head"
"""What the transformers backend cannot do, said once when it is chosen."""


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as err:  # an optional dependency
        raise ImportError(
            "the transformers backend needs transformers: pip install 'tunesmith[hf]'"
        ) from err
    return transformers


# -- which backend ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class BackendChoice:
    """The backend that builds a folder's model and why (``tunesmith validate`` prints it)."""

    backend: str
    reason: str

    def __str__(self) -> str:
        limits = f"; {CANNOT}" if self.backend == "transformers" else ""
        return f"{self.backend} backend ({self.reason}{limits})"


def choose_backend(
    config: Mapping[str, Any], backend: str = "auto", where: str = ""
) -> BackendChoice:
    """The backend for a ``config.json`` (``where`` names it in errors).

    Native wherever a family exists (unless ``backend="transformers"``), else transformers'
    built-in class for the ``model_type``. A folder that only its own code can build
    (``auto_map``, ``trust_remote_code``) is refused: tunesmith never runs a checkpoint's code.

    >>> choose_backend({"model_type": "qwen3"}).backend
    'native'
    >>> str(choose_backend({"model_type": "starcoder2"}))
    'transformers backend (starcoder2 has no native family; no context parallel, ...'
    >>> torchao = {"quant_method": "torchao"}
    >>> choose_backend({"model_type": "qwen3", "quantization_config": torchao}).reason
    'a torchao-quantized folder: transformers loads its quantized weights'
    >>> choose_backend({"model_type": "my_arch", "auto_map": {"AutoModelForCausalLM": "m.M"}})
    Traceback (most recent call last):
    tunesmith.models.family.UnsupportedModelError: model_type 'my_arch' needs the folder's own ...
    """
    if backend not in BACKENDS:
        raise ValueError(f"{where}backend {backend!r}: expected one of {list(BACKENDS)}")
    model_type = config.get("model_type")
    native = any(model_type in (f.model_type, *f.aliases) for f in families())
    quantized = (config.get("quantization_config") or {}).get("quant_method") == "torchao"
    if quantized and backend != "native":  # `tunesmith export --quantize`'s folders
        _transformers()
        return BackendChoice(
            "transformers", "a torchao-quantized folder: transformers loads its quantized weights"
        )
    if backend == "native" or (backend == "auto" and native):
        if not native:
            raise UnsupportedModelError(
                f"{where}model_type {model_type!r} has no native family; "
                "backend: auto or transformers builds it with transformers' own modules"
            )
        return BackendChoice("native", f"{model_type} is a native family")
    transformers = _transformers()
    if model_type not in transformers.CONFIG_MAPPING and config.get("auto_map"):
        raise UnsupportedModelError(
            f"{where}model_type {model_type!r} needs the folder's own code (its auto_map), "
            "which would run with trust_remote_code: tunesmith refuses remote code; it builds "
            "only native families and the model types transformers ships"
        )
    if model_type not in transformers.CONFIG_MAPPING:
        raise UnsupportedModelError(
            f"{where}model_type {model_type!r} is neither a native family nor a model type "
            f"of transformers {transformers.__version__}"
        )
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise UnsupportedModelError(
            f"{where}model_type {model_type!r} has no causal language model class in "
            f"transformers (AutoModelForCausalLM), which the transformers backend builds: "
            "tunesmith post-trains causal LMs"
        )
    why = "backend: transformers asked" if native else f"{model_type} has no native family"
    return BackendChoice("transformers", why)


# -- the spec --------------------------------------------------------------------------------

_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
          "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings")  # fmt: skip


@dataclasses.dataclass(frozen=True)
class TransformersSpec:
    """The sizes of a transformers-built model, read from its config (what the library asks
    of ``model.spec``), and the config itself, written back as ``config.json`` on save.

    >>> spec = TransformersSpec(tiny_config("starcoder2").to_dict())
    >>> spec.model_type, spec.vocab_size, spec.num_hidden_layers, spec.is_moe
    ('starcoder2', 128, 2, False)
    """

    config: dict[str, Any]
    sizes: dict[str, Any] = dataclasses.field(default_factory=dict)
    backend = "transformers"
    fused_projections: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    # transformers writes its own names: nothing to rename on save (see models/key_renames.py)
    checkpoint_renames = property(lambda self: KeyRenames({}))

    @classmethod
    def of(cls, config: Any) -> TransformersSpec:
        """The spec of a transformers config object: its dict, and the sizes under their usual
        names (GPT-2's ``n_layer`` is ``num_hidden_layers``: transformers' attribute map)."""
        text = config.get_text_config()
        sizes = {name: getattr(text, name, None) for name in _SIZES}
        return cls(_config_dict(config), {k: v for k, v in sizes.items() if v is not None})

    def _text(self, key: str, default: Any = None) -> Any:
        value = self.sizes.get(key)
        if value is None:
            value = self.config.get(key)
        if value is None:  # multimodal configs keep the language model's under text_config
            value = (self.config.get("text_config") or {}).get(key)
        return default if value is None else value

    model_type = property(lambda self: self.config["model_type"])
    name = property(lambda self: self.config["model_type"])
    vocab_size = property(lambda self: self._text("vocab_size"))
    hidden_size = property(lambda self: self._text("hidden_size"))
    intermediate_size = property(lambda self: self._text("intermediate_size"))
    num_hidden_layers = property(lambda self: self._text("num_hidden_layers"))
    num_attention_heads = property(lambda self: self._text("num_attention_heads"))
    num_key_value_heads = property(
        lambda self: self._text("num_key_value_heads", self._text("num_attention_heads"))
    )
    head_dim = property(
        lambda self: (
            self._text("head_dim")
            or self._text("hidden_size") // self._text("num_attention_heads", 1)
        )
    )
    max_position_embeddings = property(lambda self: self._text("max_position_embeddings"))
    tie_word_embeddings = property(lambda self: bool(self._text("tie_word_embeddings", False)))
    pad_token_id = property(lambda self: self._text("pad_token_id"))
    bos_token_id = property(lambda self: self._text("bos_token_id"))
    eos_token_id = property(lambda self: self._text("eos_token_id"))
    initializer_range = property(lambda self: self._text("initializer_range", 0.02))
    num_experts_per_tok = property(lambda self: self._text("num_experts_per_tok", 0))
    num_experts = property(
        lambda self: self._text("num_experts") or self._text("num_local_experts") or 0
    )
    router_aux_loss_coef = property(lambda self: self._text("router_aux_loss_coef", 0.0))

    @property
    def is_moe(self) -> bool:
        """Routed experts whose router logits the model returns (the auxiliary loss)."""
        return bool(self.num_experts and self.num_experts_per_tok)

    def replace(self, **changes: Any) -> TransformersSpec:
        """A copy with config keys changed (``spec.replace(pad_token_id=0)``)."""
        return dataclasses.replace(self, config={**self.config, **changes})

    def to_hf_config(self, num_labels: int | None = None) -> dict[str, Any]:
        """The ``config.json`` to write: the model's own config."""
        if num_labels is not None:
            raise UnsupportedModelError(
                f"{self.model_type}: the transformers backend has no reward-model head"
            )
        return dict(self.config)

    def reference_state(self) -> dict[str, torch.Tensor]:
        """Meta tensors named and shaped as this model's checkpoint holds them (a tied head
        stored once, as transformers saves it)."""
        state = self.checkpoint_layout(self._meta_model().state_dict())
        if self.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        return state

    def _meta_model(self) -> nn.Module:
        """transformers' model of this config on the meta device (built once per config)."""
        return _meta_model(json.dumps(self.config, sort_keys=True))

    def checkpoint_layout(self, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``state`` (the model's own names) as the model type's checkpoints store it:
        transformers 5 fuses some tensors on load (a MoE's per-expert ``w1``/``w3`` into
        ``experts.gate_up_proj``) and splits them back on save; so does this."""
        try:
            from transformers.core_model_loading import revert_weight_conversion
        except ImportError:  # transformers 4: the modules' names are the checkpoints'
            return dict(state)
        return revert_weight_conversion(self._meta_model(), dict(state))

    def runtime_layout(
        self, weights: Mapping[str, torch.Tensor], folder: str | os.PathLike
    ) -> dict[str, torch.Tensor]:
        """``weights`` read from checkpoint ``folder`` under the model's own names: as they
        are, or, for a model type transformers converts on load (a MoE's per-expert tensors),
        as transformers' loader converts that folder."""
        names = self._meta_model().state_dict()
        if set(self.checkpoint_layout(names)) == set(names):
            return dict(weights)
        return _load(folder, dtype="auto").state_dict()

    def approx_parameters(self) -> int:
        """The parameter count (built on the meta device: exact)."""
        return sum(p.numel() for p in self._meta_model().parameters())


# -- the model ---------------------------------------------------------------------------------


class TransformersCache:
    """The KV cache of a :class:`TransformersLM`: the cache object transformers' model
    creates on the first forward (a hybrid model's own kind included), kept between calls."""

    def __init__(self) -> None:
        self.past: Any = None

    @property
    def seq_len(self) -> int:
        return 0 if self.past is None else int(self.past.get_seq_length())

    def reset(self) -> None:
        self.past = None


def _logit_transform(config: Any) -> LogitTransform | None:
    """What the causal LM class does to its head's output, from the config keys transformers'
    models read (Cohere's ``logit_scale``, Granite's ``logits_scaling``, a final soft cap)."""
    scale = float(getattr(config, "logit_scale", None) or 1.0)
    scale /= float(getattr(config, "logits_scaling", None) or 1.0)
    cap = getattr(config, "final_logit_softcapping", None)
    return LogitTransform.of(LogitTransform(scale=scale, softcap=cap))


def _layers_of(decoder: nn.Module, count: int, model_type: str) -> nn.ModuleList:
    """The decoder's list of ``count`` layers (``layers``, ``h``, ``blocks``, ...)."""
    lists = [m for m in decoder.children() if isinstance(m, nn.ModuleList) and len(m) == count]
    if len(lists) != 1:
        raise UnsupportedModelError(
            f"{model_type}: found {len(lists)} lists of {count} decoder layers in "
            f"{type(decoder).__name__}, expected one"
        )
    return lists[0]


def _drop_tied_head(
    module: TransformersLM, state_dict: dict[str, Any], prefix: str, local_metadata: Any
) -> None:
    """state_dict post-hook: a tied ``lm_head.weight`` is not listed (stored once, as
    transformers saves it; :func:`_fill_tied_head` gives it back on load)."""
    if module.spec.tie_word_embeddings:
        state_dict.pop(prefix + "lm_head.weight", None)


def _fill_tied_head(
    module: TransformersLM, state_dict: dict[str, Any], prefix: str, *args: Any
) -> None:
    """load_state_dict pre-hook: a tied head takes the embedding's values, present or not."""
    if module.spec.tie_word_embeddings:
        embed = module.hf_model.get_input_embeddings().weight
        name = next(n for n, p in module.named_parameters(remove_duplicate=False) if p is embed)
        if prefix + name in state_dict:
            state_dict[prefix + "lm_head.weight"] = state_dict[prefix + name]


class TransformersLM(nn.Module):
    """A transformers ``*ForCausalLM`` behind the forward of
    :class:`~tunesmith.modules.decoder.TransformerLM` (see that class for the arguments).

    The wrapped model's children (``model``, ``lm_head``, ...) are this module's, so
    parameter names are transformers' own. The decoder runs transformers' forward; the head is
    applied here (``lm_head`` then ``logit_transform``), so a loss that owns the head gets the
    hidden states (``return_hidden_states=True``) and never the full logits. Packed rows
    (``document_ids``) attend within their documents through the position ids, which restart
    at each document (transformers masks them so); models with recurrent or convolution
    layers refuse them.

    Example::

        >>> model = build_transformers_model(tiny_config("starcoder2"))
        >>> [n for n, _ in model.named_parameters()][:2]
        ['model.embed_tokens.weight', 'model.layers.0.self_attn.q_proj.weight']
    """

    def __init__(self, hf_model: nn.Module, spec: TransformersSpec) -> None:
        super().__init__()
        for name, child in hf_model.named_children():
            self.add_module(name, child)
        if list(hf_model.named_parameters(recurse=False)):
            raise UnsupportedModelError(f"{spec.model_type}: parameters outside its submodules")
        object.__setattr__(self, "hf_model", hf_model)  # not a child: its children are ours
        self.spec = spec
        self.logit_transform = _logit_transform(hf_model.config)
        self._decoder_name = hf_model.base_model_prefix
        self.layers = _layers_of(self.decoder, spec.num_hidden_layers, spec.model_type)
        types = spec.config.get("layer_types") or ()
        # Whether every layer is attention, which transformers masks per document from the
        # position ids (a recurrent or convolution layer would run across documents).
        self.accepts_packing = not getattr(hf_model, "_is_stateful", False) and all(
            t in _ATTENTION_LAYER_TYPES for t in types
        )
        params = inspect.signature(self.decoder.forward).parameters  # transformers 5: "cache"
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        mark_decoder_layers(self.layers)
        self.register_state_dict_post_hook(_drop_tied_head)
        self.register_load_state_dict_pre_hook(_fill_tied_head)
        if not any(p.is_meta for p in self.parameters()):
            self.check_head()

    # A list of this module's own children would be registered twice: keep the layers aside.
    def __setattr__(self, name: str, value: Any) -> None:
        if name == "layers":
            object.__setattr__(self, name, value)
        else:
            super().__setattr__(name, value)

    @property
    def decoder(self) -> nn.Module:
        """transformers' base model (``model``, ``transformer``, ...): embeddings, layers, norm."""
        return getattr(self, self._decoder_name)

    @property
    def lm_head(self) -> nn.Module:
        return self.hf_model.get_output_embeddings()

    @property
    def attention_backend(self) -> str:
        return self.hf_model.config._attn_implementation

    @attention_backend.setter
    def attention_backend(self, name: str) -> None:
        if name not in ATTENTION_IMPLEMENTATIONS:
            raise ValueError(
                f"attention_backend {name!r}: the transformers backend ({self.spec.model_type}) "
                f"takes one of {sorted(ATTENTION_IMPLEMENTATIONS)}"
            )
        self.hf_model.set_attn_implementation(ATTENTION_IMPLEMENTATIONS[name])

    def forward(
        self,
        input_ids: torch.Tensor,
        *,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        kv_cache: TransformersCache | None = None,
        output_router_logits: bool = False,
        return_hidden_states: bool = False,
        logits_to_keep: int = 0,
        cp_index: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        if cp_index is not None:
            raise ValueError(
                f"{self.spec.model_type}: the transformers backend has no context parallel"
            )
        if logits_to_keep < 0:
            raise ValueError(f"logits_to_keep must be >= 0, got {logits_to_keep}")
        if document_ids is not None:
            self._check_packed(input_ids, position_ids, attention_mask, kv_cache)
        if position_ids is not None and position_ids.dim() == 1:
            position_ids = position_ids[None]
        kwargs: dict[str, Any] = {}
        if output_router_logits:
            kwargs["output_router_logits"] = True
        if kv_cache is not None:
            kwargs[self._cache_kwarg] = kv_cache.past
        out = self.decoder(
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=attention_mask,
            use_cache=kv_cache is not None,
            **kwargs,
        )
        if kv_cache is not None:
            kv_cache.past = out[self._cache_kwarg]
        hidden = out.last_hidden_state
        if return_hidden_states:
            result = hidden
        else:
            result = self._logits(hidden[:, -logits_to_keep:] if logits_to_keep else hidden)
        if output_router_logits:
            return result, tuple(getattr(out, "router_logits", None) or ())
        return result

    def _check_packed(self, input_ids, position_ids, attention_mask, kv_cache) -> None:
        if not self.accepts_packing:
            raise ValueError(
                f"{self.spec.model_type} (transformers backend) has layers that are not "
                "attention, which would run across the documents of a packed row: set "
                "packed: false"
            )
        if position_ids is None or attention_mask is not None or kv_cache is not None:
            raise ValueError(
                "document_ids (packed rows) needs the position ids that restart at each "
                "document, and takes no attention_mask or kv_cache"
            )

    @torch.no_grad()
    def check_head(self, tokens: int = 8) -> None:
        """Refuse a model whose causal LM class does more to the head's output than
        :attr:`logit_transform` says: the losses that own the head (linear cross-entropy,
        token log-probs, KD) would train on other logits than its forward's. Runs ``tokens``
        tokens through both, once, at construction."""
        ids = torch.arange(1, 1 + min(tokens, self.spec.vocab_size - 1))[None]
        ids = ids.to(self.hf_model.get_input_embeddings().weight.device)
        was_training = self.hf_model.training
        self.hf_model.eval()
        try:
            theirs = self.hf_model(input_ids=ids).logits.float()
            ours = self(ids).float()
        finally:
            self.hf_model.train(was_training)
        gap = (theirs - ours).abs().max().item()
        if not gap <= 1e-3 * (1.0 + theirs.abs().max().item()):
            raise UnsupportedModelError(
                f"{self.spec.model_type} ({type(self.hf_model).__name__}): its forward's logits "
                f"differ from lm_head(hidden) with {self.logit_transform} by {gap:.3g}; the "
                "transformers backend knows no other change to the logits, so it cannot train "
                "this model with the losses that own the head"
            )

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        return logits if self.logit_transform is None else self.logit_transform(logits)

    def init_kv_cache(
        self, batch_size: int, max_seq_len: int, *, dtype: Any = None, device: Any = None
    ) -> TransformersCache:
        """An empty cache; transformers' model makes its own kind on the first forward."""
        return TransformersCache()

    def tie_weights(self) -> None:
        if self.spec.tie_word_embeddings:
            self.hf_model.tie_weights()

    @torch.no_grad()
    def init_weights(self, std: float | None = None) -> None:
        """Initialise as transformers does (its ``init_weights``)."""
        self.hf_model.init_weights()

    def _apply(self, fn: Any, recurse: bool = True) -> TransformersLM:
        super()._apply(fn, recurse)
        self.tie_weights()
        return self


# -- building ------------------------------------------------------------------------------------


def _build(config: Any, *, device: torch.device | str = "cpu", dtype: torch.dtype | None = None):
    """transformers' causal LM of ``config`` (a config object or its dict), random weights."""
    transformers = _transformers()
    if isinstance(config, Mapping):
        config = transformers.AutoConfig.for_model(**dict(config))
    with torch.device(device):
        return transformers.AutoModelForCausalLM.from_config(
            config, dtype=dtype, attn_implementation="sdpa", trust_remote_code=False
        )


@functools.lru_cache(maxsize=4)
def _meta_model(config_json: str) -> nn.Module:
    return _build(json.loads(config_json), device="meta")


def build_transformers_model(
    config: Any, *, device: torch.device | str = "cpu", dtype: torch.dtype | None = None
) -> TransformersLM:
    """A randomly initialised :class:`TransformersLM` of a transformers config (or its dict).

    >>> model = build_transformers_model(tiny_config("lfm2", layer_types=["conv", "full_attention"]))
    >>> model.accepts_packing  # convolution layers: no packed rows
    False
    """
    hf_model = _build(config, device=device, dtype=dtype)
    return TransformersLM(hf_model, TransformersSpec.of(hf_model.config))


def _config_dict(config: Any) -> dict[str, Any]:
    out = config.to_dict()
    out.pop("dtype", None)
    out.pop("torch_dtype", None)
    out.pop("transformers_version", None)
    return out


def transformers_from_hf(
    path: str | os.PathLike,
    *,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    load_weights: bool = True,
) -> TransformersLM:
    """The model of HF folder ``path`` built and loaded by transformers (no remote code)."""
    transformers = _transformers()
    folder = Path(path)
    if not load_weights:
        config = transformers.AutoConfig.from_pretrained(folder, trust_remote_code=False)
        return build_transformers_model(config, device=device, dtype=dtype)
    hf_model = _load(folder, dtype=dtype).to(device)
    return TransformersLM(hf_model, TransformersSpec.of(hf_model.config))


def _load(folder: str | os.PathLike, dtype: torch.dtype | str) -> nn.Module:
    """transformers' causal LM of ``folder``, loaded by transformers (no remote code)."""
    transformers = _transformers()
    bars = transformers.utils.logging
    shown = bars.is_progress_bar_enabled()
    bars.disable_progress_bar()  # a bar per load would flood the logs of every rank
    try:
        model, info = transformers.AutoModelForCausalLM.from_pretrained(
            folder,
            dtype=dtype,
            attn_implementation="sdpa",
            trust_remote_code=False,
            output_loading_info=True,
        )
    finally:
        if shown:
            bars.enable_progress_bar()
    problems = {kind: sorted(info.get(kind) or ()) for kind in _LOADING_PROBLEMS}
    problems = {kind: names for kind, names in problems.items() if names}
    if problems:  # transformers would draw the missing tensors at random: nothing is guessed
        said = "; ".join(f"{kind} {names[:5]}" for kind, names in problems.items())
        raise CheckpointError(
            f"{Path(folder)}: the weights do not match its config's {model.config.model_type} "
            f"model: {said}"
        )
    return model


def tiny_config(model_type: str, **overrides: Any) -> Any:
    """A small random-weights config of a transformers ``model_type`` (for tests and docs):
    vocabulary 128, hidden 32, two layers of four heads (two kv heads).

    >>> tiny_config("cohere2").num_hidden_layers
    2
    """
    sizes = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                 bos_token_id=1, eos_token_id=2, pad_token_id=0)  # fmt: skip
    return _transformers().AutoConfig.for_model(model_type, **{**sizes, **overrides})
