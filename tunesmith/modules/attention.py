"""Grouped-query self-attention; the attention itself is one of
:mod:`tunesmith.modules.attention_backends` (SDPA, varlen, flex)."""

from __future__ import annotations

import math

import torch
from torch import nn

from tunesmith.modules.attention_backends import (
    ATTENTION_BACKENDS,
    AttentionBatch,
    softcapped_attention,
)
from tunesmith.modules.kv_cache import KVCache
from tunesmith.modules.norms import RMSNorm
from tunesmith.modules.paged_cache import PagedKVCache
from tunesmith.modules.rope import apply_rotary
from tunesmith.modules.sinks import sink_attention

__all__ = ["Attention"]


class Attention(nn.Module):
    """Multi-head attention with grouped key/value heads (GQA) and rotary positions.

    Submodules carry Hugging Face names: ``q_proj``, ``k_proj``, ``v_proj``,
    ``o_proj`` and, with ``qk_norm``, ``q_norm``/``k_norm``: RMSNorms applied before RoPE,
    per head (Qwen3, Gemma 3) or over the whole projection (OLMo 2).

    Args:
        hidden_size: model width.
        num_heads: query heads.
        num_kv_heads: key/value heads (divides ``num_heads``).
        head_dim: width of one head.
        qkv_bias: bias on the q, k, v projections.
        o_bias: bias on the output projection.
        qk_norm: RMSNorm on q and k.
        qk_norm_per_head: that norm per head (else over all heads of the projection at once).
        norm_eps: epsilon of those norms.
        norm_style: their :data:`~tunesmith.modules.norms.NORM_STYLES` style.
        scale: the softmax scale (default ``head_dim ** -0.5``).
        softcap: soft-cap on the attention scores, ``cap * tanh(scores / cap)`` (Gemma 2),
            computed by :func:`~tunesmith.modules.attention_backends.softcapped_attention`.
        rope: rotate q and k (False: a NoPE layer, which ignores ``cos``/``sin``).
        rope_interleaved: rotate pairs ``(0, 1), (2, 3), ...`` instead of the two halves
            (GLM-4; the rotary embedding must lay cos/sin out the same way).
        sinks: a learned logit per head in the softmax denominator (gpt-oss), the parameter
            ``sinks`` ``[num_heads]``; computed by :func:`~tunesmith.modules.sinks.sink_attention`.

    Example::

        >>> from tunesmith.modules.rope import RotaryEmbedding
        >>> attn = Attention(32, num_heads=4, num_kv_heads=2, head_dim=8)
        >>> cos, sin = RotaryEmbedding(8)(torch.arange(5)[None])
        >>> attn(torch.randn(1, 5, 32), cos, sin).shape   # causal, no mask needed
        torch.Size([1, 5, 32])
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        qkv_bias: bool = False,
        o_bias: bool = False,
        qk_norm: bool = False,
        qk_norm_per_head: bool = True,
        norm_eps: float = 1e-6,
        norm_style: str = "plain",
        scale: float | None = None,
        softcap: float | None = None,
        rope: bool = True,
        rope_interleaved: bool = False,
        sinks: bool = False,
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
            )
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=o_bias)
        self.qk_norm_per_head = qk_norm_per_head
        if qk_norm:
            q_dim, k_dim = (head_dim, head_dim)
            if not qk_norm_per_head:
                q_dim, k_dim = num_heads * head_dim, num_kv_heads * head_dim
            self.q_norm = RMSNorm(q_dim, eps=norm_eps, style=norm_style)
            self.k_norm = RMSNorm(k_dim, eps=norm_eps, style=norm_style)
        else:
            self.q_norm = self.k_norm = None
        self.scale = scale
        self.softcap = softcap
        self.rope = rope
        self.rope_interleaved = rope_interleaved
        if sinks and softcap is not None:
            raise ValueError("attention sinks with a soft-cap on the scores are not supported")
        self.sinks = nn.Parameter(torch.empty(num_heads)) if sinks else None
        # A module (q, batch, cached tokens) -> q scaled by position, set by a builder
        # (Llama 4's temperature tuning of NoPE layers, tunesmith.modules.llama4); None: none.
        self.query_scale: nn.Module | None = None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        *,
        mask: torch.Tensor | None = None,
        kv_cache: KVCache | PagedKVCache | None = None,
        layer_idx: int = 0,
        spans: list[list[tuple[int, int]]] | None = None,
        batch: AttentionBatch | None = None,
    ) -> torch.Tensor:
        """Attend ``x`` ``[b, s, hidden]`` (plus cached keys) and return ``[b, s, hidden]``.

        ``batch`` (an :class:`~tunesmith.modules.attention_backends.AttentionBatch`, built once
        per forward by :class:`~tunesmith.modules.decoder.DecoderModel`) names the backend and
        says what may attend to what: a dense mask, packed ``document_ids``, a sliding window.
        Without it, ``mask`` is a bool ``[b|1, 1, s, kv_len]`` mask (True = attend), or None:
        causal for a fresh sequence, unrestricted for a single new token after a cache (see
        :func:`tunesmith.modules.masks.build_attention_mask`); ``spans`` (packed rows, see
        :func:`tunesmith.modules.masks.document_spans`) attends document by document, padding
        positions getting zeros.
        """
        b, s, _ = x.shape
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.q_norm is not None and not self.qk_norm_per_head:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(b, s, -1, self.head_dim)
        k = k.view(b, s, -1, self.head_dim)
        v = v.view(b, s, -1, self.head_dim)
        if self.q_norm is not None and self.qk_norm_per_head:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if self.rope:
            q, k = apply_rotary(q, k, cos, sin, interleaved=self.rope_interleaved)
        if self.query_scale is not None:
            q = self.query_scale(q, batch, getattr(kv_cache, "seq_len", 0))
        if kv_cache is not None:
            k, v = kv_cache.update(layer_idx, k, v)

        if batch is None:
            batch = AttentionBatch("sdpa", mask=mask)
            if spans is not None:
                batch.backend, batch.prepared["loop"] = "loop", spans
        if self.sinks is not None:
            sinks = self.sinks.to_local() if hasattr(self.sinks, "to_local") else self.sinks
            out = sink_attention(q, k, v, batch, sinks, scale=self.scale)  # TP: local heads
        elif self.softcap is not None:
            out = softcapped_attention(q, k, v, batch, scale=self.scale, softcap=self.softcap)
        else:
            if self.scale is not None:  # the backends all scale by head_dim ** -0.5
                q = q * (self.scale * math.sqrt(self.head_dim))
            out = ATTENTION_BACKENDS[batch.backend](q, k, v, batch)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))

    def extra_repr(self) -> str:
        extra = "" if self.rope else ", rope=False"
        extra += "" if self.scale is None else f", scale={self.scale:g}"
        extra += "" if self.softcap is None else f", softcap={self.softcap:g}"
        return (
            f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}"
            + extra
        )
