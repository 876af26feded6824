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
   (``reference_model``, the policy with its LoRA adapters off, or a frozen copy);
4. ``policy_loss`` (PPO-clip per token with DAPO's clip-higher, or GSPO's sequence ratio;
   ``aggregation`` token-mean, sequence-mean or Dr. GRPO's constant) plus the KL term.

Logged per step: rewards (total and per reward), completion lengths, clip fractions, KL,
entropy, advantage statistics, zero-variance groups, the log-prob mismatch and the time spent
generating, scoring, computing log-probs and training; with ``val_prompts``, held-out rewards
of greedy answers every ``eval_every_n_steps``; a group of sample completions every
``log_samples_every`` batches in ``<output_dir>/samples.jsonl``.
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from tunesmith.config import instantiate
from tunesmith.modules.losses.rl import KLPenalty
from tunesmith.rl.evaluate import evaluate_rewards
from tunesmith.rl.objective import PolicyGradient
from tunesmith.rl.prompts import PromptStream
from tunesmith.rl.source import GenerationConfig, RolloutSource
from tunesmith.training import setup
from tunesmith.training.distributed import DistributedContext
from tunesmith.training.loop import LOOP_KEYS, LOOP_RUNTIME_KWARGS, fit, run_main
from tunesmith.training.loop_config import (
    LOOP_RULES,
    MODEL_RULES,
    Rule,
    component,
    flag,
    integer,
    number,
    type_name,
)
from tunesmith.training.parallelize import parallelize

_DATASET_KEYS = ("dataset", "val_dataset", "val_fraction", "gradient_accumulation_steps")
RUNTIME_ARGS = {"tokenizer": 0, "optimizer": 1, "lr_scheduler": 1}
RUNTIME_KWARGS = LOOP_RUNTIME_KWARGS
RL_RULES = {  # the keys of an RL recipe besides the loop's
    "prompts": component(required=True), "val_prompts": component(null="no held-out rewards"),
    "rewards": component(required=True), "advantage": component(required=True),
    "policy_loss": component(required=True),
    "kl": Rule("a mapping with coef (>= 0) and kind (k1, k2, k3), or null (no KL term)",
               lambda v: v is None or type_name(v) == "mapping"),
    "reference_model": component(null="the policy with its adapters off, or a frozen copy"),
    "reference_offload": flag(), "group_size": integer(1, required=True),
    "prompts_per_step": integer(1, required=True), "updates_per_batch": integer(1),
    "generation": Rule("a mapping of generation settings",
                       lambda v: v is None or type_name(v) == "mapping"),
    "dynamic_sampling": flag(), "max_refills": integer(0), "overlong_filter": flag(),
    "max_logprob_mismatch": number(above=0, null="no limit"),
    "importance_cap": number(at_least=1, null="no importance correction"),
    "chat_template": flag(), "log_samples_every": integer(0), "eval_batch_size": integer(1),
}  # fmt: skip
KEYS = [k for k in LOOP_KEYS if k not in _DATASET_KEYS] + [*setup.MODEL_KEYS, *RL_RULES]
RULES = {**{k: v for k, v in LOOP_RULES.items() if k not in _DATASET_KEYS}, **MODEL_RULES,
         **RL_RULES}  # fmt: skip


def main(cfg: DictConfig) -> None:
    run_main(train, cfg, KEYS, RULES)


def train(cfg: DictConfig, ctx: DistributedContext) -> None:
    log = setup.rank_zero_log(ctx)
    generation = GenerationConfig(**_plain(cfg.get("generation")))
    kl_cfg = _plain(cfg.get("kl"))

    # -- prompts and rewards
    tokenizer = setup.load_tokenizer(cfg)
    prompts = instantiate(cfg.prompts)
    stream = PromptStream(prompts, int(cfg.prompts_per_step), dp_rank=ctx.dp_rank,
                          dp_size=ctx.dp_size, shuffle=bool(cfg.get("shuffle", True)),
                          seed=int(cfg.get("seed", 0)))  # fmt: skip
    rewards = instantiate(cfg.rewards)
    advantage = instantiate(cfg.advantage, **_dp_group_for(cfg.advantage, ctx))
    log(
        f"prompts: {len(prompts)}, {cfg.prompts_per_step} per step x group_size "
        f"{cfg.group_size} = {int(cfg.prompts_per_step) * int(cfg.group_size)} completions"
    )

    # -- policy, reference (taken before the policy is sharded), loss
    model = setup.build_policy(cfg, ctx, tokenizer)
    reference = None
    if kl_cfg.get("coef", 0.0) > 0:
        reference = setup.reference_policy(cfg, ctx, model, log, tokenizer=tokenizer)
    model = parallelize(model, ctx, cfg)  # checkpointing, compiled layers, FSDP2 (in place)
    loss = instantiate(cfg.policy_loss)
    kl = KLPenalty(float(kl_cfg.get("coef", 0.0)), kl_cfg.get("kind", "k3"), loss.aggregation,
                   loss.max_tokens) if reference is not None else None  # fmt: skip
    objective = PolicyGradient(loss, kl=kl, temperature=generation.temperature,
                               importance_cap=cfg.get("importance_cap"))  # fmt: skip
    _check_one_update_per_backward(cfg, ctx)

    # -- rollouts as the trainer's batch source
    source = RolloutSource(
        model=model, tokenizer=tokenizer, prompts=stream, rewards=rewards, advantage=advantage,
        group_size=int(cfg.group_size), ctx=ctx, generation=generation,
        micro_batch_size=int(cfg.batch_size), updates_per_batch=int(cfg.get("updates_per_batch", 1)),
        reference=reference, dynamic_sampling=bool(cfg.get("dynamic_sampling", False)),
        max_refills=int(cfg.get("max_refills", 4)),
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

    fit(cfg, ctx, model=model, objective=objective, source=source, name="grpo",
        evaluator=evaluator)  # fmt: skip


def _plain(node: DictConfig | None) -> dict:
    return {} if node is None else dict(OmegaConf.to_container(node, resolve=True))


def _dp_group_for(node: DictConfig, ctx: DistributedContext) -> dict:
    """``process_group=`` for an advantage estimator that takes one (batch statistics over
    every data-parallel rank); nothing in one process."""
    import inspect

    from tunesmith.config.components import resolve_component

    target = resolve_component(node._component_)
    takes = "process_group" in inspect.signature(target).parameters
    return {"process_group": ctx.dp_group} if takes and ctx.world_size > 1 else {}


def _check_one_update_per_backward(cfg: DictConfig, ctx: DistributedContext) -> None:
    """An optimizer in backward steps at each backward: the step must be one micro-batch."""
    if not cfg.get("optimizer_in_backward", False):
        return
    rows = int(cfg.prompts_per_step) // ctx.dp_size * int(cfg.group_size)
    if rows > int(cfg.batch_size):
        raise ValueError(
            f"optimizer_in_backward: true needs one micro-batch per step, but a step has "
            f"{rows} rows per data-parallel rank (prompts_per_step {cfg.prompts_per_step} / "
            f"{ctx.dp_size} ranks x group_size {cfg.group_size}) and batch_size is "
            f"{cfg.batch_size}: set batch_size to {rows}"
        )
