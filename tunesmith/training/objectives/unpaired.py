"""KTO's objective: the summed loss of rated completions, with the step's KL estimate.

A micro-batch is ``B`` rated completions (from
:func:`~tunesmith.data.unpaired_dataset.collate_unpaired`): the training rows, their labels
(``desirable``) and each row's KL row (its prompt with another row's completion, ``kl_*``).
KTO's reference point ``z`` is the estimate of ``KL(π‖ref)``: the mean of ``π - ref`` over the
KL rows, detached and clamped at 0. It is computed once per optimizer step over all of the
step's micro-batches on all data-parallel ranks (:meth:`KTOObjective.prepare_step`, the
trainer's hook for step-wide quantities), so gradient accumulation equals one big batch and
``n`` ranks equal one process; TRL computes it per micro-batch, averaged over ranks (the same
for one micro-batch per step). The reference's log-probs come from a frozen policy (as DPO's:
``reference_model``, the adapters off, or a frozen copy) or were precomputed for the dataset
(``reference_logps``, ``reference_kl_logps`` columns: :func:`precompute_unpaired`).

Logged (sums the trainer divides by the step's completions, scaled so that the result is):

- ``kl``: the step's KL estimate ``z``;
- ``rewards/chosen``, ``logps/chosen``: the mean over the step's *desirable* completions (all
  micro-batches and ranks) of ``β·(π - ref)`` and ``π``; ``rewards/rejected``,
  ``logps/rejected``: the same over the undesirable ones; each is left out of a step with no
  completion of its label (as TRL does), and ``rewards/margins`` (chosen minus rejected) of
  a step without both;
- ``count/chosen``, ``count/rejected``: the step's numbers of desirable and undesirable
  completions.

Validation batches are prepared one at a time: their ``val_`` metrics are the means of each
batch's values weighted by its completions (``val_kl``: each batch's own estimate, as TRL's
evaluation).

Example::

    >>> from tunesmith.modules.losses import KTOLoss
    >>> objective = KTOObjective(KTOLoss(), reference=None)
    >>> objective.unit, objective.units({"input_ids": torch.zeros(6, 4, dtype=torch.long)})
    ('completions', 6)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tunesmith.modules.losses import KTOLoss, UnpairedLogps
from tunesmith.training.forward import router_aux_loss, sequence_logps
from tunesmith.training.objectives.preference import WithReference, reference_table
from tunesmith.training.parallel.distributed import DistributedContext, all_reduce_sum
from tunesmith.training.setup import FrozenPolicy
from tunesmith.training.trainer import LossOutput

__all__ = [
    "KL_PREFIX",
    "REFERENCE_COLUMNS",
    "KTOObjective",
    "imbalance_warning",
    "kl_rows",
    "precompute_unpaired",
    "row_logps",
]

KL_PREFIX = "kl_"
REFERENCE_COLUMNS = ("reference_logps", "reference_kl_logps")
ROW_KEYS = ("input_ids", "labels", "attention_mask", "position_ids")


@dataclass
class _Step:
    """What every micro-batch of a step shares: the KL estimate and the global counts."""

    kl: torch.Tensor
    rows: float
    desirable: float

    @property
    def undesirable(self) -> float:
        return self.rows - self.desirable


def kl_rows(batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The KL rows of a collated batch as a batch of their own.

    >>> kl_rows({"kl_input_ids": torch.ones(1, 2), "input_ids": torch.zeros(1, 3)})
    {'input_ids': tensor([[1., 1.]])}
    """
    return {k: batch[KL_PREFIX + k] for k in ROW_KEYS if KL_PREFIX + k in batch}


def row_logps(
    policy: FrozenPolicy, batch: Mapping[str, torch.Tensor], *, chunk_size: int
) -> torch.Tensor:
    """The frozen ``policy``'s summed log-probs of ``batch``'s rows (``[B]``, no gradient)."""
    with policy() as model:
        sums, _, _ = sequence_logps(model, batch, chunk_size=chunk_size)
    return sums


