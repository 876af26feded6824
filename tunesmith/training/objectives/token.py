"""SFT's objective: the token cross-entropy summed over the trained tokens (and the MoE
load-balancing loss for MoE models).

Example::

    >>> import torch
    >>> from tunesmith.modules.losses import CrossEntropyLoss
    >>> objective = TokenCrossEntropy(CrossEntropyLoss())
    >>> objective.units({"labels": torch.tensor([[-100, 5, 6, -100]])})
    2
"""

from __future__ import annotations

import torch
from torch import nn

from tunesmith.modules.losses import IGNORE_INDEX
from tunesmith.training.forward import (
    forward_batch,
    head_transform,
    head_weight,
    router_aux_loss,
    transform_kwargs,
)
from tunesmith.training.trainer import LossOutput

__all__ = ["TokenCrossEntropy", "token_loss"]


class TokenCrossEntropy:
    """The SFT objective: cross-entropy summed over the trained tokens (labels != -100), plus
    the MoE load-balancing loss (a mean per micro-batch) for MoE models."""

    unit = "trained_tokens"
    context_parallel = "tokens"  # a sum over tokens: each cp rank sums its share

    def __init__(self, loss_fn: nn.Module) -> None:
        self.loss_fn = loss_fn

    def units(self, batch: dict[str, torch.Tensor]) -> int:
        return int((batch["labels"] != IGNORE_INDEX).sum())

    def __call__(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> LossOutput:
        loss, router_logits = token_loss(model, self.loss_fn, batch)
        return LossOutput(loss, aux_loss=router_aux_loss(model, router_logits, batch))


def token_loss(
    model: nn.Module, loss_fn: nn.Module, batch: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, tuple]:
    """Summed loss over the batch's trained tokens, and the MoE router logits. A loss that owns
    the output projection (``needs_hidden_states``) gets hidden states, the head's weight and
    (when the model has one) its logit ``transform``."""
    if getattr(loss_fn, "needs_hidden_states", False):
        kwargs = transform_kwargs(loss_fn, transform=head_transform(model))
        hidden, router_logits = forward_batch(model, batch, return_hidden_states=True)
        return loss_fn(hidden, head_weight(model), batch["labels"], **kwargs), router_logits
    logits, router_logits = forward_batch(model, batch)
    return loss_fn(logits, batch["labels"]), router_logits
