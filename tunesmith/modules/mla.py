"""Multi-head latent attention (MLA, DeepSeek-V2/V3): keys and values come from one small
latent per token, so a KV cache holds ``kv_lora_rank + qk_rope_head_dim`` numbers per token
and layer instead of ``2 * heads * head_dim``.

Per token: the query is ``q_proj(x)`` or, with a ``q_lora_rank``, the low-rank
``q_b_proj(q_a_layernorm(q_a_proj(x)))``; ``kv_a_proj_with_mqa(x)`` gives the latent ``c``
(``kv_lora_rank``, normed by ``kv_a_layernorm``) and one shared rotary key ``k_rot``
(``qk_rope_head_dim``); ``kv_b_proj(c)`` expands ``c`` into every head's un-rotated key
(``qk_nope_head_dim``) and value (``v_head_dim``). Only the last ``qk_rope_head_dim`` features
of each query head and ``k_rot`` are rotated (RoPE over ``qk_rope_head_dim``). The cache stores
``c`` and ``k_rot``; the expansion runs after reading it. Names are Hugging Face's.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial

from tunesmith.modules.attention_backends import ATTENTION_BACKENDS, AttentionBatch
from tunesmith.modules.kv_cache import KVCache
from tunesmith.modules.norms import RMSNorm
from tunesmith.modules.paged_cache import PagedKVCache
from tunesmith.modules.rope import apply_rotary

__all__ = ["MLAConfig", "MultiHeadLatentAttention", "mla_softmax_scale"]

# transformers builds q_a_layernorm / kv_a_layernorm with RMSNorm's default eps, not the
# config's rms_norm_eps.
LATENT_NORM_EPS = 1e-6


@dataclass(frozen=True)
class MLAConfig:
    """The widths of multi-head latent attention (``config.json`` names).

    Example::

        >>> mla = MLAConfig(q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128,
        ...                 qk_rope_head_dim=64, v_head_dim=128)
        >>> mla.qk_head_dim, mla.latent_width
        (192, 576)
    """

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    def __post_init__(self) -> None:
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"MLA {name} must be a positive integer, got {value!r}")
        rank = self.q_lora_rank
        if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0):
            raise ValueError(f"MLA q_lora_rank must be a positive integer or null, got {rank!r}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"MLA qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")

    @property
    def qk_head_dim(self) -> int:
        """Width of one query/key head: un-rotated plus rotated features."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_width(self) -> int:
        """Numbers cached per token and layer: the latent and the shared rotary key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def parameters(self, hidden_size: int, num_heads: int) -> int:
        """Weights of one MLA layer's projections (norms and biases left out)."""
        qk = num_heads * self.qk_head_dim
        q = hidden_size * qk if self.q_lora_rank is None else self.q_lora_rank * (hidden_size + qk)
        kv = hidden_size * self.latent_width
        kv += self.kv_lora_rank * num_heads * (self.qk_nope_head_dim + self.v_head_dim)
        return q + kv + num_heads * self.v_head_dim * hidden_size

    def expanded_width(self, num_heads: int) -> int:
        """Numbers per token and layer of a cache of expanded keys and values."""
        return num_heads * (self.qk_head_dim + self.v_head_dim)


def mla_softmax_scale(mla: MLAConfig, rope_scaling: Mapping[str, Any] | None) -> float:
    """``qk_head_dim ** -0.5``, times ``mscale(factor, mscale_all_dim) ** 2`` under a scaled
    RoPE with ``mscale_all_dim`` (YaRN as DeepSeek applies it to every query/key feature).

    Example::

        >>> mla = MLAConfig(None, 16, 8, 8, 8)
        >>> mla_softmax_scale(mla, None) == 16 ** -0.5
        True
        >>> round(mla_softmax_scale(mla, {"rope_type": "yarn", "factor": 40.0,
        ...                                "mscale_all_dim": 1.0}) * 4, 4)
        1.8739
    """
    scale = mla.qk_head_dim**-0.5
    scaling = rope_scaling or {}
    m_all = scaling.get("mscale_all_dim")
    if scaling.get("rope_type", "default") != "default" and m_all:
        factor = scaling["factor"]
        mscale = 1.0 if factor <= 1 else 0.1 * m_all * math.log(factor) + 1.0
        scale *= mscale * mscale
    return scale


