"""The reward model's objective: pairs scored by a reward model (a decoder with a score head
on the last non-pad token), ranked by a Bradley-Terry loss.

Example::

    >>> import torch
    >>> from tunesmith.modules.losses import BradleyTerryLoss
    >>> objective = PairwiseRanking(BradleyTerryLoss())
    >>> objective.unit, objective.units({"input_ids": torch.zeros(4, 3, dtype=torch.long)})
    ('pairs', 2)
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import Subset

from tunesmith.training.forward import router_aux_loss
from tunesmith.training.trainer import LossOutput

__all__ = ["PairwiseRanking", "scoring_pad_id"]


class PairwiseRanking:
    """Summed Bradley-Terry loss of a batch of pairs scored by a reward model, plus the MoE
    load-balancing loss (a mean per micro-batch) for a reward model with an MoE body."""

    unit = "pairs"

    def __init__(self, loss_fn: nn.Module) -> None:
        self.loss_fn = loss_fn

    def units(self, batch: dict[str, torch.Tensor]) -> int:
        return batch["input_ids"].shape[0] // 2

    def __call__(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> LossOutput:
        scores, router_logits = model(
            batch["input_ids"],
            position_ids=batch["position_ids"],
            attention_mask=batch["attention_mask"],
            output_router_logits=True,
        )
        scores = scores[:, 0]
        half = scores.shape[0] // 2
        chosen, rejected = scores[:half], scores[half:]
        losses = self.loss_fn(chosen, rejected)
        margin = (chosen - rejected).detach()
        metrics = {
            "accuracy": (margin > 0).float().sum(), "margin": margin.sum(),
            "scores/chosen": chosen.detach().sum(), "scores/rejected": rejected.detach().sum(),
        }  # fmt: skip
        return LossOutput(
            losses.sum(), metrics, aux_loss=router_aux_loss(model, router_logits, batch)
        )


def scoring_pad_id(tokenizer, *datasets) -> int:
    """The tokenizer's pad id, which the checkpoint records; refused when there is none or
    when a sequence of ``datasets`` ends with it."""
    if tokenizer.pad_id is None:
        raise ValueError(
            f"tokenizer {getattr(tokenizer, 'name', '')} has no pad token: a reward model "
            "checkpoint needs pad_token_id (transformers scores the last non-pad token)"
        )
    for data in datasets:
        _check_pad_not_trained(data, tokenizer.pad_id)
    return tokenizer.pad_id


def _check_pad_not_trained(dataset, pad_id: int) -> None:
    """The scored token (the last of each sequence) must not be the pad token, or transformers
    would score an earlier token than the one trained here."""
    for index in range(len(dataset)):
        sample = dataset[index]
        for side in ("chosen", "rejected"):
            if sample[f"{side}_input_ids"][-1] == pad_id:
                raise ValueError(
                    f"{_source_row(dataset, index)}: the {side} sequence ends with the pad token "
                    f"(id {pad_id}); transformers would score an earlier token. Use a "
                    "tokenizer whose pad token differs from the end-of-turn/eos token"
                )


def _source_row(dataset, index: int) -> str:
    """``"<source>: row <r>"``, the source row (0-based) of sample ``index`` of a dataset,
    possibly a training split (:class:`~torch.utils.data.Subset`) of one."""
    while isinstance(dataset, Subset):
        dataset, index = dataset.dataset, dataset.indices[index]
    rows = getattr(dataset, "row_indices", None)
    return f"{getattr(dataset, 'source', 'dataset')}: row {index if rows is None else rows[index]}"
