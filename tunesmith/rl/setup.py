"""The set-up the RL recipes (``grpo``, ``ppo``) share, one step per function, so a recipe file
keeps only its algorithm:

* :data:`RL_RULES` and :func:`rl_keys` (from :mod:`tunesmith.rl.settings`, where each RL key
  is declared once): the config keys of an RL recipe (the loop's, less the dataset's, plus
  prompts, rewards, generation, ...) and what each may be;
* :func:`generation_config`, :func:`prompt_stream`: the ``generation:`` section and this
  rank's share of the ``prompts``;
* :func:`rollout_settings`: the :class:`~tunesmith.rl.source.RolloutSettings` of the
  config, what the rollout source's stages read;
* :func:`reward_evaluator`: held-out rewards of greedy answers on ``val_prompts`` (or None);
* :func:`check_one_update_per_backward`: the optimizer in backward needs one micro-batch;
* :data:`ASYNC_RULES`, :func:`asynchronous_source`: asynchronous GRPO's keys (its pipeline,
  Ray, and ``trainer_group``: who runs the trainer's ranks,
  :mod:`tunesmith.rl.asynchronous.trainer_group`) and its batch source.

Example (the prologue of an RL recipe)::

    KEYS, RULES = rl_keys(extra={"advantage": component(required=True)})
    stream = prompt_stream(cfg, ctx, prompts)
    settings = rollout_settings(cfg)
    source = RolloutSource(model=model, ..., settings=settings, advantages=...)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from torch import nn

from tunesmith.config import instantiate
from tunesmith.generation.config import GenerationConfig
from tunesmith.rl.asynchronous.pipeline import PipelineSettings, RolloutPipeline
from tunesmith.rl.asynchronous.source import AsyncRolloutSource
from tunesmith.rl.asynchronous.workers import BUILD_SECTIONS, WorkerSettings
from tunesmith.rl.envs.trajectory import EpisodeSettings
from tunesmith.rl.evaluate import evaluate_environment, evaluate_rewards
from tunesmith.rl.prompts import Prompt, PromptStream
from tunesmith.rl.rewards import RewardSet
from tunesmith.rl.settings import (  # re-exported: the recipes read them here
    ASYNC_RESUMABLE,
    ASYNC_RULES,
    DYNAMIC_RULES,
    ENVIRONMENT_RULES,
    GENERATION_RULE,
    RL_RULES,
    AsyncSettings,
    DynamicSampling,
    RLSettings,
    mapping,
    rl_keys,
)
from tunesmith.rl.source import (
    RolloutSettings,
    RolloutSource,
    advantage_stage,
    check_sampled,
)
from tunesmith.training.parallel.distributed import DistributedContext
from tunesmith.training.settings import LoopSettings
from tunesmith.training.setup import Log

__all__ = [
    "ASYNC_RESUMABLE",
    "ASYNC_RULES",
    "RL_RULES",
    "DYNAMIC_RULES",
    "ENVIRONMENT_RULES",
    "GENERATION_RULE",
    "AsyncSettings",
    "DynamicSampling",
    "RLSettings",
    "asynchronous_source",
    "check_one_update_per_backward",
    "generation_config",
    "mapping",
    "plain",
    "prompt_stream",
    "reward_evaluator",
    "rl_keys",
    "rollout_settings",
    "worker_settings",
]


def plain(node: DictConfig | None) -> dict[str, Any]:
    """A config section as a plain dict (``{}`` for null).

    >>> plain(OmegaConf.create({"coef": 0.1}))
    {'coef': 0.1}
    """
    return {} if node is None else dict(OmegaConf.to_container(node, resolve=True))


def generation_config(cfg: DictConfig) -> GenerationConfig:
    """The ``generation:`` section (defaults for what it leaves out); a policy gradient needs
    samples, so greedy decoding (temperature 0) is refused.

    >>> generation_config(OmegaConf.create({"generation": {"temperature": 0.0}}))
    Traceback (most recent call last):
    ValueError: generation.temperature must be > 0 for RL sampling, got 0.0
    """
    return check_sampled(GenerationConfig(**plain(cfg.get("generation"))))


def prompt_stream(
    cfg: DictConfig, ctx: DistributedContext, prompts: Sequence[Prompt], log: Log = print
) -> PromptStream:
    """This data-parallel rank's share of ``cfg.prompts_per_step`` prompts per step, a new
    order every epoch drawn from ``cfg.seed`` (``shuffle``)."""
    rl, loop = RLSettings.from_config(cfg), LoopSettings.from_config(cfg)
    log(
        f"prompts: {len(prompts)}, {rl.prompts_per_step} per step x group_size "
        f"{rl.group_size} = {rl.prompts_per_step * rl.group_size} completions"
    )
    return PromptStream(
        prompts,
        rl.prompts_per_step,
        dp_rank=ctx.dp_rank,
        dp_size=ctx.dp_size,
        shuffle=loop.shuffle,
        seed=loop.seed,
    )


def rollout_settings(cfg: DictConfig, dynamic: DynamicSampling | None = None) -> RolloutSettings:
    """The :class:`~tunesmith.rl.source.RolloutSettings` of ``cfg`` (the recipe adds the
    model, tokenizer, prompts, rewards, reference and stages); ``dynamic``: the recipe's
    dynamic sampling (default: off).

    Example::

        settings = rollout_settings(cfg, DynamicSampling.from_config(cfg))
        settings.group_size, settings.generation.max_new_tokens  # -> (4, 8)
    """
    rl, loop = RLSettings.from_config(cfg), LoopSettings.from_config(cfg)
    dynamic = dynamic or DynamicSampling()
    return RolloutSettings(
        group_size=rl.group_size,
        generation=generation_config(cfg),
        micro_batch_size=loop.batch_size,
        updates_per_batch=rl.updates_per_batch,
        dynamic_sampling=dynamic.dynamic_sampling,
        max_refills=dynamic.max_refills,
        overlong_filter=rl.overlong_filter,
        max_logprob_mismatch=rl.max_logprob_mismatch,
        mixed_precision=loop.mixed_precision,
        chat_template=rl.chat_template,
        seed=loop.seed,
        samples_file=Path(loop.output_dir) / "samples.jsonl",
        log_samples_every=rl.log_samples_every,
        episode=EpisodeSettings.of(plain(cfg.get("episode"))) if cfg.get("environment") else None,
    )


def reward_evaluator(
    cfg: DictConfig,
    ctx: DistributedContext,
    model: nn.Module,
    tokenizer: Any,
    rewards: RewardSet | None,
    source: RolloutSource,
    environment: Any = None,
) -> Callable[[], dict[str, float]] | None:
    """Held-out rewards of ``model``'s greedy answers to ``cfg.val_prompts`` (decoded as the
    source decodes), or None without ``val_prompts``; with an ``environment``, of one greedy
    trajectory per prompt (:func:`~tunesmith.rl.evaluate.evaluate_environment`)."""
    if not cfg.get("val_prompts"):
        return None
    val_prompts = instantiate(cfg.val_prompts)
    generation = source.settings.generation
    batch_size = RLSettings.from_config(cfg).eval_batch_size
    common = {
        "max_new_tokens": generation.max_new_tokens,
        "batch_size": batch_size,
        "stop_token_ids": source.stop_token_ids,
        "stop_strings": generation.stop_strings,
    }

    def evaluator() -> dict[str, float]:
        if environment is not None:
            episode = source.settings.episode or EpisodeSettings()
            return evaluate_environment(
                model, tokenizer, val_prompts, environment, ctx, episode=episode,
                rewards=rewards, **common,
            )  # fmt: skip
        return evaluate_rewards(
            model,
            tokenizer,
            val_prompts,
            rewards,
            ctx,
            chat_template=source.settings.chat_template,
            **common,
        )

    return evaluator


def check_one_update_per_backward(cfg: DictConfig, ctx: DistributedContext) -> None:
    """An optimizer in backward steps at each backward: the step must be one micro-batch."""
    rl, loop = RLSettings.from_config(cfg), LoopSettings.from_config(cfg)
    if not loop.optimizer_in_backward:
        return
    rows = rl.prompts_per_step // ctx.dp_size * rl.group_size
    if rows > loop.batch_size:
        raise ValueError(
            f"optimizer_in_backward: true needs one micro-batch per step, but a step has "
            f"{rows} rows per data-parallel rank (prompts_per_step {rl.prompts_per_step} / "
            f"{ctx.dp_size} ranks x group_size {rl.group_size}) and batch_size is "
            f"{loop.batch_size}: set batch_size to {rows}"
        )


def advantage_needs_reference(cfg: DictConfig) -> bool:
    """Whether the config's ``advantage`` reads the reference's log-probs (a teacher's:
    :class:`~tunesmith.rl.advantages.TeacherReverseKL`), so the reference must be computed
    even without a KL term; decided on the class the component resolves to."""
    from tunesmith.config.components import resolve_component
    from tunesmith.rl.advantages import needs_reference

    node = cfg.get("advantage")
    if node is None or "_component_" not in node:
        return False
    return needs_reference(resolve_component(node._component_))


def worker_settings(cfg: DictConfig) -> WorkerSettings:
    """What the rollout and reward workers of ``cfg`` are sent: their settings, read once
    here, and the sections their builders read
    (:data:`~tunesmith.rl.asynchronous.workers.BUILD_SECTIONS`).

    Example::

        settings = worker_settings(cfg)  # settings.group_size == cfg.group_size
    """
    rl, loop = RLSettings.from_config(cfg), LoopSettings.from_config(cfg)
    rollout, kl = plain(cfg.get("rollout")), plain(cfg.get("kl"))
    resolved = OmegaConf.to_container(cfg, resolve=True)
    return WorkerSettings(
        group_size=rl.group_size,
        micro_batch_size=loop.batch_size,
        seed=loop.seed,
        chat_template=rl.chat_template,
        overlong_filter=rl.overlong_filter,
        mixed_precision=loop.mixed_precision,
        generation=generation_config(cfg),
        engine=rollout.get("engine") or "local",
        vllm=rollout.get("vllm") or {},
        merge_adapters=bool(rollout.get("merge_adapters")),
        kl_coef=float(kl.get("coef") or 0),
        reference_logprobs=advantage_needs_reference(cfg),
        device=loop.device,
        episode=EpisodeSettings.of(plain(cfg.get("episode"))) if cfg.get("environment") else None,
        build={k: resolved[k] for k in BUILD_SECTIONS if k in resolved},
    )


def asynchronous_source(
    cfg: DictConfig,
    ctx: DistributedContext,
    *,
    model: nn.Module,
    tokenizer: Any,
    prompts: Sequence[Prompt],
    advantage: Any,
    dynamic: DynamicSampling | None = None,
) -> tuple[AsyncRolloutSource, RolloutPipeline | None]:
    """The batch source of asynchronous GRPO (``cfg.async_mode`` set) and, on rank 0, its
    started rollout pipeline (close it when the run ends). The whole prompt stream is rank
    0's: it draws every step's prompts and shares the groups out. ``advantage``: the
    estimator of the groups' advantages or a stage of its own
    (:func:`~tunesmith.rl.source.advantage_stage`);
    ``dynamic``: the recipe's dynamic sampling (groups whose rewards are all equal replaced;
    default: off)."""
    dynamic = dynamic or DynamicSampling()
    rl, loop, asynchronous = (RLSettings.from_config(cfg), LoopSettings.from_config(cfg),
                              AsyncSettings.from_config(cfg))  # fmt: skip
    settings = rollout_settings(cfg, dynamic)
    stream = PromptStream(prompts, rl.prompts_per_step, shuffle=loop.shuffle, seed=loop.seed)
    if loop.max_steps is None:
        raise ValueError("max_steps is needed: asynchronous rollouts have no epochs to count")
    updates, total_steps = rl.updates_per_batch, loop.max_steps
    rollout = plain(cfg.get("rollout"))
    pipeline = None
    if ctx.is_rank_zero:
        config = OmegaConf.to_container(cfg, resolve=True)
        pipeline = RolloutPipeline(
            PipelineSettings.from_config(config),
            stream,
            workers=worker_settings(cfg),
            mode=str(asynchronous.async_mode),
            max_staleness=asynchronous.max_staleness,
            updates_per_batch=updates,
            total_batches=-(-total_steps // updates),
            capacity=asynchronous.buffer_size,
            max_restarts=asynchronous.max_worker_restarts,
            shares=ctx.dp_size,
            dynamic_sampling=dynamic.dynamic_sampling,
            max_refills=dynamic.max_refills,
        )
        pipeline.start()
        pids = pipeline.worker_pids()
        print(
            f"async_mode {asynchronous.async_mode}: rollout workers (pids {pids['rollout']}), reward "
            f"workers (pids {pids['reward']}), buffer of {pipeline.capacity} groups"
        )
    try:
        source = AsyncRolloutSource(
            pipeline=pipeline,
            total_steps=total_steps,
            model=model,
            tokenizer=tokenizer,
            prompts=stream,
            ctx=ctx,
            settings=settings,
            advantages=advantage_stage(advantage, settings.group_size),
            rollout_log=Path(loop.output_dir) / "rollouts.jsonl",
            merged_adapters=rollout.get("engine") == "vllm" or bool(rollout.get("merge_adapters")),
        )
    except BaseException:
        if pipeline is not None:
            pipeline.close()
        raise
    return source, pipeline