class KTOObjective:
    """Summed KTO loss of rated completions; the step's KL estimate from
    :meth:`prepare_step` (see the module docs), summed over ``ctx``'s data-parallel group
    (None: one process on the CPU)."""

    unit = "completions"

    def __init__(
        self,
        loss_fn: KTOLoss,
        reference: FrozenPolicy | None,
        chunk_size: int = 1024,
        ctx: DistributedContext | None = None,
    ) -> None:
        self.loss_fn = loss_fn
        self.reference = reference
        self.chunk_size = chunk_size
        self.device = ctx.device if ctx is not None else torch.device("cpu")
        self.group = ctx.dp_group if ctx is not None else None
        self._step: _Step | None = None

    def units(self, batch: Mapping[str, torch.Tensor]) -> int:
        return batch["input_ids"].shape[0]

    def prepare_step(
        self, model: nn.Module, micro_batches: Sequence[Mapping[str, Any]], counted: bool = True
    ) -> None:
        """The KL estimate and label counts of the step (a collective over the dp group);
        ``counted=False``: forwards run (a sharded model needs them on every rank) but add
        nothing."""
        shift, rows, desirable = 0.0, 0, 0
        for mb in micro_batches:
            batch = {k: v.to(self.device) for k, v in mb.items()}
            kl_batch = kl_rows(batch)
            policy, _, _ = sequence_logps(model, kl_batch, chunk_size=self.chunk_size)
            reference = self._reference(batch, kl_batch, REFERENCE_COLUMNS[1])
            if counted:
                shift = shift + (policy.double() - reference.double()).sum()
                rows += len(policy)
                desirable += int(mb["desirable"].sum())
        local = torch.stack(
            [
                torch.as_tensor(v, dtype=torch.float64, device=self.device)
                for v in (shift, rows, desirable)
            ]
        )
        shift, rows_all, desirable_all = all_reduce_sum(local, self.device, self.group).tolist()
        kl = torch.tensor(shift / max(rows_all, 1.0), dtype=torch.float32, device=self.device)
        self._step = _Step(kl, rows_all, desirable_all)

    def __call__(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> LossOutput:
        if self._step is None:  # called without the trainer (a preflight): this batch alone
            with torch.no_grad():
                self.prepare_step(model, [batch])
        step = self._step
        sums, counts, router_logits = sequence_logps(model, batch, chunk_size=self.chunk_size)
        desirable = batch["desirable"].to(torch.bool)
        reference = self._reference(batch, batch, REFERENCE_COLUMNS[0])
        out = self.loss_fn(UnpairedLogps(sums, counts, desirable), reference, step.kl)
        metrics = {"kl": out.kl * len(sums), "count/chosen": desirable.sum() * step.rows,
                   "count/rejected": (~desirable).sum() * step.rows}  # fmt: skip
        logps = sums.detach()
        for name, mask, count in (("chosen", desirable, step.desirable),
                                  ("rejected", ~desirable, step.undesirable)):  # fmt: skip
            if count > 0:  # means over the step's completions of that label
                scale = step.rows / count
                metrics[f"rewards/{name}"] = (out.rewards * mask).sum() * scale
                metrics[f"logps/{name}"] = (logps * mask).sum() * scale
        if step.desirable > 0 and step.undesirable > 0:
            metrics["rewards/margins"] = metrics["rewards/chosen"] - metrics["rewards/rejected"]
        aux = router_aux_loss(model, router_logits, batch)
        return LossOutput(out.losses.sum(), metrics, aux_loss=aux)

    def _reference(
        self, batch: Mapping[str, torch.Tensor], rows: Mapping[str, torch.Tensor], column: str
    ) -> torch.Tensor:
        """The reference's log-probs of ``rows``: precomputed (``batch[column]``) or now."""
        if column in batch:
            return batch[column]
        if self.reference is None:
            raise ValueError("KTOObjective needs a reference policy or precomputed log-probs")
        return row_logps(self.reference, rows, chunk_size=self.chunk_size)


def precompute_unpaired(
    reference: FrozenPolicy,
    dataset: Sequence[Any],
    collate: Callable[[list[Any]], dict[str, torch.Tensor]],
    ctx: DistributedContext,
    batch_size: int,
    chunk_size: int = 1024,
) -> WithReference:
    """Every completion's and every KL row's reference log-probs, once, added to the items
    as ``reference_logps`` and ``reference_kl_logps`` (see
    :func:`~tunesmith.training.objectives.preference.reference_table`)."""

    def columns(batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        main = row_logps(reference, batch, chunk_size=chunk_size)
        kl = row_logps(reference, kl_rows(batch), chunk_size=chunk_size)
        return torch.stack([main, kl], dim=1)

    table = reference_table(columns, dataset, collate, ctx, batch_size)
    return WithReference(dataset, table, REFERENCE_COLUMNS)


def imbalance_warning(
    desirable: int, undesirable: int, desirable_weight: float, undesirable_weight: float
) -> str | None:
    """KTO's class-imbalance rule of thumb (Ethayarajh et al. 2024, Eq. 8):
    ``desirable_weight·n_D / (undesirable_weight·n_U)`` should lie in ``[1, 4/3]``. A
    warning naming the counts and the weights that would fix it, or None.

    >>> imbalance_warning(10, 10, 1.0, 1.0) is None
    True
    >>> print(imbalance_warning(10, 40, 1.0, 1.0))  # doctest: +NORMALIZE_WHITESPACE
    warning: KTO class balance: 10 desirable and 40 undesirable completions with
    desirable_weight=1.0, undesirable_weight=1.0 give a weighted ratio 0.25, outside [1, 4/3]
    (Ethayarajh et al. 2024, Eq. 8); set desirable_weight in [4, 5.333] or undesirable_weight
    in [0.188, 0.25]
    """
    if desirable == 0 or undesirable == 0:
        return None  # one label only: no ratio to balance
    ratio = desirable_weight * desirable / (undesirable_weight * undesirable)
    if 1.0 <= ratio <= 4 / 3:
        return None
    fix_d = _inward(undesirable_weight * undesirable / desirable)  # ratio 1 .. 4/3
    fix_u = _inward(desirable_weight * desirable / undesirable * 3 / 4)
    return (
        f"warning: KTO class balance: {desirable} desirable and {undesirable} undesirable "
        f"completions with desirable_weight={desirable_weight}, undesirable_weight="
        f"{undesirable_weight} give a weighted ratio {ratio:.3g}, outside [1, 4/3] "
        f"(Ethayarajh et al. 2024, Eq. 8); set desirable_weight in {fix_d} or "
        f"undesirable_weight in {fix_u}"
    )


def _inward(low: float) -> str:
    """``[low, low·4/3]`` rounded to 3 decimals inwards, so both ends are in range.

    >>> _inward(0.5), _inward(1.5)
    ('[0.5, 0.666]', '[1.5, 2]')
    """
    high = low * 4 / 3
    return f"[{math.ceil(low * 1000 - 1e-9) / 1000:g}, {math.floor(high * 1000 + 1e-9) / 1000:g}]"
