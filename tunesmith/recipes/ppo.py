"""PPO with a learned critic: learning from rewards with per-token advantages from a value
model (GAE), full fine-tuning, one device or many (FSDP2).

    tunesmith run ppo --config tiny model_dir=... prompts.source=prompts.jsonl

Each optimizer step (``updates_per_batch`` steps share one batch of rollouts):

1. ``prompts_per_step`` prompts (``prompts``), each answered ``group_size`` times (often 1) by
   the policy (``generation``), scored by ``rewards``;
2. the trainer's log-probs of the sampled tokens (checked against the sampler's:
   ``max_logprob_mismatch``), the reference's when ``kl_coef > 0`` (``reference_model``, or a
   frozen copy of the initial policy; ``reference_offload`` keeps it in CPU memory between its
   layers' forwards on a GPU), and the critic's values of the completion positions;
3. per completion token ``t``: the reward ``r_t = -kl_coef · (logp_t - ref_logp_t)``, plus the
   sequence's reward on its last token (the KL folded into the reward, k1 per token); then
   GAE: ``δ_t = r_t + gamma · V_{t+1} - V_t``, ``A_t = δ_t + gamma · lam · A_{t+1}`` (``V``
   is 0 after the last token), returns ``R_t = A_t + V_t``, and the advantages whitened over
   the batch (``whiten_advantages``);
4. the policy: ``policy_loss`` (PPO-clip per token with the per-token advantages, no separate
   KL term); the critic, on its own optimizer (``critic_optimizer``, ``critic_lr_scheduler``,
   default the policy's): ``0.5 · max((V - R)², (clip(V, V_old ± value_clip) - R)²)``,
   aggregated like the policy loss. The first ``critic_warmup_steps`` batches train only the
   critic: they count against ``max_steps`` (``critic_warmup_steps x updates_per_batch``
   steps of it), the policy's LR schedule spans the remaining steps, and a run resumed inside
   the warm-up finishes it.

The critic (``critic_model``) is a value head on a copy of the policy's body (``null``) or a
reward-model folder trained by ``reward_model``
(``{_component_: tunesmith.models.reward_model_from_hf, path: ...}``); it checkpoints as a
reward-model folder in ``<output_dir>/critic/checkpoints/step_N`` at the same steps as the
policy (``<output_dir>/checkpoints/step_N``), and a resume loads both (refused when the
critic's checkpoint of that step is missing or at another step). With
``reference_offload: true`` on a GPU, a reward model used as a reward
(:class:`~tunesmith.rl.rewards.RewardModelScore`) is also kept in CPU memory, moved onto its
device only to score.

Logged per step: the GRPO recipe's rollout metrics (rewards, lengths, log-prob mismatch,
times), the policy's loss, clip fractions and entropy, the critic's as ``critic/<name>``
(``loss``, ``value_clip_fraction``, ``values``, ``returns``, ``grad_norm``, ``lr``), and per
batch ``values``, ``returns``, ``explained_variance``, ``kl``, advantage statistics (before
whitening) and ``values_s``; ``critic_warmup`` during the warm-up.
"""

from __future__ import annotations

from functools import partial

from omegaconf import DictConfig

from tunesmith.config import instantiate
from tunesmith.modules.losses.rl import ValueLoss
from tunesmith.rl import setup as rl
from tunesmith.rl.objective import PolicyGradient
from tunesmith.rl.ppo.critic import ValueObjective, build_critic, critic_config
from tunesmith.rl.ppo.trainer import GAEAdvantages, PPOTrainer, offload_reward_models
from tunesmith.rl.source import RolloutSource
from tunesmith.training import setup
from tunesmith.training.loop import LOOP_RUNTIME_KWARGS, fit_from_config, run_main
from tunesmith.training.parallel.distributed import DistributedContext
from tunesmith.training.parallelize import parallelize
from tunesmith.training.rules import component, flag, integer, number
from tunesmith.training.trainer import Trainer

RUNTIME_ARGS = {"tokenizer": 0, "optimizer": 1, "lr_scheduler": 1, "critic_optimizer": 1,
                "critic_lr_scheduler": 1}  # fmt: skip
RUNTIME_KWARGS = {**LOOP_RUNTIME_KWARGS, "critic_lr_scheduler": ["num_training_steps"]}
KEYS, RULES = rl.rl_keys(
    {  # what each top-level value may be, checked up front
        "critic_model": component(null="a copy of the policy's body with a new value head"),
        "critic_optimizer": component(null="the policy's optimizer"),
        "critic_lr_scheduler": component(null="the policy's schedule"),
        "critic_warmup_steps": integer(0),
        "gamma": number(at_least=0, at_most=1),
        "lam": number(at_least=0, at_most=1),
        "kl_coef": number(at_least=0),
        "whiten_advantages": flag(),
        "value_clip": number(above=0, null="no value clipping"),
    }
)


def main(cfg: DictConfig) -> None:
    run_main(train, cfg, KEYS, RULES)


def train(cfg: DictConfig, ctx: DistributedContext) -> None:
    log = setup.rank_zero_log(ctx)
    kl_coef = float(cfg.get("kl_coef", 0.0))

    # -- prompts and rewards
    tokenizer = setup.load_tokenizer(cfg)
    stream = rl.prompt_stream(cfg, ctx, instantiate(cfg.prompts), log)
    rewards = instantiate(cfg.rewards)
    if cfg.get("reference_offload", False):
        offload_reward_models(rewards)

    # -- policy, reference and critic (copies taken before the policy is sharded)
    model = setup.build_policy(cfg, ctx, tokenizer)
    reference = None
    if kl_coef > 0:
        reference = setup.reference_policy(cfg, ctx, model, log, tokenizer=tokenizer)
    critic = build_critic(cfg, ctx, model, tokenizer, log)
    model = parallelize(model, ctx, cfg)  # checkpointing, compiled layers, FSDP2 (in place)
    critic = parallelize(critic, ctx, cfg)
    loss = instantiate(cfg.policy_loss)
    settings = rl.rollout_settings(cfg)
    objective = PolicyGradient(
        loss, temperature=settings.generation.temperature, importance_cap=cfg.get("importance_cap")
    )
    value_loss = ValueLoss(cfg.get("value_clip", 0.2), loss.aggregation, loss.max_tokens)
    critic_trainer = Trainer.from_config(
        critic_config(cfg), ctx, model=critic, objective=ValueObjective(value_loss)
    )
    rl.check_one_update_per_backward(cfg, ctx)

    # -- rollouts with values and GAE advantages as the trainer's batch source
    advantages = GAEAdvantages(
        critic,
        ctx,
        settings,
        gamma=float(cfg.get("gamma", 1.0)),
        lam=float(cfg.get("lam", 0.95)),
        kl_coef=kl_coef,
        whiten_advantages=bool(cfg.get("whiten_advantages", True)),
    )
    source = RolloutSource(
        model=model,
        tokenizer=tokenizer,
        prompts=stream,
        rewards=rewards,
        ctx=ctx,
        settings=settings,
        advantages=advantages,
        reference=reference,
    )
    evaluator = rl.reward_evaluator(cfg, ctx, model, tokenizer, rewards, source)
    warmup = int(cfg.get("critic_warmup_steps", 0)) * settings.updates_per_batch
    make_trainer = partial(PPOTrainer.from_config, critic=critic_trainer, warmup_steps=warmup)
    fit_from_config(
        cfg,
        ctx,
        model=model,
        objective=objective,
        source=source,
        name="ppo",
        evaluator=evaluator,
        make_trainer=make_trainer,
    )