class MultiHeadLatentAttention(nn.Module):
    """Multi-head latent attention (see the module docs) through the attention backends.

    Args:
        hidden_size: model width.
        num_heads: attention heads (under tensor parallel: this rank's).
        mla: the widths (:class:`MLAConfig`).
        bias: bias on ``q_a_proj``, ``kv_a_proj_with_mqa`` and ``o_proj`` (``attention_bias``).
        scale: the softmax scale (default ``qk_head_dim ** -0.5``; see :func:`mla_softmax_scale`).
        rope_interleaved: rotate pairs of features (``rope_interleave``) instead of halves.

    A KV cache gets the latent as its keys (one head of ``kv_lora_rank``) and the rotated
    shared key as its values (one head of ``qk_rope_head_dim``): :attr:`num_kv_heads`,
    :attr:`head_dim` and :attr:`cache_value_dim` size it.

    Example::

        >>> from tunesmith.modules.rope import RotaryEmbedding
        >>> attn = MultiHeadLatentAttention(32, 4, MLAConfig(None, 16, 8, 4, 6))
        >>> cos, sin = RotaryEmbedding(4)(torch.arange(5)[None])
        >>> attn(torch.randn(1, 5, 32), cos, sin).shape
        torch.Size([1, 5, 32])
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        mla: MLAConfig,
        *,
        bias: bool = False,
        scale: float | None = None,
        rope_interleaved: bool = False,
    ) -> None:
        super().__init__()
        self.mla = mla
        self.num_heads = num_heads
        qk = num_heads * mla.qk_head_dim
        if mla.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden_size, qk, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden_size, mla.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, eps=LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(mla.q_lora_rank, qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden_size, mla.latent_width, bias=bias)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, eps=LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(
            mla.kv_lora_rank, num_heads * (mla.qk_nope_head_dim + mla.v_head_dim), bias=False
        )
        self.o_proj = nn.Linear(num_heads * mla.v_head_dim, hidden_size, bias=bias)
        self.scale = mla.qk_head_dim**-0.5 if scale is None else scale
        self.rope_interleaved = rope_interleaved
        # What a KV cache is sized by: the latent as one key head, k_rot as one value head.
        self.num_kv_heads = 1
        self.head_dim = mla.kv_lora_rank
        self.cache_value_dim = mla.qk_rope_head_dim

    def _query(self, x: torch.Tensor) -> torch.Tensor:
        if self.mla.q_lora_rank is None:
            return self.q_proj(x)
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))

    def expand(
        self, latent: torch.Tensor, k_rot: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Latent ``[b, 1, t, kv_lora_rank]`` and rotated key ``[b, 1, t, rope]`` -> keys
        ``[b, heads, t, qk_head_dim]`` and values ``[b, heads, t, v_head_dim]``."""
        b, _, t, _ = latent.shape
        mla = self.mla
        kv = self.kv_b_proj(latent[:, 0]).view(b, t, -1, mla.qk_nope_head_dim + mla.v_head_dim)
        k_nope, v = kv.transpose(1, 2).split([mla.qk_nope_head_dim, mla.v_head_dim], dim=-1)
        k = torch.cat((k_nope, k_rot.expand(-1, k_nope.shape[1], -1, -1)), dim=-1)
        return k, v

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
        """Attend ``x`` ``[b, s, hidden]`` (plus cached latents) -> ``[b, s, hidden]``; the
        arguments are those of :meth:`~tunesmith.modules.attention.Attention.forward`."""
        b, s, _ = x.shape
        mla = self.mla
        q = self._query(x).view(b, s, -1, mla.qk_head_dim).transpose(1, 2)
        q_nope, q_rot = q.split([mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=-1)
        latent, k_rot = self.kv_a_proj_with_mqa(x).split(
            [mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1
        )
        # Under tensor parallel the latents are replicated DTensors: taken local here (k_rot
        # feeds only this rank's heads, so its gradient is a partial sum over the ranks).
        latent = _local(self.kv_a_layernorm(latent))[:, None]  # [b, 1, s, kv_lora_rank]
        k_rot = _local(k_rot, partial_grad=True)
        q_rot, k_rot = apply_rotary(
            q_rot, k_rot[:, None], cos, sin, interleaved=self.rope_interleaved
        )
        if kv_cache is not None:  # the cache holds the latent, expanded after reading
            latent, k_rot = kv_cache.update(layer_idx, latent, k_rot)
        k, v = self.expand(latent, k_rot)
        q = torch.cat((q_nope, q_rot), dim=-1)
        if batch is None:
            batch = AttentionBatch("sdpa", mask=mask)
            if spans is not None:
                batch.backend, batch.prepared["loop"] = "loop", spans
        out = _attend(q, k, v, batch, self.scale)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))

    def extra_repr(self) -> str:
        mla = self.mla
        return (
            f"heads={self.num_heads}, q_lora_rank={mla.q_lora_rank}, "
            f"kv_lora_rank={mla.kv_lora_rank}, qk_nope={mla.qk_nope_head_dim}, "
            f"qk_rope={mla.qk_rope_head_dim}, v_head_dim={mla.v_head_dim}, scale={self.scale:g}"
        )


def _local(x: torch.Tensor, *, partial_grad: bool = False) -> torch.Tensor:
    """``x`` as this rank's plain tensor (a replicated ``DTensor`` under tensor parallel; any
    other tensor as it is). ``partial_grad``: only this rank's heads use it, so its gradient
    is summed over the ranks; else a column-wise layer already sums it."""
    if not isinstance(x, DTensor):
        return x
    return x.to_local(grad_placements=(Partial(),) if partial_grad else None)


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: AttentionBatch, scale: float
) -> torch.Tensor:
    """The backend's attention with softmax scale ``scale`` and values of another width than
    the keys. SDPA takes both as they are; the other backends (which scale by
    ``width ** -0.5`` and give outputs of the query's width) get the narrower of q/k and v
    padded with zeros, which changes neither scores nor outputs, and the output cut back."""
    dq, dv = q.shape[-1], v.shape[-1]
    if batch.backend != "sdpa" and dq != dv:
        width = max(dq, dv)
        q, k = F.pad(q, (0, width - dq)), F.pad(k, (0, width - dq))
        v = F.pad(v, (0, width - dv))
    q = q * (scale * math.sqrt(q.shape[-1]))  # the backends all scale by width ** -0.5
    return ATTENTION_BACKENDS[batch.backend](q, k, v, batch)[..., :dv]
