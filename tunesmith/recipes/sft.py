"""Supervised fine-tuning: one recipe for one device or many (FSDP2), full fine-tuning.

    tunesmith run sft --config tiny                         # one process
    tunesmith run sft --config qwen3_0_6b --nproc-per-node 8  # eight ranks, FSDP2

The recipe: tokenise the dataset (optionally pack it), build the model (activation
checkpointing, compile, FSDP2 when world > 1), estimate the memory of the longest batch
(which ``preflight: true`` also measures), then :func:`~tunesmith.training.loop.fit` the
objective :class:`~tunesmith.training.objectives.TokenCrossEntropy`: cross-entropy summed over
the trained tokens, divided by the trained tokens of all micro-batches on all ranks, so the
update equals one big batch's token-mean loss.
"""

from __future__ import annotations

from omegaconf import DictConfig

from tunesmith.config import instantiate
from tunesmith.training import setup
from tunesmith.training.loop import (
    LOOP_KEYS,
    LOOP_RUNTIME_ARGS,
    LOOP_RUNTIME_KWARGS,
    fit_from_config,
    run_main,
)
from tunesmith.training.objectives import TokenCrossEntropy
from tunesmith.training.parallel.distributed import DistributedContext
from tunesmith.training.parallelize import parallelize
from tunesmith.training.rules import flag
from tunesmith.training.settings import LOOP_RULES, MODEL_RULES, LoopSettings
from tunesmith.training.sources import DatasetSource

# Arguments the recipe passes at run time (for `tunesmith validate`).
RUNTIME_ARGS = LOOP_RUNTIME_ARGS
RUNTIME_KWARGS = LOOP_RUNTIME_KWARGS
KEYS = [*LOOP_KEYS, *setup.MODEL_KEYS, "packed"]
RULES = {**LOOP_RULES, **MODEL_RULES, "packed": flag()}  # each top-level value, checked up front


def main(cfg: DictConfig) -> None:
    run_main(train, cfg, KEYS, RULES)


def train(cfg: DictConfig, ctx: DistributedContext) -> None:
    log = setup.rank_zero_log(ctx)

    # -- data
    tokenizer = setup.load_tokenizer(cfg)
    dataset, val_dataset = setup.datasets_for(cfg, tokenizer, log)
    # packed: true -> packs, of the validation set too (evaluated with the same collate)
    dataset, val_dataset, collate = setup.sft_batches(cfg, dataset, val_dataset, tokenizer)
    source = DatasetSource.build(dataset, collate, LoopSettings.from_config(cfg), ctx)

    # -- model and loss
    model = setup.build_policy(cfg, ctx, tokenizer)
    loss_fn = instantiate(cfg.loss)
    model = parallelize(model, ctx, cfg)  # checkpointing, compiled layers, FSDP2
    loss_fn = setup.compiled_loss(cfg, loss_fn)
    objective = TokenCrossEntropy(loss_fn)
    plan = setup.memory_plan(cfg, ctx, model, dataset, collate, log, loss_fn=loss_fn)

    # -- train: per step, the token-mean loss of all micro-batches on all ranks
    fit_from_config(
        cfg,
        ctx,
        model=model,
        objective=objective,
        source=source,
        val_dataset=val_dataset,
        name="sft",
        memory_plan=plan,
    )
