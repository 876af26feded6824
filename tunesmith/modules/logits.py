"""What a model family does to its head's output before the softmax.

Most families take ``hidden @ lm_head.weight.T`` as the logits. Some change them:
Granite divides by ``logits_scaling``, Gemma 2 soft-caps them (``cap * tanh(z / cap)``). A
:class:`LogitTransform` says which, once, and every path that turns hidden states into
token probabilities applies it: the model's own forward (generation, full-logits losses) and
the chunked head paths that own the projection (linear cross-entropy, token log-probs,
entropy, distillation), where it goes into every chunk.

Example::

    >>> t = LogitTransform(scale=0.5, softcap=2.0)
    >>> t(torch.tensor([0.0, 1.0, 100.0]))
    tensor([0.0000, 0.4898, 2.0000])
    >>> LogitTransform.of(None) is None, LogitTransform.of(LogitTransform()) is None
    (True, True)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["LogitTransform"]


@dataclass(frozen=True)
class LogitTransform:
    """``y = softcap * tanh(scale * z / softcap)`` (``y = scale * z`` without a cap).

    Args:
        scale: multiplies the raw logits ``z`` first (Granite: ``1 / logits_scaling``).
        softcap: the soft cap (Gemma 2: ``final_logit_softcapping``), or None.
    """

    scale: float = 1.0
    softcap: float | None = None

    def __post_init__(self) -> None:
        if not (isinstance(self.scale, (int, float)) and math.isfinite(self.scale)):
            raise ValueError(f"LogitTransform.scale must be a finite number, got {self.scale!r}")
        if self.scale <= 0:
            raise ValueError(f"LogitTransform.scale must be > 0, got {self.scale}")
        if self.softcap is not None and not (
            isinstance(self.softcap, (int, float)) and self.softcap > 0
        ):
            raise ValueError(f"LogitTransform.softcap must be > 0 or None, got {self.softcap!r}")

    @staticmethod
    def of(transform: LogitTransform | None) -> LogitTransform | None:
        """``transform``, or None when it changes nothing (so callers can skip the work)."""
        if transform is None or (transform.scale == 1.0 and transform.softcap is None):
            return None
        return transform

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """The transformed logits (out of place, differentiable)."""
        if self.softcap is None:
            return logits * self.scale if self.scale != 1.0 else logits
        return torch.tanh(logits * (self.scale / self.softcap)) * self.softcap

    def apply_(self, logits: torch.Tensor) -> torch.Tensor:
        """Transform ``logits`` in place and return them (no autograd)."""
        if self.softcap is None:
            return logits.mul_(self.scale) if self.scale != 1.0 else logits
        return logits.mul_(self.scale / self.softcap).tanh_().mul_(self.softcap)

    def derivative_(self, transformed: torch.Tensor) -> torch.Tensor:
        """``dy/dz`` from the transformed logits ``y``, in place (``y`` is overwritten):
        ``scale * (1 - (y / softcap) ** 2)`` with a cap, the constant ``scale`` without."""
        if self.softcap is None:
            return transformed.fill_(self.scale)
        y = transformed.div_(self.softcap)
        return y.mul_(y).neg_().add_(1.0).mul_(self.scale)
