"""Preference optimisation: DPO and its family, full fine-tuning or LoRA, one device or many.

    tunesmith run dpo --config tiny model_dir=... dataset.source=pairs.jsonl
    tunesmith run dpo --config tiny ... loss._component_=tunesmith.modules.losses.SimPOLoss

The loss is a ``_component_`` of :mod:`tunesmith.modules.losses`: DPO (with label
smoothing = cDPO, or reference-free), IPO, hinge (RSO), SimPO, ORPO. Per micro-batch of ``B``
pairs (``2B`` rows: chosen then rejected, from
:func:`~tunesmith.data.collate.collate_preference`):

1. the policy's log-probability of each response, summed over its tokens;
2. the reference's, when the loss needs one, from (in this order of preference):
   ``reference_model`` (a component: e.g. another checkpoint, or bf16), the policy itself with
   its adapters disabled (LoRA: no second copy in memory), or a frozen copy of the policy taken
   before training (full fine-tuning), sharded like the policy and, with
   ``reference_offload: true`` on a GPU, kept in CPU memory between its layers' forwards; with
   ``precompute_reference: true`` they are computed once for the whole dataset before
   training and the reference model is then freed;
3. the loss of each pair, summed; :func:`~tunesmith.training.loop.fit` divides by the number
   of pairs of all micro-batches on all ranks, so the update is one big batch's mean.

Logged per step (means over pairs): ``rewards/chosen``, ``rewards/rejected``,
``rewards/accuracy`` (chosen reward above rejected), ``rewards/margin``, ``logps/chosen``,
``logps/rejected``; with a validation set the same with a ``val_`` prefix.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import DictConfig
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from tunesmith.config import instantiate
from tunesmith.data import collate_preference
from tunesmith.modules.losses import PairLogps
from tunesmith.training import setup
from tunesmith.training.forward import router_aux_loss, sequence_logps
from tunesmith.training.loop import (
    LOOP_KEYS,
    LOOP_RUNTIME_ARGS,
    LOOP_RUNTIME_KWARGS,
    LossOutput,
    fit_from_config,
    run_main,
)
from tunesmith.training.parallel.distributed import DistributedContext
from tunesmith.training.parallelize import parallelize
from tunesmith.training.rules import flag, integer
from tunesmith.training.settings import LOOP_RULES, MODEL_RULES, LoopSettings
from tunesmith.training.sources import DatasetSource

RUNTIME_ARGS = LOOP_RUNTIME_ARGS
RUNTIME_KWARGS = LOOP_RUNTIME_KWARGS
KEYS = [
    *LOOP_KEYS, *setup.MODEL_KEYS, "reference_model", "reference_offload", "precompute_reference",
    "logprob_chunk_size",
]  # fmt: skip
RULES = {  # what each top-level value may be, checked up front
    **LOOP_RULES, **MODEL_RULES, "reference_offload": flag(), "precompute_reference": flag(),
    "logprob_chunk_size": integer(1),
}  # fmt: skip
REFERENCE_KEYS = ("reference_chosen", "reference_rejected")


def main(cfg: DictConfig) -> None:
    run_main(train, cfg, KEYS, RULES)


def train(cfg: DictConfig, ctx: DistributedContext) -> None:
    log = setup.rank_zero_log(ctx)

    # -- data: pairs rendered through the chat template, trained on the responses
    tokenizer = setup.load_tokenizer(cfg)
    dataset, val_dataset = setup.datasets_for(cfg, tokenizer, log)
    collate = partial(collate_with_reference, pad_id=setup.pad_id(tokenizer))

    # -- policy, loss, reference (taken before the policy moves: an offloaded copy stays on
    # the host)
    model = setup.build_policy(cfg, ctx, tokenizer, on_device=False)
    loss_fn = instantiate(cfg.loss)
    chunk_size = int(cfg.get("logprob_chunk_size", 1024))
    reference = None
    if loss_fn.needs_reference:
        reference = reference_logps(cfg, model, ctx, chunk_size, log, tokenizer=tokenizer)
    model = parallelize(model.to(ctx.device), ctx, cfg)  # checkpointing, compile, FSDP2
    if reference is not None and cfg.get("precompute_reference", False):
        log("precomputing the reference log-probabilities of every pair")
        dataset = precompute(reference, dataset, collate, ctx, cfg.batch_size)
        if val_dataset is not None:
            val_dataset = precompute(reference, val_dataset, collate, ctx, cfg.batch_size)
        reference = None  # a separate reference model is freed here
    objective = PreferenceObjective(setup.compiled_loss(cfg, loss_fn), reference, chunk_size)
    setup.memory_plan(cfg, ctx, model, dataset, collate, log, objective="preference pairs (dpo)")

    source = DatasetSource.build(dataset, collate, LoopSettings.from_config(cfg), ctx)
    fit_from_config(cfg, ctx, model=model, objective=objective, source=source,
                    val_dataset=val_dataset, name="dpo")  # fmt: skip


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
        policy = _pairs(sums, counts)
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
        aux = router_aux_loss(model, router_logits, batch)
        return LossOutput(out.losses.sum(), metrics, aux_loss=aux)

    def _reference(self, batch: Mapping[str, torch.Tensor], policy: PairLogps) -> PairLogps:
        if "reference_chosen" in batch:  # precomputed
            return PairLogps(batch["reference_chosen"], batch["reference_rejected"],
                             policy.chosen_tokens, policy.rejected_tokens)  # fmt: skip
        if self.reference is None:
            raise ValueError(f"{type(self.loss_fn).__name__} needs reference log-probabilities")
        return self.reference(batch)


def reference_logps(
    cfg: DictConfig, model: nn.Module, ctx: DistributedContext, chunk_size: int,
    log: Callable[[str], None], tokenizer: Any = None,
) -> Callable[[Mapping[str, torch.Tensor]], PairLogps]:  # fmt: skip
    """The reference policy's pair log-probs as a function of a batch (no gradient): see
    :func:`~tunesmith.training.setup.reference_policy` (call this before sharding)."""
    reference = setup.reference_policy(cfg, ctx, model, log, tokenizer=tokenizer)
    return partial(_pair_logps, reference, chunk_size=chunk_size)


def _pair_logps(
    reference: setup.FrozenPolicy, batch: Mapping[str, torch.Tensor], *, chunk_size: int
) -> PairLogps:
    with reference() as model:
        sums, counts, _ = sequence_logps(model, batch, chunk_size=chunk_size)
    return _pairs(sums, counts)


def _pairs(sums: torch.Tensor, counts: torch.Tensor) -> PairLogps:
    """Rows ``0..B-1`` are the chosen responses, ``B..2B-1`` the rejected ones."""
    half = sums.shape[0] // 2
    return PairLogps(sums[:half], sums[half:], counts[:half], counts[half:])


# -- precomputed reference log-probabilities ---------------------------------------------------


def collate_with_reference(
    batch: Sequence[Mapping[str, Any]], pad_id: int
) -> dict[str, torch.Tensor]:
    """:func:`collate_preference`, passing precomputed reference log-probs through as
    ``[B]`` float tensors when the samples carry them."""
    pairs = [{k: v for k, v in s.items() if k not in REFERENCE_KEYS} for s in batch]
    out = collate_preference(pairs, pad_id=pad_id)
    if REFERENCE_KEYS[0] in batch[0]:
        for key in REFERENCE_KEYS:
            out[key] = torch.tensor([float(s[key]) for s in batch], dtype=torch.float32)
    return out


class WithReference(Dataset):
    """``dataset``'s pairs with their reference log-probs added (``reference_chosen``,
    ``reference_rejected``)."""

    def __init__(self, dataset: Sequence[Mapping[str, Any]], logps: torch.Tensor) -> None:
        self.dataset = dataset
        self.logps = logps  # [len(dataset), 2]

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict[str, Any]:
        chosen, rejected = self.logps[index].tolist()
        return {**self.dataset[index], "reference_chosen": chosen, "reference_rejected": rejected}


def precompute(
    reference: Callable[[Mapping[str, torch.Tensor]], PairLogps], dataset: Sequence[Any],
    collate: Callable[[list[Any]], dict[str, torch.Tensor]], ctx: DistributedContext,
    batch_size: int,
) -> WithReference:  # fmt: skip
    """Every pair's reference log-probs, each data-parallel rank computing its share (every
    rank runs the same number of batches, as a sharded reference needs) and all ranks
    gathering all over the dp group."""
    sampler = DistributedSampler(dataset, ctx.dp_size, ctx.dp_rank, shuffle=False)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler, collate_fn=collate)
    mine = []
    for mb in loader:
        logps = reference({k: v.to(ctx.device) for k, v in mb.items()})
        mine.append(torch.stack([logps.chosen, logps.rejected], dim=1).float())
    mine_t = torch.cat(mine).to(ctx.device)
    indices = torch.tensor(list(iter(sampler)), device=ctx.device)
    if ctx.dp_size > 1:
        every = [torch.empty_like(mine_t) for _ in range(ctx.dp_size)]
        dist.all_gather(every, mine_t, group=ctx.dp_group)
        all_indices = [torch.empty_like(indices) for _ in range(ctx.dp_size)]
        dist.all_gather(all_indices, indices, group=ctx.dp_group)
        mine_t, indices = torch.cat(every), torch.cat(all_indices)
    table = torch.empty(len(dataset), 2)
    table[indices.cpu()] = mine_t.cpu()  # padded repeats write the same value twice
    return WithReference(dataset, table)
