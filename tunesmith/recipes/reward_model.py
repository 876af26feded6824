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

from omegaconf import DictConfig

from tunesmith.config import instantiate
from tunesmith.data import collate_preference
from tunesmith.training import setup
from tunesmith.training.loop import (
    LOOP_KEYS,
    LOOP_RUNTIME_ARGS,
    LOOP_RUNTIME_KWARGS,
    fit_from_config,
    run_main,
)
from tunesmith.training.objectives.ranking import PairwiseRanking, scoring_pad_id
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
    pad_id = scoring_pad_id(tokenizer, dataset, val_dataset or [])
    collate = partial(collate_preference, pad_id=pad_id)

    # -- the scoring model, saved with the pad token it scores past
    model = setup.build_policy(cfg, ctx, tokenizer)
    model.spec = model.spec.replace(pad_token_id=pad_id)
    model = parallelize(model, ctx, cfg)  # checkpointing, compile, FSDP2
    objective = PairwiseRanking(setup.compiled_loss(cfg, instantiate(cfg.loss)))
    setup.memory_plan(cfg, ctx, model, dataset, collate, log, objective="ranking (reward_model)")

    source = DatasetSource.build(dataset, collate, LoopSettings.from_config(cfg), ctx)
    fit_from_config(
        cfg,
        ctx,
        model=model,
        objective=objective,
        source=source,
        val_dataset=val_dataset,
        name="reward_model",
    )
