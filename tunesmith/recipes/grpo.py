"""GRPO and its variants (Dr. GRPO, DAPO, GSPO, RLOO, REINFORCE++): learning from rewards,
full fine-tuning or LoRA, one device or many (FSDP2).

    tunesmith run grpo --config tiny
    tunesmith run grpo --config qwen3_0_6b --nproc-per-node 8

Each optimizer step (``updates_per_batch`` steps share one batch of rollouts):

1. ``prompts_per_step`` prompts (``prompts``: a dataset with answers, or reasoning-gym tasks),
   each answered ``group_size`` times by the policy (``generation``: temperature, top-p/k,
   min-p, stop strings, max new tokens);
2. ``rewards`` score every completion (weighted components: answer checks, format, length,
   code tests, a reward model); ``advantage`` turns a group's rewards into advantages
   (group-normalised GRPO, Dr. GRPO without the std, leave-one-out RLOO, batch-normalised
   REINFORCE++); ``dynamic_sampling`` (DAPO) replaces groups whose rewards are all equal;
3. the trainer's log-probs of the sampled tokens before the update (checked against the
   sampler's: ``max_logprob_mismatch``) and the reference's when ``kl.coef > 0``
   (``reference_model``, the policy with its LoRA adapters off, or a frozen copy) or the
   advantage reads it (``TeacherReverseKL``: on-policy distillation, the reference a teacher);
4. ``policy_loss`` (PPO-clip per token with DAPO's clip-higher, or GSPO's sequence ratio;
   ``aggregation`` token-mean, sequence-mean or Dr. GRPO's constant) plus the KL term.

Logged per step: rewards (total and per reward), completion lengths, clip fractions, KL,
entropy, advantage statistics, zero-variance groups, the log-prob mismatch and the time spent
generating, scoring, computing log-probs and training; with ``val_prompts``, held-out rewards
of greedy answers every ``eval_every_n_steps``; a group of sample completions every
``log_samples_every`` batches in ``<output_dir>/samples.jsonl``.
"""

from __future__ import annotations

from functools import partial

from omegaconf import DictConfig

from tunesmith.config import instantiate
from tunesmith.modules.losses.rl import KLPenalty
from tunesmith.rl import setup as rl
from tunesmith.rl.advantages import needs_reference
from tunesmith.rl.asynchronous.pipeline import require_ray
from tunesmith.rl.asynchronous.trainer_group import (
    check_launch as check_launch,  # read by `tunesmith run`
)
from tunesmith.rl.asynchronous.trainer_group import run_trainers
from tunesmith.rl.objective import PolicyGradient
from tunesmith.rl.source import RolloutSource, advantage_stage
from tunesmith.training import setup
from tunesmith.training.loop import LOOP_RUNTIME_KWARGS, fit_from_config
from tunesmith.training.parallel.distributed import DistributedContext
from tunesmith.training.parallelize import parallelize
from tunesmith.training.rules import component
from tunesmith.training.trainer import Trainer

RUNTIME_ARGS = {"tokenizer": 0, "optimizer": 1, "lr_scheduler": 1}
RUNTIME_KWARGS = LOOP_RUNTIME_KWARGS
KEYS, RULES = rl.rl_keys(
    {  # what each top-level value may be, checked up front
        "advantage": component(required=True),
        "kl": rl.mapping("a mapping with coef (>= 0) and kind (k1, k2, k3), or null (no KL term)"),
        **rl.DYNAMIC_RULES,
        **rl.ASYNC_RULES,
        **rl.ENVIRONMENT_RULES,
    }
)


def main(cfg: DictConfig) -> None:
    run_trainers(train, cfg, KEYS, RULES)  # this process's ranks, or Ray actors (trainer_group)


def train(cfg: DictConfig, ctx: DistributedContext) -> None:
    log = setup.rank_zero_log(ctx)
    kl_cfg = rl.plain(cfg.get("kl"))
    dynamic = rl.DynamicSampling.from_config(cfg)

    asynchronous = cfg.get("async_mode") is not None  # rollouts from Ray workers
    if asynchronous:
        require_ray()  # before anything is built: a missing Ray is one line

    # -- prompts and rewards
    tokenizer = setup.load_tokenizer(cfg)
    prompts = instantiate(cfg.prompts)
    stream = rl.prompt_stream(cfg, ctx, prompts, log)
    rewards = instantiate(cfg.rewards) if cfg.get("rewards") is not None else None
    environment = instantiate(cfg.environment) if cfg.get("environment") is not None else None
    if rewards is None and environment is None:
        raise ValueError("grpo: rewards, environment or both must score the rollouts")
    advantage = instantiate(cfg.advantage, **_dp_group_for(cfg.advantage, ctx))

    # -- policy, reference (taken before the policy is sharded), loss
    model = setup.build_policy(cfg, ctx, tokenizer)
    reference = None
    wants_reference = kl_cfg.get("coef", 0.0) > 0 or needs_reference(advantage)
    if wants_reference and not asynchronous:  # async: the reward workers' own
        reference = setup.reference_policy(cfg, ctx, model, log, tokenizer=tokenizer)
    model = parallelize(model, ctx, cfg)  # checkpointing, compiled layers, FSDP2 (in place)
    loss = instantiate(cfg.policy_loss)
    kl = (
        KLPenalty(
            float(kl_cfg["coef"]), kl_cfg.get("kind", "k3"), loss.aggregation, loss.max_tokens
        )
        if kl_cfg.get("coef", 0.0) > 0
        else None
    )
    settings = rl.rollout_settings(cfg, dynamic)
    objective = PolicyGradient(
        loss,
        kl=kl,
        temperature=settings.generation.temperature,
        importance_cap=cfg.get("importance_cap"),
    )
    rl.check_one_update_per_backward(cfg, ctx)

    # -- rollouts as the trainer's batch source
    pipeline, on_step_end = None, []
    if asynchronous:
        source, pipeline = rl.asynchronous_source(
            cfg,
            ctx,
            model=model,
            tokenizer=tokenizer,
            prompts=prompts,
            advantage=advantage,
            dynamic=dynamic,
        )
        on_step_end = [source.on_step_end]  # new weights to the rollout workers
    else:
        source = RolloutSource(
            model=model,
            tokenizer=tokenizer,
            prompts=stream,
            rewards=rewards,
            ctx=ctx,
            settings=settings,
            advantages=advantage_stage(advantage, settings.group_size),
            reference=reference,
            environment=environment,
        )
    try:
        fit_from_config(
            cfg,
            ctx,
            model=model,
            objective=objective,
            source=source,
            name="grpo",
            evaluator=rl.reward_evaluator(
                cfg, ctx, model, tokenizer, rewards, source, environment=environment
            ),
            resumable=rl.ASYNC_RESUMABLE,
            make_trainer=partial(Trainer.from_config, on_step_end=on_step_end),
        )
    finally:
        if pipeline is not None:
            pipeline.close()


def _dp_group_for(node: DictConfig, ctx: DistributedContext) -> dict:
    """``process_group=`` for an advantage estimator that takes one (batch statistics over
    every data-parallel rank); nothing in one process."""
    import inspect

    from tunesmith.config.components import resolve_component

    target = resolve_component(node._component_)
    takes = "process_group" in inspect.signature(target).parameters
    return {"process_group": ctx.dp_group} if takes and ctx.world_size > 1 else {}
