"""Build a :class:`~tunesmith.modules.TransformerLM` from a :class:`ModelSpec`."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from tunesmith.config.registry import component
from tunesmith.models.spec import ModelSpec, UnsupportedModelError
from tunesmith.modules.attention import Attention
from tunesmith.modules.decoder import DecoderLayer, DecoderModel, TransformerLM
from tunesmith.modules.feed_forward import FeedForward
from tunesmith.modules.gpt_oss_experts import gpt_oss_experts
from tunesmith.modules.llama4 import AttentionTemperature, L2Norm, Llama4MoE
from tunesmith.modules.mla import MultiHeadLatentAttention, mla_softmax_scale
from tunesmith.modules.moe import MoE
from tunesmith.modules.norms import RMSNorm
from tunesmith.modules.rope import RotaryEmbedding
from tunesmith.modules.routers import DeepSeekMoE

__all__ = ["build_model", "family_spec", "size_builder"]


def build_model(
    spec: ModelSpec,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> TransformerLM:
    """Build the model described by ``spec``.

    The modules are created on the meta device (instant, no memory). With
    ``device="meta"`` the model is returned as is, for sharding or for loading
    weights by assignment later; otherwise it is materialised on ``device``
    (default CPU) and initialised like transformers (``N(0, initializer_range)``
    for linears and embeddings, ones for norms).

    Example::

        >>> from tunesmith.models import qwen3
        >>> model = build_model(qwen3.spec("qwen3_0_6b"), device="meta")  # real size, instant
        >>> model.lm_head.weight is model.model.embed_tokens.weight
        True
    """
    if not isinstance(spec, ModelSpec):
        raise TypeError(f"build_model expects a ModelSpec, got {type(spec).__name__}")
    if dtype is not None and not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating point dtype, got {dtype}")
    with torch.device("meta"), _default_dtype(dtype), _no_default_init():
        model = _assemble(spec)
    target = torch.device("cpu" if device is None else device)
    if target.type != "meta":
        model.to_empty(device=target)
        model.init_weights()
    return model


def _assemble(spec: ModelSpec) -> TransformerLM:
    layers = [
        DecoderLayer(
            Attention(
                spec.hidden_size,
                spec.num_attention_heads,
                spec.num_key_value_heads,
                spec.head_dim,
                qkv_bias=spec.attention_bias or spec.qkv_bias,
                o_bias=spec.attention_bias,
                qk_norm=spec.qk_norm,
                qk_norm_per_head=spec.qk_norm_per_head,
                norm_eps=spec.rms_norm_eps,
                norm_style=spec.norm_style,
                scale=spec.attention_multiplier,
                softcap=spec.attn_logit_softcapping,
                rope=i not in spec.nope_layers,
                rope_interleaved=spec.rope_interleaved,
                sinks=spec.attention_sinks,
            )
            if spec.mla is None
            else _latent_attention(spec),
            _mlp(spec, i),
            spec.hidden_size,
            spec.rms_norm_eps,
            norm_layout=spec.norm_layout,
            norm_style=spec.norm_style,
            residual_multiplier=spec.residual_multiplier,
            sliding_window=spec.layer_sliding_window(i),
            attention_chunk_size=spec.layer_attention_chunk(i),
        )
        for i in range(spec.num_hidden_layers)
    ]
    _llama4_attention(layers, spec)
    local_rope = None
    if spec.rope_local_theta is not None:
        local_rope = RotaryEmbedding(
            spec.rotary_dim, spec.rope_local_theta, interleaved=spec.rope_interleaved
        )
    decoder = DecoderModel(
        nn.Embedding(spec.vocab_size, spec.hidden_size),
        layers,
        RMSNorm(spec.hidden_size, eps=spec.rms_norm_eps, style=spec.norm_style),
        RotaryEmbedding(
            spec.rotary_dim, spec.rope_theta, spec.rope_scaling, interleaved=spec.rope_interleaved
        ),
        rotary_emb_local=local_rope,
        embedding_multiplier=spec.embedding_multiplier,
    )
    return TransformerLM(
        decoder,
        tie_word_embeddings=spec.tie_word_embeddings,
        initializer_range=spec.initializer_range,
        logit_transform=spec.logit_transform,
        spec=spec,
    )


def _latent_attention(spec: ModelSpec) -> MultiHeadLatentAttention:
    """DeepSeek's multi-head latent attention (``spec.mla``)."""
    return MultiHeadLatentAttention(
        spec.hidden_size,
        spec.num_attention_heads,
        spec.mla,
        bias=spec.attention_bias,
        scale=mla_softmax_scale(spec.mla, spec.rope_scaling),
        rope_interleaved=spec.rope_interleaved,
    )


def _llama4_attention(layers: list[DecoderLayer], spec: ModelSpec) -> None:
    """Llama 4's weightless qk-norm on RoPE layers and temperature on NoPE layers."""
    for i, layer in enumerate(layers):
        attn = layer.self_attn
        if spec.qk_l2_norm and i not in spec.nope_layers:
            attn.q_norm = attn.k_norm = L2Norm(spec.rms_norm_eps)
        if spec.attn_temperature_tuning and i in spec.nope_layers:
            attn.query_scale = AttentionTemperature(spec.floor_scale, spec.attn_scale)


def _clamped_moe(spec: ModelSpec) -> MoE:
    """gpt-oss's MoE layer (``spec.clamped_experts``): biased router, softmax after top-k,
    biased experts with the clamped SwiGLU, transformers' fused tensors on disk."""
    moe = MoE(
        spec.hidden_size,
        spec.moe_intermediate_size,
        num_experts=spec.num_experts,
        top_k=spec.num_experts_per_tok,
        router_bias=True,
        softmax_after_topk=True,
    )
    moe.experts = gpt_oss_experts(
        spec.num_experts,
        spec.hidden_size,
        spec.moe_intermediate_size,
        alpha=spec.clamped_experts.swiglu_alpha,
        limit=spec.clamped_experts.swiglu_limit,
    )
    return moe


