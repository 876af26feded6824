"""On-policy distillation (GKD, Agarwal et al. 2024): a student learns a teacher's token
distributions on completions it samples itself, so it is taught where its own mistakes lead;
full fine-tuning or LoRA, one device or many (FSDP2).

    tunesmith run gkd --config tiny model_dir=student teacher_dir=teacher dataset.source=chat.jsonl

Each optimizer step (:class:`~tunesmith.rl.on_policy_distillation.OnPolicyDistillationSource`):

1. the step's SFT samples (any SFT dataset format, unpacked);
2. with probability ``lmbda`` (a draw keyed by the seed and the step) the student answers
   their prompts (``generation``: temperature, 0 for greedy answers, top-p/k, max new tokens;
   keyed sampling as in ``grpo``); otherwise the dataset's completions are kept, or with ``seq_kd: true`` the
   teacher answers instead; only completion tokens are trained;
3. the ``kd`` recipe's objective on those rows: the frozen teacher (``teacher_model``,
   offloadable, sharded like the student) scores every completion token and ``loss``
   (:class:`~tunesmith.modules.losses.KDLoss`, ``kind: js``: the generalised JSD of GKD, its
   ``js_beta`` TRL's ``beta``: 0 forward KL, 1 reverse KL) is mixed with the cross-entropy as
   ``kd_ratio`` says (1: none, as TRL's GKD), divided by the trained tokens of all ranks.

Teacher and student must share a tokenizer (``teacher_tokenizer`` is compared with the
student's before anything is built). Logged per step: ``loss``, ``kd_loss``, ``ce_loss``,
``on_policy`` (1 or 0), ``completion_length`` / ``completion_length_max`` (trained tokens of a
row) and ``generate_s``; with a validation set the ``kd`` recipe's ``val_*`` losses.
"""

from __future__ import annotations

from omegaconf import DictConfig

from tunesmith.config import instantiate
from tunesmith.generation.config import GenerationConfig
from tunesmith.recipes import kd
from tunesmith.rl import setup as rl
from tunesmith.rl.on_policy_distillation import (
    GKDSettings,
    OnPolicyDistillationSource,
    check_shared_tokenizer,
)
from tunesmith.training import setup
from tunesmith.training.loop import fit_from_config, run_main
from tunesmith.training.parallel.distributed import DistributedContext
from tunesmith.training.rules import component
from tunesmith.training.settings import LoopSettings, rules_of, settings_of

RUNTIME_ARGS = kd.RUNTIME_ARGS
RUNTIME_KWARGS = kd.RUNTIME_KWARGS
KEYS = [
    *(k for k in kd.KEYS if k != "packed"),  # prompts are cut from whole samples
    *(s.name for s in settings_of(GKDSettings)), "generation", "teacher_tokenizer",
]  # fmt: skip
RULES = {  # what each top-level value may be, checked up front
    **{k: v for k, v in kd.RULES.items() if k != "packed"},
    **rules_of(settings_of(GKDSettings)), "generation": rl.GENERATION_RULE,
    "teacher_tokenizer": component(null="no check that the teacher shares the tokenizer"),
}  # fmt: skip


def main(cfg: DictConfig) -> None:
    run_main(train, cfg, KEYS, RULES)


def train(cfg: DictConfig, ctx: DistributedContext) -> None:
    log = setup.rank_zero_log(ctx)
    settings = GKDSettings.from_config(cfg)
    generation = GenerationConfig(**rl.plain(cfg.get("generation")))  # temperature 0: greedy

    # -- one tokenizer for both, SFT samples (their prompts and the dataset's completions)
    tokenizer = setup.load_tokenizer(cfg)
    if cfg.get("teacher_tokenizer"):
        check_shared_tokenizer(tokenizer, instantiate(cfg.teacher_tokenizer))
    dataset, val_dataset = setup.datasets_for(cfg, tokenizer, log)
    dataset, val_dataset, collate = setup.sft_batches(cfg, dataset, val_dataset, tokenizer)

    # -- student, frozen teacher, the kd objective
    model, objective = kd.student_and_teacher(cfg, ctx, tokenizer, log)
    setup.memory_plan(cfg, ctx, model, dataset, collate, log, objective="distillation (gkd)")

    # -- rows answered by the student (lmbda), the dataset or the teacher (seq_kd)
    source = OnPolicyDistillationSource.build(
        dataset,
        collate,
        LoopSettings.from_config(cfg),
        ctx,
        student=model,
        teacher=objective.teacher,
        tokenizer=tokenizer,
        settings=settings,
        generation=generation,
    )
    fit_from_config(
        cfg,
        ctx,
        model=model,
        objective=objective,
        source=source,
        val_dataset=val_dataset,
        name="gkd",
    )
