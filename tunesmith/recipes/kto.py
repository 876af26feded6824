"""KTO: learning from thumbs up / thumbs down, full fine-tuning or LoRA, one device or many.

    tunesmith run kto --config tiny model_dir=... dataset.source=rated.jsonl
    tunesmith run kto --config tiny ... loss.desirable_weight=1.33

Kahneman-Tversky Optimisation (Ethayarajh et al. 2024) trains on unpaired rated completions
(``{prompt, completion, label: true|false}`` rows, or preference pairs split into a desirable
and an undesirable row: :mod:`tunesmith.data.unpaired_dataset`). Per optimizer step:

1. the KL estimate ``z``: the policy's and the reference's log-probs of each completion's KL
   row (its prompt with another row's completion), ``mean(π - ref)`` over all micro-batches
   and data-parallel ranks of the step, detached and clamped at 0
   (:meth:`~tunesmith.training.objectives.unpaired.KTOObjective.prepare_step`);
2. per micro-batch, the policy's and the reference's summed log-probs of each completion
   (the reference as DPO's: ``reference_model``, the policy with its adapters disabled, or a
   frozen copy; ``precompute_reference: true`` computes the reference's log-probs of every
   completion and KL row once, before training);
3. :class:`~tunesmith.modules.losses.KTOLoss` per completion, summed; the trainer divides by
   the step's completions, so the update is one big batch's mean.

At start the class balance is checked: ``desirable_weight·n_D / (undesirable_weight·n_U)``
outside ``[1, 4/3]`` logs a warning with the weights that would fix it.

Logged per step: ``kl``, ``rewards/chosen``, ``rewards/rejected``, ``rewards/margins``,
``logps/chosen``, ``logps/rejected`` (means over the step's completions of that label),
``count/chosen``, ``count/rejected``; with a validation set the same with a ``val_`` prefix.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

from omegaconf import DictConfig

from tunesmith.config import instantiate
from tunesmith.data.unpaired_dataset import collate_unpaired, label_counts
from tunesmith.modules.losses import KTOLoss
from tunesmith.recipes.dpo import KEYS, RULES, RUNTIME_ARGS, RUNTIME_KWARGS
from tunesmith.training import setup
from tunesmith.training.loop import fit_from_config, run_main
from tunesmith.training.objectives.unpaired import (
    KTOObjective,
    imbalance_warning,
    precompute_unpaired,
)
from tunesmith.training.parallel.distributed import DistributedContext
from tunesmith.training.parallelize import parallelize
from tunesmith.training.settings import LoopSettings
from tunesmith.training.sources import DatasetSource

__all__ = ["KEYS", "RULES", "RUNTIME_ARGS", "RUNTIME_KWARGS", "check_balance", "main", "train"]


def main(cfg: DictConfig) -> None:
    run_main(train, cfg, KEYS, RULES)


def train(cfg: DictConfig, ctx: DistributedContext) -> None:
    log = setup.rank_zero_log(ctx)

    # -- data: rated completions rendered through the chat template, each with its KL row
    tokenizer = setup.load_tokenizer(cfg)
    dataset, val_dataset = setup.datasets_for(cfg, tokenizer, log)
    collate = partial(collate_unpaired, pad_id=setup.pad_id(tokenizer))
    loss_fn = instantiate(cfg.loss)
    check_balance(dataset, loss_fn, log)

    # -- policy and reference (taken before the policy moves, as dpo's)
    model = setup.build_policy(cfg, ctx, tokenizer, on_device=False)
    chunk_size = int(cfg.get("logprob_chunk_size", 1024))
    reference = setup.reference_policy(cfg, ctx, model, log, tokenizer=tokenizer)
    model = parallelize(model.to(ctx.device), ctx, cfg)  # checkpointing, compile, FSDP2
    if cfg.get("precompute_reference", False):
        log("precomputing the reference log-probabilities of every completion and KL row")
        precompute = partial(precompute_unpaired, reference, collate=collate, ctx=ctx,
                             batch_size=cfg.batch_size, chunk_size=chunk_size)  # fmt: skip
        dataset = precompute(dataset)
        val_dataset = None if val_dataset is None else precompute(val_dataset)
        reference = None  # a separate reference model is freed here
    objective = KTOObjective(setup.compiled_loss(cfg, loss_fn), reference, chunk_size, ctx)
    setup.memory_plan(cfg, ctx, model, dataset, collate, log, objective="rated completions (kto)")

    source = DatasetSource.build(dataset, collate, LoopSettings.from_config(cfg), ctx)
    fit_from_config(
        cfg,
        ctx,
        model=model,
        objective=objective,
        source=source,
        val_dataset=val_dataset,
        name="kto",
    )


def check_balance(dataset: Sequence[Any], loss_fn: Any, log: Callable[[str], None]) -> None:
    """Refuse a loss other than :class:`~tunesmith.modules.losses.KTOLoss`; log the training
    set's label counts, and KTO's class-imbalance warning when the
    weighted ratio is outside ``[1, 4/3]`` (see
    :func:`~tunesmith.training.objectives.unpaired.imbalance_warning`)."""
    if not isinstance(loss_fn, KTOLoss):
        raise ValueError(
            f"loss: the kto recipe needs tunesmith.modules.losses.KTOLoss, got "
            f"{type(loss_fn).__name__}"
        )
    desirable, undesirable = label_counts(dataset)
    log(f"kto: {desirable} desirable and {undesirable} undesirable completions")
    weights = (loss_fn.desirable_weight, loss_fn.undesirable_weight)
    if warning := imbalance_warning(desirable, undesirable, *weights):
        log(warning)
