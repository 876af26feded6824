"""RMSNorm (root-mean-square layer norm) in the three numeric styles open models use."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["NORM_STYLES", "RMSNorm"]

NORM_STYLES = ("plain", "unit_offset", "float_weight")
"""How the weight meets the normalised input (all normalise in float32):

* ``plain`` (Llama, Qwen, Mistral, Granite, ...): cast back to the input dtype, then ``weight *``;
* ``unit_offset`` (Gemma): ``(1 + weight) *`` in float32, then cast (the weight is stored
  centred on 0);
* ``float_weight`` (OLMo 2): ``weight *`` in float32, then cast."""


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x**2) + eps)`` over the last dimension, in one of
    :data:`NORM_STYLES` (each exactly as its family's Hugging Face implementation rounds).

    Example::

        >>> norm = RMSNorm(8, eps=1e-6)
        >>> norm(torch.randn(2, 3, 8)).shape
        torch.Size([2, 3, 8])
        >>> gemma = RMSNorm(8, style="unit_offset")  # weight 0 means a factor of 1
        >>> torch.allclose(gemma(torch.ones(1, 8)), torch.ones(1, 8), atol=1e-5)
        True
    """

    def __init__(self, dim: int, eps: float = 1e-6, *, style: str = "plain") -> None:
        super().__init__()
        if style not in NORM_STYLES:
            raise ValueError(f"RMSNorm style must be one of {NORM_STYLES}, got {style!r}")
        self.eps = eps
        self.style = style
        self.weight = nn.Parameter(torch.empty(dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """A factor of one: weight 1 (weight 0 in the ``unit_offset`` style)."""
        if self.weight.is_meta:
            return
        with torch.no_grad():
            self.weight.fill_(0.0 if self.style == "unit_offset" else 1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.style == "plain":
            return self.weight * x32.to(x.dtype)
        if self.style == "unit_offset":
            return (x32 * (1.0 + self.weight.float())).to(x.dtype)
        return (self.weight * x32).to(x.dtype)

    def extra_repr(self) -> str:
        style = "" if self.style == "plain" else f", style={self.style!r}"
        return f"{self.weight.shape[0]}, eps={self.eps}{style}"
