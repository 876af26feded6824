"""Preference optimisation: DPO and its family, full fine-tuning or LoRA, one device or many.

    tunesmith run dpo --config tiny model_dir=... dataset.source=pairs.jsonl
    tunesmith run dpo --config tiny ... loss._component_=tunesmith.modules.losses.SimPOLoss

The loss is a ``_component_`` of :mod:`tunesmith.modules.losses`: DPO (with label
smoothing = cDPO, or reference-free), IPO, hinge (RSO), SimPO, ORPO, CPO. Per micro-batch of
``B`` pairs (``2B`` rows: chosen then rejected, from
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
``logps/rejected``, and for a loss with an SFT term (ORPO, CPO) ``nll_loss``; with a
validation set the same with a ``val_`` prefix.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import torch
from omegaconf import DictConfig
from torch import nn

from tunesmith.config import instantiate
from tunesmith.modules.losses import PairLogps
from tunesmith.training import setup
from tunesmith.training.loop import (
    LOOP_KEYS,
    LOOP_RUNTIME_ARGS,
    LOOP_RUNTIME_KWARGS,
    fit_from_config,
    run_main,
)
from tunesmith.training.objectives.preference import (
    PreferenceObjective,
    collate_with_reference,
    pair_logps,
    precompute,
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
    fit_from_config(
        cfg,
        ctx,
        model=model,
        objective=objective,
        source=source,
        val_dataset=val_dataset,
        name="dpo",
    )


def reference_logps(
    cfg: DictConfig,
    model: nn.Module,
    ctx: DistributedContext,
    chunk_size: int,
    log: Callable[[str], None],
    tokenizer: Any = None,
) -> Callable[[Mapping[str, torch.Tensor]], PairLogps]:
    """The reference policy's pair log-probs as a function of a batch (no gradient): see
    :func:`~tunesmith.training.setup.reference_policy` (call this before sharding)."""
    reference = setup.reference_policy(cfg, ctx, model, log, tokenizer=tokenizer)
    return partial(pair_logps, reference, chunk_size=chunk_size)
