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
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from tunesmith.config import instantiate
from tunesmith.modules.losses.rl import ValueLoss
from tunesmith.recipes.grpo import RL_RULES, _check_one_update_per_backward
from tunesmith.rl.critic import ValueObjective, build_critic, critic_config
from tunesmith.rl.evaluate import evaluate_rewards
from tunesmith.rl.objective import PolicyGradient
from tunesmith.rl.ppo import PPORolloutSource, PPOTrainer, offload_reward_models
from tunesmith.rl.prompts import PromptStream
from tunesmith.rl.source import GenerationConfig
from tunesmith.training import setup
from tunesmith.training.distributed import DistributedContext
from tunesmith.training.loop import LOOP_KEYS, LOOP_RUNTIME_KWARGS, fit, run_main
from tunesmith.training.loop_config import (
    LOOP_RULES,
    MODEL_RULES,
    component,
    flag,
    integer,
    number,
)
from tunesmith.training.parallelize import parallelize
from tunesmith.training.trainer import Trainer

_DATASET_KEYS = ("dataset", "val_dataset", "val_fraction", "gradient_accumulation_steps")
_GRPO_ONLY = ("advantage", "kl", "dynamic_sampling", "max_refills")
RUNTIME_ARGS = {"tokenizer": 0, "optimizer": 1, "lr_scheduler": 1, "critic_optimizer": 1,
                "critic_lr_scheduler": 1}  # fmt: skip
RUNTIME_KWARGS = {**LOOP_RUNTIME_KWARGS, "critic_lr_scheduler": ["num_training_steps"]}
PPO_RULES = {  # the keys of the PPO recipe besides the loop's
    **{k: v for k, v in RL_RULES.items() if k not in _GRPO_ONLY},
    "critic_model": component(null="a copy of the policy's body with a new value head"),
    "critic_optimizer": component(null="the policy's optimizer"),
    "critic_lr_scheduler": component(null="the policy's schedule"),
    "critic_warmup_steps": integer(0), "gamma": number(at_least=0, at_most=1),
    "lam": number(at_least=0, at_most=1), "kl_coef": number(at_least=0),
    "whiten_advantages": flag(), "value_clip": number(above=0, null="no value clipping"),
}  # fmt: skip
KEYS = [k for k in LOOP_KEYS if k not in _DATASET_KEYS] + [*setup.MODEL_KEYS, *PPO_RULES]
RULES = {**{k: v for k, v in LOOP_RULES.items() if k not in _DATASET_KEYS}, **MODEL_RULES,
         **PPO_RULES}  # fmt: skip


def main(cfg: DictConfig) -> None:
    run_main(train, cfg, KEYS, RULES)


def train(cfg: DictConfig, ctx: DistributedContext) -> None:
    log = setup.rank_zero_log(ctx)
    generation = GenerationConfig(**_plain(cfg.get("generation")))
    kl_coef = float(cfg.get("kl_coef", 0.0))

    # -- prompts and rewards
    tokenizer = setup.load_tokenizer(cfg)
    prompts = instantiate(cfg.prompts)
    stream = PromptStream(prompts, int(cfg.prompts_per_step), dp_rank=ctx.dp_rank,
                          dp_size=ctx.dp_size, shuffle=bool(cfg.get("shuffle", True)),
                          seed=int(cfg.get("seed", 0)))  # fmt: skip
    rewards = instantiate(cfg.rewards)
    if cfg.get("reference_offload", False):
        offload_reward_models(rewards)
    log(f"prompts: {len(prompts)}, {cfg.prompts_per_step} per step x group_size "
        f"{cfg.group_size} = {int(cfg.prompts_per_step) * int(cfg.group_size)} completions")  # fmt: skip

    # -- policy, reference and critic (copies taken before the policy is sharded)
    model = setup.build_policy(cfg, ctx, tokenizer)
    reference = None
    if kl_coef > 0:
        reference = setup.reference_policy(cfg, ctx, model, log, tokenizer=tokenizer)
    critic = build_critic(cfg, ctx, model, tokenizer, log)
    model = parallelize(model, ctx, cfg)  # checkpointing, compiled layers, FSDP2 (in place)
    critic = parallelize(critic, ctx, cfg)
    loss = instantiate(cfg.policy_loss)
    objective = PolicyGradient(loss, temperature=generation.temperature,
                               importance_cap=cfg.get("importance_cap"))  # fmt: skip
    value_loss = ValueLoss(cfg.get("value_clip", 0.2), loss.aggregation, loss.max_tokens)
    critic_trainer = Trainer(critic_config(cfg), ctx, model=critic,
                             objective=ValueObjective(value_loss))  # fmt: skip
    _check_one_update_per_backward(cfg, ctx)

    # -- rollouts with values and GAE advantages as the trainer's batch source
    updates = int(cfg.get("updates_per_batch", 1))
    source = PPORolloutSource(
        critic=critic, gamma=float(cfg.get("gamma", 1.0)), lam=float(cfg.get("lam", 0.95)),
        kl_coef=kl_coef, whiten_advantages=bool(cfg.get("whiten_advantages", True)),
        model=model, tokenizer=tokenizer, prompts=stream, rewards=rewards,
        group_size=int(cfg.group_size), ctx=ctx, generation=generation,
        micro_batch_size=int(cfg.batch_size), updates_per_batch=updates, reference=reference,
        overlong_filter=bool(cfg.get("overlong_filter", False)),
        max_logprob_mismatch=cfg.get("max_logprob_mismatch"),
        mixed_precision=cfg.get("mixed_precision"),
        chat_template=bool(cfg.get("chat_template", True)), seed=int(cfg.get("seed", 0)),
        samples_file=Path(cfg.output_dir) / "samples.jsonl",
        log_samples_every=int(cfg.get("log_samples_every", 0)),
    )  # fmt: skip
    evaluator = None
    if cfg.get("val_prompts"):
        val_prompts = instantiate(cfg.val_prompts)

        def evaluator() -> dict[str, float]:
            return evaluate_rewards(
                model, tokenizer, val_prompts, rewards, ctx,
                max_new_tokens=generation.max_new_tokens,
                batch_size=int(cfg.get("eval_batch_size", 16)),
                stop_token_ids=source.stop_token_ids, stop_strings=generation.stop_strings,
                chat_template=source.chat_template,
            )  # fmt: skip

    warmup = int(cfg.get("critic_warmup_steps", 0)) * updates
    fit(cfg, ctx, model=model, objective=objective, source=source, name="ppo",
        evaluator=evaluator,
        make_trainer=partial(PPOTrainer, critic=critic_trainer, warmup_steps=warmup))  # fmt: skip


def _plain(node: DictConfig | None) -> dict:
    return {} if node is None else dict(OmegaConf.to_container(node, resolve=True))
