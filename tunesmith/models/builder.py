"""Build a :class:`~tunesmith.modules.TransformerLM` from a :class:`ModelSpec`."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from tunesmith.models.spec import ModelSpec
from tunesmith.modules.attention import Attention
from tunesmith.modules.decoder import DecoderLayer, DecoderModel, TransformerLM
from tunesmith.modules.feed_forward import FeedForward
from tunesmith.modules.moe import MoE
from tunesmith.modules.norms import RMSNorm
from tunesmith.modules.rope import RotaryEmbedding

__all__ = ["build_model", "family_spec"]


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
                norm_eps=spec.rms_norm_eps,
            ),
            _mlp(spec, i),
            spec.hidden_size,
            spec.rms_norm_eps,
        )
        for i in range(spec.num_hidden_layers)
    ]
    decoder = DecoderModel(
        nn.Embedding(spec.vocab_size, spec.hidden_size),
        layers,
        RMSNorm(spec.hidden_size, eps=spec.rms_norm_eps),
        RotaryEmbedding(spec.head_dim, spec.rope_theta, spec.rope_scaling),
        sliding_window=spec.sliding_window,
    )
    return TransformerLM(
        decoder,
        tie_word_embeddings=spec.tie_word_embeddings,
        initializer_range=spec.initializer_range,
        spec=spec,
    )


def _mlp(spec: ModelSpec, layer_idx: int) -> nn.Module:
    if spec.is_moe_layer(layer_idx):
        return MoE(
            spec.hidden_size,
            spec.moe_intermediate_size,
            num_experts=spec.num_experts,
            top_k=spec.num_experts_per_tok,
            norm_topk_prob=spec.norm_topk_prob,
        )
    return FeedForward(spec.hidden_size, spec.intermediate_size, bias=spec.mlp_bias)


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

    Family modules keep their fields as data and call this from their ``spec()``.
    """
    if size not in sizes:
        raise KeyError(f"unknown size {size!r}; known: {', '.join(sizes)}")
    return ModelSpec(**{**common, **sizes[size], **overrides})
