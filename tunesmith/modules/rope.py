"""Rotary position embeddings in the Hugging Face "rotate-half" layout.

Frequencies follow transformers' ``rope_type`` variants: ``default``, ``linear``,
``llama3`` (Llama 3.1+), ``yarn`` and ``longrope`` (Phi-3/4: short factors up to the original
context, long ones past it). cos/sin are computed from ``position_ids`` so every row of a batch
may have its own positions (left padding, packing). A head may rotate only its first
``rotary_dim`` features (partial rotary: Phi-4-mini, GLM-4), in the rotate-half layout or in
the interleaved one (pairs ``(0, 1), (2, 3), ...``: GLM-4).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

__all__ = ["RotaryEmbedding", "apply_rotary", "rope_inv_freq", "rotate_half", "rotate_pairs"]


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
    if rope_type == "longrope":
        return _longrope_inv_freq(head_dim, theta, scaling, long=False)
    raise ValueError(
        f"unsupported rope_type {rope_type!r} (default, linear, llama3, yarn, longrope)"
    )


def _longrope_inv_freq(
    head_dim: int, theta: float, scaling: Mapping[str, Any], *, long: bool
) -> tuple[torch.Tensor, float]:
    """LongRoPE: every frequency divided by its own factor (``long_factor`` past the original
    context, ``short_factor`` within it); cos/sin scaled by ``attention_factor`` (default
    ``sqrt(1 + log(factor) / log(original context))``)."""
    factors = scaling["long_factor" if long else "short_factor"]
    if len(factors) != head_dim // 2:
        raise ValueError(
            f"longrope {'long' if long else 'short'}_factor has {len(factors)} values, the "
            f"rotary dimension {head_dim} needs {head_dim // 2}"
        )
    factor, old_len = scaling.get("factor") or 1.0, scaling["original_max_position_embeddings"]
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = (
            1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(old_len))
        )
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    ext = torch.tensor(factors, dtype=torch.float32)
    return 1.0 / (ext * theta**exponents), float(attention_factor)


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


def rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    """``[x0, x1, x2, x3, ...] -> [-x1, x0, -x3, x2, ...]`` on the last dimension (interleaved)."""
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


def apply_rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    interleaved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``q``/``k`` (``[b, heads, s, head_dim]``) by ``cos``/``sin`` (``[b, s, rot]``):
    the first ``rot`` features of each head (all of them when ``rot == head_dim``), in the
    rotate-half or the ``interleaved`` layout (cos/sin made by a :class:`RotaryEmbedding` of
    the same layout)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    rotate = rotate_pairs if interleaved else rotate_half
    rot = cos.shape[-1]
    if rot == q.shape[-1]:
        return q * cos + rotate(q) * sin, k * cos + rotate(k) * sin

    def one(x: torch.Tensor) -> torch.Tensor:
        part, rest = x[..., :rot], x[..., rot:]
        return torch.cat((part * cos + rotate(part) * sin, rest), dim=-1)

    return one(q), one(k)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for given positions, over ``head_dim`` features (the rotary dimension:
    less than the head's under partial rotary).

    ``inv_freq`` is a non-persistent float32 buffer (not in the state dict). It is
    recomputed, in float32, whenever the module is moved or cast, so ``.to(bf16)``
    never degrades it and ``to_empty()`` after a meta-device build restores it. A ``longrope``
    scaling keeps a second table (``long_inv_freq``), used for a forward whose largest
    position reaches past ``original_max_position_embeddings`` (as transformers does).
    ``interleaved`` lays cos/sin out for pairs ``(0, 1), (2, 3), ...`` (see :func:`apply_rotary`).

    Example::

        >>> rope = RotaryEmbedding(16, theta=10000.0)
        >>> cos, sin = rope(torch.arange(5)[None], dtype=torch.float32)
        >>> cos.shape
        torch.Size([1, 5, 16])
    """

    inv_freq: torch.Tensor
    long_inv_freq: torch.Tensor | None

    def __init__(
        self,
        head_dim: int,
        theta: float = 10000.0,
        scaling: Mapping[str, Any] | None = None,
        *,
        interleaved: bool = False,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta
        self.scaling = dict(scaling) if scaling else None
        self.interleaved = interleaved
        inv_freq, self.attention_scaling = rope_inv_freq(head_dim, theta, self.scaling)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("long_inv_freq", self._long_table(), persistent=False)

    def _long_table(self) -> torch.Tensor | None:
        if (self.scaling or {}).get("rope_type") != "longrope":
            return None
        return _longrope_inv_freq(self.head_dim, self.theta, self.scaling, long=True)[0]

    def reset_parameters(self, device: torch.device | str | None = None) -> None:
        """Recompute ``inv_freq`` in float32 on ``device`` (default: where it is now)."""
        device = self.inv_freq.device if device is None else torch.device(device)
        long = self._long_table()
        if device.type == "meta":
            self.inv_freq = torch.empty(self.head_dim // 2, device="meta")
            self.long_inv_freq = None if long is None else torch.empty_like(long, device="meta")
            return
        inv_freq, _ = rope_inv_freq(self.head_dim, self.theta, self.scaling)
        self.inv_freq = inv_freq.to(device)
        self.long_inv_freq = None if long is None else long.to(device)

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
        inv_freq = self.inv_freq.to(position_ids.device)
        if self.long_inv_freq is not None:  # one table for the whole forward, no host sync
            past = position_ids.max() + 1 > self.scaling["original_max_position_embeddings"]
            inv_freq = torch.where(past, self.long_inv_freq.to(position_ids.device), inv_freq)
        freqs = position_ids.float()[..., None] * inv_freq
        if self.interleaved:
            angles = freqs.repeat_interleave(2, dim=-1)
        else:
            angles = torch.cat((freqs, freqs), dim=-1)
        cos = angles.cos() * self.attention_scaling
        sin = angles.sin() * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)

    def extra_repr(self) -> str:
        rope_type = (self.scaling or {}).get("rope_type", "default")
        layout = ", interleaved" if self.interleaved else ""
        return f"head_dim={self.head_dim}, theta={self.theta}, rope_type={rope_type}{layout}"
