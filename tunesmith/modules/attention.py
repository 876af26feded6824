"""Grouped-query self-attention on ``torch.nn.functional.scaled_dot_product_attention``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tunesmith.modules.kv_cache import KVCache
from tunesmith.modules.norms import RMSNorm
from tunesmith.modules.rope import apply_rotary

__all__ = ["Attention"]


class Attention(nn.Module):
    """Multi-head attention with grouped key/value heads (GQA) and rotary positions.

    Submodules carry Hugging Face names: ``q_proj``, ``k_proj``, ``v_proj``,
    ``o_proj`` and, with ``qk_norm`` (Qwen3), ``q_norm``/``k_norm`` — per-head
    RMSNorms applied before RoPE.

    Args:
        hidden_size: model width.
        num_heads: query heads.
        num_kv_heads: key/value heads (divides ``num_heads``).
        head_dim: width of one head.
        qkv_bias: bias on the q, k, v projections.
        o_bias: bias on the output projection.
        qk_norm: per-head RMSNorm on q and k.
        norm_eps: epsilon of those norms.

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
        norm_eps: float = 1e-6,
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
        if qk_norm:
            self.q_norm = RMSNorm(head_dim, eps=norm_eps)
            self.k_norm = RMSNorm(head_dim, eps=norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        *,
        mask: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
        layer_idx: int = 0,
        spans: list[list[tuple[int, int]]] | None = None,
    ) -> torch.Tensor:
        """Attend ``x`` ``[b, s, hidden]`` (plus cached keys) and return ``[b, s, hidden]``.

        ``mask`` is a bool ``[b|1, 1, s, kv_len]`` mask (True = attend). When it is None
        the attention is causal for a fresh sequence, or unrestricted for a single
        new token after a cache (see :func:`tunesmith.modules.masks.build_attention_mask`).
        ``spans`` (packed rows, see :func:`tunesmith.modules.masks.document_spans`) says the
        same as a block-causal ``mask`` more cheaply: each document attends causally to
        itself alone, so the cost is the sum of the squared document lengths instead of the
        squared row length; padding positions get zeros. Under ``torch.compile`` the mask
        is used instead (data-dependent spans would recompile each batch).
        """
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(b, s, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(b, s, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q, k = apply_rotary(q, k, cos, sin)
        if kv_cache is not None:
            k, v = kv_cache.update(layer_idx, k, v)

        groups = self.num_heads // self.num_kv_heads
        if spans is not None and not torch.compiler.is_compiling():
            out = _attend_by_document(q, k, v, spans, enable_gqa=groups > 1)
        elif mask is None:
            # Causal fast path: flash/efficient kernels handle grouped heads themselves.
            out = F.scaled_dot_product_attention(q, k, v, is_causal=s > 1, enable_gqa=groups > 1)
        else:
            # With an explicit mask, repeat kv heads so every SDPA backend accepts it.
            if groups > 1:
                k = k.repeat_interleave(groups, dim=1)
                v = v.repeat_interleave(groups, dim=1)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))

    def extra_repr(self) -> str:
        return f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}"


def _attend_by_document(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    spans: list[list[tuple[int, int]]],
    *,
    enable_gqa: bool,
) -> torch.Tensor:
    """Causal SDPA over each document of each row (``[b, heads, s, d]`` in and out); the
    positions of no document (padding) are zeros."""
    b, heads, s, d = q.shape
    rows = []
    for row, row_spans in enumerate(spans):
        pieces, pos = [], 0
        for start, end in row_spans:
            if start > pos:
                pieces.append(q.new_zeros(1, heads, start - pos, d))
            pieces.append(
                F.scaled_dot_product_attention(
                    q[row : row + 1, :, start:end], k[row : row + 1, :, start:end],
                    v[row : row + 1, :, start:end], is_causal=True, enable_gqa=enable_gqa,
                )
            )  # fmt: skip
            pos = end
        if pos < s:
            pieces.append(q.new_zeros(1, heads, s - pos, d))
        rows.append(torch.cat(pieces, dim=2))
    return torch.cat(rows, dim=0)
