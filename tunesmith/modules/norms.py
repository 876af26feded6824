"""RMSNorm (root-mean-square layer norm), as used by Llama, Qwen and Mistral."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["RMSNorm"]


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x**2) + eps)`` over the last dimension.

    The normalisation runs in float32 and is cast back to the input dtype before
    the weight is applied, exactly as in Hugging Face's implementations.

    Example::

        >>> norm = RMSNorm(8, eps=1e-6)
        >>> norm(torch.randn(2, 3, 8)).shape
        torch.Size([2, 3, 8])
    """

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
