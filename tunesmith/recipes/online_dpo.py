"""Online DPO (Guo et al. 2024, "Direct Language Model Alignment from Online AI Feedback"):
DPO on pairs the policy itself samples and a judge ranks, full fine-tuning or LoRA, one device
or many (FSDP2).

    tunesmith run online_dpo --config tiny model_dir=... prompts.source=prompts.jsonl
    tunesmith run online_dpo --config tiny ... loss="{_component_: tunesmith.modules.losses.SimPOLoss}"

Each optimizer step (``updates_per_batch`` steps share one batch of pairs):

1. ``prompts_per_step`` prompts (``prompts``), each answered ``group_size`` (``k >= 2``)
   times by the policy (``generation``: temperature, top-p/k, stop strings, max new tokens);
2. the judge, ``rewards`` (verifiable rewards, a reward-model folder through
   :class:`~tunesmith.rl.rewards.RewardModelScore`, or a weighted mix), scores every
   completion; in each group the best is chosen and the worst rejected, a group whose scores
   are all equal gives no pair (``dynamic_sampling: true`` draws other prompts in its place);
3. ``loss`` (DPO, IPO, hinge, SimPO, ORPO, CPO: :mod:`tunesmith.modules.losses`) on the
   pairs, against the reference, the initial policy (the policy with its LoRA adapters off,
   or a frozen copy for full fine-tuning; ``reference_model`` for another), or none for a
   reference-free loss (SimPO, CPO, ORPO); the update is the mean over the pairs of all ranks.

Logged per step: ``rewards/chosen``, ``rewards/rejected``, ``rewards/accuracy``,
``rewards/margin``, ``logps/chosen``, ``logps/rejected`` (the loss's, as in ``dpo``), the
judge's ``score/chosen``, ``score/rejected``, ``score/margin`` and mean ``reward``, ``pairs``
and ``tied_groups``, completion lengths and the time spent generating and scoring; with
``val_prompts``, held-out rewards of greedy answers every ``eval_every_n_steps``; a pair every
``log_samples_every`` batches in ``<output_dir>/samples.jsonl``.
"""

from __future__ import annotations

from omegaconf import DictConfig

from tunesmith.config import instantiate
from tunesmith.recipes.dpo import reference_logps
from tunesmith.rl import setup as rl
from tunesmith.rl.online_pairs import OnlinePairs, OnlinePreference
from tunesmith.training import setup
from tunesmith.training.loop import LOOP_RUNTIME_KWARGS, fit_from_config, run_main
from tunesmith.training.parallel.distributed import DistributedContext
from tunesmith.training.parallelize import parallelize
from tunesmith.training.rules import integer
from tunesmith.training.settings import MODEL_RULES, LoopSettings

RUNTIME_ARGS = {"tokenizer": 0, "optimizer": 1, "lr_scheduler": 1}
RUNTIME_KWARGS = LOOP_RUNTIME_KWARGS
_UNUSED = ("policy_loss", "importance_cap", "max_logprob_mismatch", "overlong_filter")
KEYS, RULES = rl.rl_keys(
    {  # what each top-level value may be, checked up front
        "group_size": integer(2, required=True),  # a chosen and a rejected completion
        "loss": MODEL_RULES["loss"],
        "logprob_chunk_size": integer(1),
        **rl.DYNAMIC_RULES,
    }
)
KEYS = [k for k in KEYS if k not in _UNUSED]
RULES = {k: v for k, v in RULES.items() if k not in _UNUSED}


def main(cfg: DictConfig) -> None:
    run_main(train, cfg, KEYS, RULES)


def train(cfg: DictConfig, ctx: DistributedContext) -> None:
    log = setup.rank_zero_log(ctx)
    settings = rl.rollout_settings(cfg, rl.DynamicSampling.from_config(cfg))

    # -- prompts and the judge
    tokenizer = setup.load_tokenizer(cfg)
    prompts = instantiate(cfg.prompts)
    stream = rl.prompt_stream(cfg, ctx, prompts, log)
    judge = instantiate(cfg.rewards)

    # -- policy, loss, reference (the initial policy, taken before the policy is sharded)
    model = setup.build_policy(cfg, ctx, tokenizer, on_device=False)
    loss_fn = instantiate(cfg.loss)
    chunk_size = int(cfg.get("logprob_chunk_size", 1024))
    reference = None
    if loss_fn.needs_reference:
        reference = reference_logps(cfg, model, ctx, chunk_size, log, tokenizer=tokenizer)
    model = parallelize(model.to(ctx.device), ctx, cfg)  # checkpointing, compile, FSDP2
    objective = OnlinePreference(setup.compiled_loss(cfg, loss_fn), reference, chunk_size)
    _check_one_update_per_backward(cfg, ctx)

    # -- pairs sampled by the policy and ranked by the judge, as the trainer's batch source
    source = OnlinePairs(
        model=model,
        tokenizer=tokenizer,
        prompts=stream,
        rewards=judge,
        ctx=ctx,
        settings=settings,
        pad_id=setup.pad_id(tokenizer),
    )
    fit_from_config(
        cfg,
        ctx,
        model=model,
        objective=objective,
        source=source,
        name="online_dpo",
        evaluator=rl.reward_evaluator(cfg, ctx, model, tokenizer, judge, source),
    )


def _check_one_update_per_backward(cfg: DictConfig, ctx: DistributedContext) -> None:
    """An optimizer in backward steps at each backward: a step's pairs (at most a pair per
    prompt of this rank) must fit one micro-batch."""
    loop = LoopSettings.from_config(cfg)
    most = rl.RLSettings.from_config(cfg).prompts_per_step // ctx.dp_size
    if loop.optimizer_in_backward and most > loop.batch_size:
        raise ValueError(
            f"optimizer_in_backward: true needs one micro-batch per step, but a step may have "
            f"{most} pairs per data-parallel rank (prompts_per_step / {ctx.dp_size} ranks) "
            f"and batch_size is {loop.batch_size}: set batch_size to {most}"
        )
