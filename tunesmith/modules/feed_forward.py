"""Gated feed-forward block: SwiGLU (Llama/Qwen/Mistral) and GeGLU (Gemma)."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["ACTIVATIONS", "FeedForward"]

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),
    "gelu": F.gelu,
}
"""The gate activations by their Hugging Face ``hidden_act`` names."""


class FeedForward(nn.Module):
    """``down_proj(act(gate_proj(x)) * up_proj(x))`` with HF parameter names.

    Example::

        >>> mlp = FeedForward(32, 64)
        >>> mlp(torch.randn(2, 5, 32)).shape
        torch.Size([2, 5, 32])
        >>> FeedForward(32, 64, act="gelu_pytorch_tanh").act
        'gelu_pytorch_tanh'
    """

    def __init__(
        self, hidden_size: int, intermediate_size: int, *, bias: bool = False, act: str = "silu"
    ) -> None:
        super().__init__()
        if act not in ACTIVATIONS:
            raise ValueError(f"activation {act!r} is not supported; supported: {list(ACTIVATIONS)}")
        self.act = act
        self._act_fn = ACTIVATIONS[act]
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self._act_fn(self.gate_proj(x)) * self.up_proj(x))
