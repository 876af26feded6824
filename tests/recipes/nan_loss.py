"""A test-only loss for the recipe's non-finite loss handling: cross-entropy that turns NaN on
one chosen call. Configs name it with ``loss._component_=tests.recipes.nan_loss.NaNOnCall``
(outside the component allow-list: set ``TUNESMITH_ALLOW_ANY_COMPONENT=1``)."""

from __future__ import annotations

import torch

from tunesmith.modules.losses import CrossEntropyLoss


class NaNOnCall(CrossEntropyLoss):
    """Summed cross-entropy, times NaN on the ``call``-th call (1-based) so that the loss and
    every gradient of that call are NaN; with one micro-batch a step, call k is step k.

    Example::

        >>> loss_fn = NaNOnCall(call=2)
        >>> logits, labels = torch.zeros(1, 2, 5), torch.tensor([[1, -100]])
        >>> loss_fn(logits, labels).isnan().item(), loss_fn(logits, labels).isnan().item()
        (False, True)
    """

    def __init__(self, call: int) -> None:
        super().__init__()
        self.call = call
        self.calls = 0

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        loss = super().forward(logits, labels)
        return loss * float("nan") if self.calls == self.call else loss
