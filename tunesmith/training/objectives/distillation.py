"""Knowledge distillation's objective: a student learns a teacher's token distributions,
mixed with the ordinary cross-entropy on the labels.

The loss (:class:`~tunesmith.modules.losses.KDLoss`: forward KL, reverse KL, symmetric or
Jensen-Shannon, at a temperature) projects both models' hidden states through their heads
chunk by chunk, so their full logits never both exist.

Example::

    >>> from tunesmith.models import llama3
    >>> student, teacher = llama3.llama3_tiny(), llama3.llama3_tiny()
    >>> shared_vocab(student, teacher, tokenizer_size=100) is None  # same heads: all rows
    True
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

__all__ = ["Distillation", "shared_vocab"]


class Distillation:
    """``kd_ratio * Σ divergence + (1 - kd_ratio) * Σ CE`` over the trained tokens, over the
    first ``vocab_size`` rows of both heads (None: all of them)."""

    unit = "trained_tokens"
    context_parallel = "tokens"  # sums over tokens: each cp rank sums its share

    def __init__(
        self,
        teacher: nn.Module,
        loss_fn: nn.Module,
        kd_ratio: float,
        vocab_size: int | None = None,
    ) -> None:
        if not 0.0 <= kd_ratio <= 1.0:
            raise ValueError(f"kd_ratio must be in [0, 1], got {kd_ratio}")
        self.teacher = teacher
        self.loss_fn = loss_fn
        self.kd_ratio = kd_ratio
        self.vocab_size = vocab_size

    def units(self, batch: dict[str, torch.Tensor]) -> int:
        return int((batch["labels"] != IGNORE_INDEX).sum())

    def __call__(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> LossOutput:
        transforms = transform_kwargs(  # each model's own logit transform
            self.loss_fn,
            student_transform=head_transform(model),
            teacher_transform=head_transform(self.teacher),
        )
        hidden, router_logits = forward_batch(model, batch, return_hidden_states=True)
        with torch.no_grad():
            teacher_hidden, _ = forward_batch(self.teacher, batch, return_hidden_states=True)
        student_head, teacher_head = head_weight(model), head_weight(self.teacher)
        if self.vocab_size is not None:  # padded differently: the shared rows only (under
            rows = slice(self.vocab_size)  # tensor parallel the slice is gathered whole)
            student_head, teacher_head = student_head[rows], teacher_head[rows]
        kd, ce = self.loss_fn(
            hidden, student_head, teacher_hidden, teacher_head, batch["labels"], **transforms
        )
        loss = self.kd_ratio * kd + (1.0 - self.kd_ratio) * ce
        metrics = {"kd_loss": kd.detach(), "ce_loss": ce.detach()}
        return LossOutput(loss, metrics, aux_loss=router_aux_loss(model, router_logits, batch))


def shared_vocab(
    student: nn.Module, teacher: nn.Module, tokenizer_size: int, log=print
) -> int | None:
    """None when both heads have the same rows; else the tokenizer's size, when both heads
    cover it (one tokenizer, vocabularies padded differently, as Qwen2.5 0.5B's 151936 and
    7B's 152064 rows): the padding rows, which no token id reaches, are left out of both
    distributions. A head smaller than the tokenizer is refused."""
    student_rows = student.lm_head.weight.shape[0]
    teacher_rows = teacher.lm_head.weight.shape[0]
    if student_rows == teacher_rows:
        return None
    if min(student_rows, teacher_rows) < tokenizer_size:
        raise ValueError(
            f"student lm_head.weight has {student_rows} rows but teacher lm_head.weight has "
            f"{teacher_rows}, and the tokenizer has {tokenizer_size} ids: distillation needs "
            "one tokenizer that both models embed"
        )
    log(
        f"student and teacher heads have {student_rows} and {teacher_rows} rows: distilling "
        f"over the tokenizer's {tokenizer_size} ids"
    )
    return tokenizer_size
