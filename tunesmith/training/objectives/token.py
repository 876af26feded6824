"""SFT's objective: the token cross-entropy summed over the trained tokens (and the MoE
load-balancing loss for MoE models), and ``token_accuracy``: the share of trained tokens whose
label is the model's argmax.

Example::

    >>> import torch
    >>> from tunesmith.modules.losses import CrossEntropyLoss
    >>> objective = TokenCrossEntropy(CrossEntropyLoss())
    >>> objective.units({"labels": torch.tensor([[-100, 5, 6, -100]])})
    2
"""

from __future__ import annotations

import inspect
from typing import Any

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
    the MoE load-balancing loss (a mean per micro-batch) for MoE models.

    With a loss whose ``forward`` takes ``count_correct`` (:class:`CrossEntropyLoss`,
    :class:`LinearCrossEntropyLoss`: the chunked one inside its chunks, no full logits; not a
    subclass that overrides ``forward`` without it, nor a loss of one's own), the
    trained tokens the model gets right are summed as ``token_accuracy``: the Trainer divides
    the sum over all micro-batches and data-parallel ranks by their trained tokens, so the
    step logs the share right (``val_token_accuracy`` in evaluation)."""

    unit = "trained_tokens"
    context_parallel = "tokens"  # a sum over tokens: each cp rank sums its share

    def __init__(self, loss_fn: nn.Module) -> None:
        self.loss_fn = loss_fn
        self.counts = counts_correct(loss_fn)

    def units(self, batch: dict[str, torch.Tensor]) -> int:
        return int((batch["labels"] != IGNORE_INDEX).sum())

    def __call__(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> LossOutput:
        out, router_logits = token_loss(model, self.loss_fn, batch, count_correct=self.counts)
        loss, metrics = (out[0], {"token_accuracy": out[1]}) if self.counts else (out, {})
        return LossOutput(loss, metrics, aux_loss=router_aux_loss(model, router_logits, batch))


def counts_correct(loss_fn: nn.Module) -> bool:
    """Whether ``loss_fn``'s ``forward`` takes ``count_correct`` (and so returns ``(loss, tokens
    right)`` when asked): read from its signature, so a subclass whose ``forward`` does not take
    it is never asked.

    Example::

        >>> from tunesmith.modules.losses import CrossEntropyLoss
        >>> class Mine(CrossEntropyLoss):
        ...     def forward(self, logits, labels):
        ...         return super().forward(logits, labels)
        >>> counts_correct(CrossEntropyLoss()), counts_correct(Mine())
        (True, False)
    """
    forward = getattr(loss_fn, "forward", None)
    return forward is not None and "count_correct" in inspect.signature(forward).parameters


def token_loss(
    model: nn.Module,
    loss_fn: nn.Module,
    batch: dict[str, torch.Tensor],
    count_correct: bool = False,
) -> tuple[Any, tuple]:
    """Summed loss over the batch's trained tokens (with ``count_correct``: ``(loss, tokens
    right)``), and the MoE router logits. A loss that owns the output projection
    (``needs_hidden_states``) gets hidden states, the head's weight and (when the model has
    one) its logit ``transform``."""
    counting = {"count_correct": True} if count_correct else {}
    if getattr(loss_fn, "needs_hidden_states", False):
        kwargs = transform_kwargs(loss_fn, transform=head_transform(model)) | counting
        hidden, router_logits = forward_batch(model, batch, return_hidden_states=True)
        return loss_fn(hidden, head_weight(model), batch["labels"], **kwargs), router_logits
    logits, router_logits = forward_batch(model, batch)
    return loss_fn(logits, batch["labels"], **counting), router_logits