def _mlp(spec: ModelSpec, layer_idx: int) -> nn.Module:
    if spec.clamped_experts is not None and spec.is_moe_layer(layer_idx):
        return _clamped_moe(spec)
    if spec.moe_router == "llama4" and spec.is_moe_layer(layer_idx):
        return Llama4MoE(
            spec.hidden_size,
            spec.moe_intermediate_size,
            num_experts=spec.num_experts,
            top_k=spec.num_experts_per_tok,
        )
    if spec.moe_routing is not None and spec.is_moe_layer(layer_idx):
        return DeepSeekMoE(
            spec.hidden_size,
            spec.moe_intermediate_size,
            num_experts=spec.num_experts,
            top_k=spec.num_experts_per_tok,
            routing=spec.moe_routing,
            norm_topk_prob=spec.norm_topk_prob,
            mlp_bias=spec.mlp_bias,
        )
    if spec.is_moe_layer(layer_idx):
        if spec.hidden_act != "silu":
            raise UnsupportedModelError(
                f"mixture-of-experts layers are SwiGLU only, got hidden_act {spec.hidden_act!r}"
            )
        return MoE(
            spec.hidden_size,
            spec.moe_intermediate_size,
            num_experts=spec.num_experts,
            top_k=spec.num_experts_per_tok,
            norm_topk_prob=spec.norm_topk_prob,
        )
    return FeedForward(
        spec.hidden_size, spec.intermediate_size, bias=spec.mlp_bias, act=spec.hidden_act
    )


@contextlib.contextmanager
def _no_default_init() -> Iterator[None]:
    """Skip ``nn.Linear``/``nn.Embedding`` default initialisation while building on meta.

    Initialising meta tensors does nothing but costs time per module, which adds up to
    seconds for MoE models with tens of thousands of expert linears. Weights are
    initialised (or loaded) after materialisation instead.
    """
    saved = {cls: cls.reset_parameters for cls in (nn.Linear, nn.Embedding)}
    try:
        for cls in saved:
            cls.reset_parameters = _skip_reset  # type: ignore[method-assign]
        yield
    finally:
        for cls, method in saved.items():
            cls.reset_parameters = method  # type: ignore[method-assign]


def _skip_reset(module: nn.Module) -> None:
    return None


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype | None) -> Iterator[None]:
    """Temporarily make ``dtype`` the default so parameters are created in it."""
    if dtype is None:
        yield
        return
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def family_spec(
    common: dict[str, Any], sizes: dict[str, dict[str, Any]], size: str, overrides: dict[str, Any]
) -> ModelSpec:
    """``ModelSpec(**common, **sizes[size], **overrides)`` with a clear error for unknown sizes.

    Family modules keep their fields as data and call this from their ``spec()``. Overriding
    ``num_hidden_layers`` keeps the size's per-layer pattern (layer types, NoPE and dense
    layers), cut or repeated to the new depth.

    Example::

        >>> from tunesmith.models import gemma2
        >>> gemma2.spec("gemma2_2b", num_hidden_layers=3).layer_types
        ('sliding_attention', 'full_attention', 'sliding_attention')
    """
    if size not in sizes:
        raise KeyError(f"unknown size {size!r}; known: {', '.join(sizes)}")
    fields = {**common, **sizes[size]}
    layers = overrides.get("num_hidden_layers")
    if layers is not None and layers != fields.get("num_hidden_layers"):
        fields.update(_per_layer_fields(fields, layers, overrides))
    return ModelSpec(**{**fields, **overrides})


def _per_layer_fields(
    fields: dict[str, Any], layers: int, overrides: dict[str, Any]
) -> dict[str, Any]:
    """The size's per-layer fields for ``layers`` layers (a deeper or shallower model of the
    same pattern): layer ``i`` is like layer ``i mod n`` of the size's ``n`` layers."""
    n = fields["num_hidden_layers"]
    out: dict[str, Any] = {}
    if fields.get("layer_types") is not None and "layer_types" not in overrides:
        out["layer_types"] = tuple(fields["layer_types"][i % n] for i in range(layers))
    for name in ("nope_layers", "mlp_only_layers"):
        if fields.get(name) and name not in overrides:
            chosen = set(fields[name])
            out[name] = tuple(i for i in range(layers) if i % n in chosen)
    return out


def size_builder(
    module: str, spec: Callable[..., ModelSpec], size: str, doc: str
) -> Callable[..., TransformerLM]:
    """The builder of one size of a family file, marked ``@component`` so that a config names
    it (``model: {_component_: tunesmith.models.qwen3.qwen3_8b}``): ``(*, device, dtype,
    **overrides)`` builds ``spec(size, **overrides)`` like :func:`build_model`; named ``size``
    in ``module``, documented by ``doc``.

    Example::

        >>> from tunesmith.models import qwen3
        >>> qwen3.qwen3_8b.__name__, qwen3.qwen3_8b.__doc__
        ('qwen3_8b', 'Qwen3 8B (8.19B parameters).')
        >>> qwen3.qwen3_8b(device="meta", num_hidden_layers=2).spec.num_hidden_layers
        2
    """

    def build(
        *, device: Any = None, dtype: torch.dtype | None = None, **overrides: Any
    ) -> TransformerLM:
        return build_model(spec(size, **overrides), device=device, dtype=dtype)

    build.__name__ = build.__qualname__ = size
    build.__module__ = module
    build.__doc__ = doc
    return component(build)
