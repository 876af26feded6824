"""Rotary position embeddings in the Hugging Face "rotate-half" layout.

Frequencies follow transformers' ``rope_type`` variants: ``default``, ``linear``,
``llama3`` (Llama 3.1+) and ``yarn``. cos/sin are computed from ``position_ids``
so every row of a batch may have its own positions (left padding, packing).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

__all__ = ["RotaryEmbedding", "apply_rotary", "rope_inv_freq", "rotate_half"]


def rope_inv_freq(
    head_dim: int, theta: float = 10000.0, scaling: Mapping[str, Any] | None = None
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (float32, ``[head_dim // 2]``) and the cos/sin scale factor.

    ``scaling`` is a HF ``rope_scaling`` dict (``{"rope_type": "llama3", "factor": 8.0, ...}``)
    or None for plain RoPE.

    Example::

        >>> inv_freq, scale = rope_inv_freq(64, 500000.0, {"rope_type": "linear", "factor": 2.0})
        >>> inv_freq.shape, scale
        (torch.Size([32]), 1.0)
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    scaling = dict(scaling or {})
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / scaling["factor"], 1.0
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling), 1.0
    if rope_type == "yarn":
        return _yarn_inv_freq(head_dim, theta, scaling)
    raise ValueError(f"unsupported rope_type {rope_type!r} (default, linear, llama3, yarn)")


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: Mapping[str, Any]) -> torch.Tensor:
    """Llama 3.1: keep high frequencies, divide low ones by ``factor``, blend in between."""
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_mid = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(is_mid, blended, scaled)


def _yarn_inv_freq(
    head_dim: int, theta: float, scaling: Mapping[str, Any]
) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate low frequencies, extrapolate high ones, ramp in between."""
    factor = scaling["factor"]
    old_len = scaling["original_max_position_embeddings"]
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention_factor = (
            mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
        )

    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # 1 -> extrapolate (high frequency), 0 -> interpolate
    return interpolation * (1 - keep) + extrapolation * keep, float(attention_factor)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[x1, x2] -> [-x2, x1]`` on the last dimension (HF layout)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``q``/``k`` (``[b, heads, s, head_dim]``) by ``cos``/``sin`` (``[b, s, head_dim]``)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


class RotaryEmbedding(nn.Module):
    """cos/sin tables for given positions.

    ``inv_freq`` is a non-persistent float32 buffer (not in the state dict). It is
    recomputed, in float32, whenever the module is moved or cast, so ``.to(bf16)``
    never degrades it and ``to_empty()`` after a meta-device build restores it.

    Example::

        >>> rope = RotaryEmbedding(16, theta=10000.0)
        >>> cos, sin = rope(torch.arange(5)[None], dtype=torch.float32)
        >>> cos.shape
        torch.Size([1, 5, 16])
    """

    inv_freq: torch.Tensor

    def __init__(
        self, head_dim: int, theta: float = 10000.0, scaling: Mapping[str, Any] | None = None
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta
        self.scaling = dict(scaling) if scaling else None
        inv_freq, self.attention_scaling = rope_inv_freq(head_dim, theta, self.scaling)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def reset_parameters(self, device: torch.device | str | None = None) -> None:
        """Recompute ``inv_freq`` in float32 on ``device`` (default: where it is now)."""
        device = self.inv_freq.device if device is None else torch.device(device)
        if device.type == "meta":
            self.inv_freq = torch.empty(self.head_dim // 2, device="meta")
            return
        inv_freq, _ = rope_inv_freq(self.head_dim, self.theta, self.scaling)
        self.inv_freq = inv_freq.to(device)

    def _apply(self, fn: Any, recurse: bool = True) -> RotaryEmbedding:
        super()._apply(fn, recurse)
        if not self.inv_freq.is_meta:
            self.reset_parameters()
        return self

    def forward(
        self, position_ids: torch.Tensor, dtype: torch.dtype = torch.float32
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``position_ids`` ``[b, s]`` (or ``[s]``) -> ``(cos, sin)``, each ``[b, s, head_dim]``."""
        if self.inv_freq.is_meta:
            raise RuntimeError(
                "RotaryEmbedding.inv_freq is on the meta device; call "
                "model.init_buffers() (or reset_parameters()) after materialising the model"
            )
        if position_ids.dim() == 1:
            position_ids = position_ids[None]
        freqs = position_ids.float()[..., None] * self.inv_freq.to(position_ids.device)
        angles = torch.cat((freqs, freqs), dim=-1)
        cos = angles.cos() * self.attention_scaling
        sin = angles.sin() * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)

    def extra_repr(self) -> str:
        rope_type = (self.scaling or {}).get("rope_type", "default")
        return f"head_dim={self.head_dim}, theta={self.theta}, rope_type={rope_type}"
