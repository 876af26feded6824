"""Token losses whose reduction the training loop controls.

Labels are already shifted (``labels[i]`` is the target of position ``i``; ``-100`` = not
trained), so no loss here shifts again. Losses return the *sum* over trained tokens: the
recipe divides by the number of trained tokens across all micro-batches and ranks, which makes
gradient accumulation and data parallelism give the same update as one big batch.

Example::

    >>> loss_fn = CrossEntropyLoss()
    >>> logits, labels = torch.randn(2, 5, 11), torch.tensor([[1, 2, -100, 4, -100]] * 2)
    >>> loss_fn(logits, labels).shape
    torch.Size([])
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["IGNORE_INDEX", "CrossEntropyLoss"]

IGNORE_INDEX = -100


class CrossEntropyLoss(nn.Module):
    """Summed cross-entropy over positions whose label is not ``ignore_index`` (in float32)."""

    def __init__(self, ignore_index: int = IGNORE_INDEX) -> None:
        super().__init__()
        self.ignore_index = ignore_index

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(
            logits.flatten(0, -2).float(),
            labels.flatten(),
            ignore_index=self.ignore_index,
            reduction="sum",
        )
