"""SwiGLU feed-forward block (Llama/Qwen/Mistral MLP)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["FeedForward"]


class FeedForward(nn.Module):
    """``down_proj(silu(gate_proj(x)) * up_proj(x))`` with HF parameter names.

    Example::

        >>> mlp = FeedForward(32, 64)
        >>> mlp(torch.randn(2, 5, 32)).shape
        torch.Size([2, 5, 32])
    """

    def __init__(self, hidden_size: int, intermediate_size: int, *, bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
