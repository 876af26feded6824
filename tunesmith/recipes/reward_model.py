"""Reward-model training: a scalar ``score`` head on a decoder, trained with the
Bradley-Terry loss on preference pairs; saved as a HF ``*ForSequenceClassification`` folder.

    tunesmith run reward_model --config tiny model_dir=... dataset.source=pairs.jsonl

Per micro-batch of ``B`` pairs (``2B`` rows: chosen then rejected, from
:func:`~tunesmith.data.collate.collate_preference`), the model scores each sequence at its
last real token (as transformers' sequence classifiers do) and the loss is
``Σ -log σ(score_chosen - score_rejected - margin)``; :func:`~tunesmith.training.loop.fit`
divides it by the number of pairs on all ranks. Logged (means over pairs): ``accuracy``
(chosen scored above rejected), ``margin`` (score difference), ``scores/chosen``,
``scores/rejected``.

The tokenizer's pad token is written as the checkpoint's ``pad_token_id``: transformers
scores the last token that is not padding, so no sequence may end with it (the recipe
refuses such a pad token, e.g. pad = eos when sequences end with eos).
"""

from __future__ import annotations

from functools import partial

import torch
from omegaconf import DictConfig
from torch import nn
from torch.utils.data import Subset

from tunesmith.config import instantiate
from tunesmith.data import collate_preference
from tunesmith.training import setup
from tunesmith.training.forward import router_aux_loss
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
from tunesmith.training.settings import LOOP_RULES, MODEL_RULES, LoopSettings
from tunesmith.training.sources import DatasetSource

RUNTIME_ARGS = LOOP_RUNTIME_ARGS
RUNTIME_KWARGS = LOOP_RUNTIME_KWARGS
KEYS = [*LOOP_KEYS, *setup.MODEL_KEYS]
RULES = {**LOOP_RULES, **MODEL_RULES}  # what each top-level value may be, checked up front


def main(cfg: DictConfig) -> None:
    run_main(train, cfg, KEYS, RULES)


def train(cfg: DictConfig, ctx: DistributedContext) -> None:
    log = setup.rank_zero_log(ctx)

    # -- data: pairs; no sequence may end with the pad token (see the module docs)
    tokenizer = setup.load_tokenizer(cfg)
    dataset, val_dataset = setup.datasets_for(cfg, tokenizer, log)
    pad_id = _scoring_pad_id(tokenizer, dataset, val_dataset or [])
    collate = partial(collate_preference, pad_id=pad_id)

    # -- the scoring model, saved with the pad token it scores past
    model = setup.build_policy(cfg, ctx, tokenizer)
    model.spec = model.spec.replace(pad_token_id=pad_id)
    model = parallelize(model, ctx, cfg)  # checkpointing, compile, FSDP2
    objective = PairwiseRanking(setup.compiled_loss(cfg, instantiate(cfg.loss)))
    setup.memory_plan(cfg, ctx, model, dataset, collate, log, objective="ranking (reward_model)")

    source = DatasetSource.build(dataset, collate, LoopSettings.from_config(cfg), ctx)
    fit_from_config(cfg, ctx, model=model, objective=objective, source=source,
                    val_dataset=val_dataset, name="reward_model")  # fmt: skip


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
            batch["input_ids"], position_ids=batch["position_ids"],
            attention_mask=batch["attention_mask"], output_router_logits=True,
        )  # fmt: skip
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


def _scoring_pad_id(tokenizer, *datasets) -> int:
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
