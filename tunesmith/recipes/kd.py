"""Knowledge distillation: a student learns a teacher's token distributions (same tokenizer),
mixed with the ordinary cross-entropy on the labels; full fine-tuning or LoRA, one device or many.

    tunesmith run kd --config tiny model_dir=student teacher_dir=teacher dataset.source=chat.jsonl

Per micro-batch of SFT samples (any SFT dataset format, optionally packed):

1. the student's final hidden states (with gradient) and the teacher's (``teacher_model``, in
   eval mode and without gradient, possibly in another dtype such as bf16, and with
   ``teacher_offload: true`` on a GPU kept in CPU memory between its layers' forwards);
2. ``loss`` (:class:`~tunesmith.modules.losses.KDLoss`: forward KL, reverse KL, symmetric,
   or Jensen-Shannon, at a temperature) projects both through their heads chunk by chunk, so
   the two models' full logits never both exist; it returns the summed divergence and the
   student's summed cross-entropy over the trained tokens;
3. the objective ``kd_ratio * divergence + (1 - kd_ratio) * cross-entropy``, which
   :func:`~tunesmith.training.loop.fit` divides by the trained tokens of all micro-batches on
   all ranks.

Logged per step: ``loss``, ``kd_loss`` and ``ce_loss`` (token means), and with a validation
set ``val_loss``, ``val_kd_loss`` (the student's divergence from the teacher on held-out data)
and ``val_ce_loss``.
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig
from torch import nn

from tunesmith.config import instantiate
from tunesmith.training import setup
from tunesmith.training.loop import (
    LOOP_KEYS,
    LOOP_RUNTIME_ARGS,
    LOOP_RUNTIME_KWARGS,
    fit_from_config,
    run_main,
)
from tunesmith.training.objectives.distillation import Distillation, shared_vocab
from tunesmith.training.parallel.distributed import DistributedContext
from tunesmith.training.parallelize import parallelize
from tunesmith.training.rules import flag, number, text
from tunesmith.training.settings import LOOP_RULES, MODEL_RULES, LoopSettings
from tunesmith.training.sources import DatasetSource

RUNTIME_ARGS = LOOP_RUNTIME_ARGS
RUNTIME_KWARGS = LOOP_RUNTIME_KWARGS
KEYS = [
    *LOOP_KEYS, *setup.MODEL_KEYS, "teacher_model", "teacher_dir", "teacher_offload", "kd_ratio",
    "packed",
]  # fmt: skip
RULES = {  # what each top-level value may be, checked up front
    **LOOP_RULES, **MODEL_RULES, "teacher_dir": text(), "teacher_offload": flag(),
    "kd_ratio": number(at_least=0, at_most=1), "packed": flag(),
}  # fmt: skip


def main(cfg: DictConfig) -> None:
    run_main(train, cfg, KEYS, RULES)


def train(cfg: DictConfig, ctx: DistributedContext) -> None:
    log = setup.rank_zero_log(ctx)

    # -- data: SFT samples (the teacher sees exactly the student's tokens)
    tokenizer = setup.load_tokenizer(cfg)
    dataset, val_dataset = setup.datasets_for(cfg, tokenizer, log)
    # packed: true -> packs, of the validation set too (evaluated with the same collate)
    dataset, val_dataset, collate = setup.sft_batches(cfg, dataset, val_dataset, tokenizer)

    model, objective = student_and_teacher(cfg, ctx, tokenizer, log)
    setup.memory_plan(cfg, ctx, model, dataset, collate, log, objective="distillation (kd)")

    source = DatasetSource.build(dataset, collate, LoopSettings.from_config(cfg), ctx)
    fit_from_config(
        cfg,
        ctx,
        model=model,
        objective=objective,
        source=source,
        val_dataset=val_dataset,
        name="kd",
    )


def student_and_teacher(
    cfg: DictConfig, ctx: DistributedContext, tokenizer: Any, log: setup.Log
) -> tuple[nn.Module, Distillation]:
    """The student (checkpointing, compile, FSDP2 applied) and the objective holding the frozen
    teacher (``teacher_model``, offloaded with ``teacher_offload``, sharded like the student)
    and the compiled ``loss``; the ``gkd`` recipe's too.

    Example::

        model, objective = student_and_teacher(cfg, ctx, tokenizer, log)
    """
    model = setup.build_policy(cfg, ctx, tokenizer)
    teacher = setup.frozen_model(
        cfg, ctx, "teacher_model", offload=bool(cfg.get("teacher_offload", False))
    )
    vocab = shared_vocab(model, teacher, tokenizer.vocab_size, log)
    model = parallelize(model, ctx, cfg)  # checkpointing, compile, FSDP2
    loss_fn = setup.compiled_loss(cfg, instantiate(cfg.loss))
    objective = Distillation(teacher, loss_fn, float(cfg.get("kd_ratio", 0.5)), vocab_size=vocab)
    return model, objective
