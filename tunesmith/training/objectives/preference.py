"""DPO's objective: the summed preference loss of a batch of pairs, and the reference
log-probabilities it compares with (on the fly from a frozen policy, or precomputed once for
the whole dataset).

A micro-batch of ``B`` pairs is ``2B`` rows (chosen then rejected, from
:func:`~tunesmith.data.collate.collate_preference`); the loss is any of
:mod:`tunesmith.modules.losses`' preference losses (DPO, IPO, hinge, SimPO, ORPO, CPO).

Example::

    >>> import torch
    >>> from tunesmith.modules.losses import DPOLoss
    >>> objective = PreferenceObjective(DPOLoss(), reference=None)
    >>> objective.unit, objective.units({"input_ids": torch.zeros(6, 4, dtype=torch.long)})
    ('pairs', 3)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from tunesmith.data import collate_preference
from tunesmith.modules.losses import PairLogps
from tunesmith.training.forward import router_aux_loss, sequence_logps
from tunesmith.training.parallel.distributed import DistributedContext
from tunesmith.training.setup import FrozenPolicy
from tunesmith.training.trainer import LossOutput

__all__ = [
    "REFERENCE_KEYS",
    "PreferenceObjective",
    "WithReference",
    "collate_with_reference",
    "pair_logps",
    "pairs_of",
    "precompute",
    "reference_table",
]

REFERENCE_KEYS = ("reference_chosen", "reference_rejected")


class PreferenceObjective:
    """Summed preference loss of a batch of pairs, and the logged rewards and log-probs."""

    unit = "pairs"
    context_parallel = "rows"  # sequence_logps adds the cp ranks' shares: all hold each pair

    def __init__(
        self,
        loss_fn: nn.Module,
        reference: Callable[[Mapping[str, torch.Tensor]], PairLogps] | None,
        chunk_size: int = 1024,
    ) -> None:
        self.loss_fn = loss_fn
        self.reference = reference
        self.chunk_size = chunk_size

    def units(self, batch: Mapping[str, torch.Tensor]) -> int:
        return batch["input_ids"].shape[0] // 2

    def __call__(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> LossOutput:
        sums, counts, router_logits = sequence_logps(model, batch, chunk_size=self.chunk_size)
        policy = pairs_of(sums, counts)
        reference = None
        if self.loss_fn.needs_reference:
            reference = self._reference(batch, policy)
        out = self.loss_fn(policy, reference)
        chosen, rejected = out.chosen_rewards, out.rejected_rewards
        metrics = {
            "rewards/chosen": chosen.sum(), "rewards/rejected": rejected.sum(),
            "rewards/accuracy": (chosen > rejected).float().sum(),
            "rewards/margin": (chosen - rejected).sum(),
            "logps/chosen": policy.chosen.detach().sum(),
            "logps/rejected": policy.rejected.detach().sum(),
        }  # fmt: skip
        if out.nll_loss is not None:  # the SFT term of ORPO, CPO
            metrics["nll_loss"] = out.nll_loss.sum()
        aux = router_aux_loss(model, router_logits, batch)
        return LossOutput(out.losses.sum(), metrics, aux_loss=aux)

    def _reference(self, batch: Mapping[str, torch.Tensor], policy: PairLogps) -> PairLogps:
        if "reference_chosen" in batch:  # precomputed
            return PairLogps(
                batch["reference_chosen"],
                batch["reference_rejected"],
                policy.chosen_tokens,
                policy.rejected_tokens,
            )
        if self.reference is None:
            raise ValueError(f"{type(self.loss_fn).__name__} needs reference log-probabilities")
        return self.reference(batch)


def pair_logps(
    reference: FrozenPolicy, batch: Mapping[str, torch.Tensor], *, chunk_size: int
) -> PairLogps:
    with reference() as model:
        sums, counts, _ = sequence_logps(model, batch, chunk_size=chunk_size)
    return pairs_of(sums, counts)


def pairs_of(sums: torch.Tensor, counts: torch.Tensor) -> PairLogps:
    """Rows ``0..B-1`` are the chosen responses, ``B..2B-1`` the rejected ones."""
    half = sums.shape[0] // 2
    return PairLogps(sums[:half], sums[half:], counts[:half], counts[half:])


def collate_with_reference(
    batch: Sequence[Mapping[str, Any]], pad_id: int
) -> dict[str, torch.Tensor]:
    """:func:`~tunesmith.data.collate.collate_preference`, passing precomputed reference log-probs through as
    ``[B]`` float tensors when the samples carry them."""
    pairs = [{k: v for k, v in s.items() if k not in REFERENCE_KEYS} for s in batch]
    out = collate_preference(pairs, pad_id=pad_id)
    if REFERENCE_KEYS[0] in batch[0]:
        for key in REFERENCE_KEYS:
            out[key] = torch.tensor([float(s[key]) for s in batch], dtype=torch.float32)
    return out


class WithReference(Dataset):
    """``dataset``'s items with their reference log-probs added under ``keys`` (pairs:
    ``reference_chosen``, ``reference_rejected``), one column of ``logps`` per key."""

    def __init__(
        self,
        dataset: Sequence[Mapping[str, Any]],
        logps: torch.Tensor,
        keys: Sequence[str] = REFERENCE_KEYS,
    ) -> None:
        self.dataset = dataset
        self.logps = logps  # [len(dataset), len(keys)]
        self.keys = tuple(keys)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {**self.dataset[index], **dict(zip(self.keys, self.logps[index].tolist()))}


def precompute(
    reference: Callable[[Mapping[str, torch.Tensor]], PairLogps],
    dataset: Sequence[Any],
    collate: Callable[[list[Any]], dict[str, torch.Tensor]],
    ctx: DistributedContext,
    batch_size: int,
) -> WithReference:
    """Every pair's reference log-probs (see :func:`reference_table`)."""

    def columns(batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        logps = reference(batch)
        return torch.stack([logps.chosen, logps.rejected], dim=1)

    return WithReference(dataset, reference_table(columns, dataset, collate, ctx, batch_size))


def reference_table(
    columns: Callable[[Mapping[str, torch.Tensor]], torch.Tensor],
    dataset: Sequence[Any],
    collate: Callable[[list[Any]], dict[str, torch.Tensor]],
    ctx: DistributedContext,
    batch_size: int,
) -> torch.Tensor:
    """``[len(dataset), k]``: the ``k`` columns ``columns(batch)`` gives for each item, each
    data-parallel rank computing its share (every rank runs the same number of batches, as a
    sharded reference needs) and all ranks gathering all over the dp group."""
    sampler = DistributedSampler(dataset, ctx.dp_size, ctx.dp_rank, shuffle=False)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler, collate_fn=collate)
    mine = []
    for mb in loader:
        mine.append(columns({k: v.to(ctx.device) for k, v in mb.items()}).float())
    mine_t = torch.cat(mine).to(ctx.device)
    indices = torch.tensor(list(iter(sampler)), device=ctx.device)
    if ctx.dp_size > 1:
        every = [torch.empty_like(mine_t) for _ in range(ctx.dp_size)]
        dist.all_gather(every, mine_t, group=ctx.dp_group)
        all_indices = [torch.empty_like(indices) for _ in range(ctx.dp_size)]
        dist.all_gather(all_indices, indices, group=ctx.dp_group)
        mine_t, indices = torch.cat(every), torch.cat(all_indices)
    table = torch.empty(len(dataset), mine_t.shape[1])
    table[indices.cpu()] = mine_t.cpu()  # padded repeats write the same value twice
    return table
