"""The set-up the RL recipes (``grpo``, ``ppo``) share, one step per function, so a recipe file
keeps only its algorithm:

* :data:`RL_RULES` and :func:`rl_keys`: the config keys of an RL recipe (the loop's, less the
  dataset's, plus prompts, rewards, generation, ...) and what each may be;
* :func:`generation_config`, :func:`prompt_stream`: the ``generation:`` section and this
  rank's share of the ``prompts``;
* :func:`source_options`: the :class:`~tunesmith.rl.source.RolloutSource` arguments that come
  straight from the config;
* :func:`reward_evaluator`: held-out rewards of greedy answers on ``val_prompts`` (or None);
* :func:`check_one_update_per_backward`: the optimizer in backward needs one micro-batch;
* :data:`ASYNC_RULES`, :func:`asynchronous_source`: asynchronous GRPO's keys (its pipeline,
  Ray, and ``trainer_group``: who runs the trainer's ranks, :mod:`tunesmith.rl.trainer_group`)
  and its batch source.

Example (the prologue of an RL recipe)::

    KEYS, RULES = rl_keys(extra={"advantage": component(required=True)})
    stream = prompt_stream(cfg, ctx, prompts)
    source = RolloutSource(model=model, ..., **source_options(cfg))
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from torch import nn

from tunesmith.config import instantiate
from tunesmith.rl.async_source import AsyncRolloutSource
from tunesmith.rl.evaluate import evaluate_rewards
from tunesmith.rl.pipeline import (
    RAY_KEYS,
    RolloutPipeline,
    ray_address_problem,
    runtime_env_allowed,
    section_runtime_env_problem,
)
from tunesmith.rl.prompts import Prompt, PromptStream
from tunesmith.rl.rewards import RewardSet
from tunesmith.rl.source import GenerationConfig, RolloutSource
from tunesmith.rl.trainer_group import TRAINER_GROUP_RULE
from tunesmith.rl.weight_sync import SYNC_MODES
from tunesmith.training.distributed import DistributedContext
from tunesmith.training.loop_config import (
    Rule,
    choice,
    component,
    flag,
    integer,
    number,
    type_name,
)
from tunesmith.training.settings import LOOP_KEYS, LOOP_RULES, MODEL_KEYS, MODEL_RULES
from tunesmith.training.setup import Log

__all__ = [
    "ASYNC_RESUMABLE",
    "ASYNC_RULES",
    "RL_RULES",
    "asynchronous_source",
    "check_one_update_per_backward",
    "generation_config",
    "mapping",
    "plain",
    "prompt_stream",
    "reward_evaluator",
    "rl_keys",
    "source_options",
]

_DATASET_KEYS = ("dataset", "val_dataset", "val_fraction", "gradient_accumulation_steps")


def mapping(what: str) -> Rule:
    """The rule of a section that is a mapping or null (``what`` says what it holds)."""
    return Rule(what, lambda v: v is None or type_name(v) == "mapping")


_ROLLOUT_KEYS = ("workers", "num_cpus", "num_gpus", "engine", "vllm", "merge_adapters",
                 "runtime_env", "weight_sync", "weight_sync_timeout_s")  # fmt: skip
_REWARD_KEYS = ("workers", "num_cpus", "num_gpus", "runtime_env")
_RUNTIME_ENV_ONLY = (
    ": a Ray runtime environment runs code and is only for rollout and reward workers (with "
    "--allow-runtime-env)"
)


def _unknown_key(section: Any, keys: Sequence[str]) -> str | None:
    """``KEY: unknown key (allowed: ...)`` for the first key of ``section`` not in ``keys``."""
    for key in section.keys():  # noqa: SIM118 (a DictConfig or a dict)
        if key not in keys:
            why = _RUNTIME_ENV_ONLY if key == "runtime_env" else ""
            return f"{key}: unknown key (allowed: {', '.join(keys)}){why}"
    return None


def _weight_sync_problem(rollout: Any) -> str | None:
    """What is wrong with ``rollout.weight_sync`` / ``weight_sync_timeout_s``, or None.

    >>> _weight_sync_problem({"weight_sync": "nccl"})
    "weight_sync: expected one of 'object_store', 'collective', or null (object_store), got 'nccl' (a string)"
    """
    rollout = rollout or {}
    for key, rule in (("weight_sync", choice(*SYNC_MODES, null="object_store")),
                      ("weight_sync_timeout_s", number(above=0, null="1800 s"))):  # fmt: skip
        problem = rule.problem(rollout.get(key))
        if problem is not None:
            return f"{key}: {problem}"
    return None


_VLLM_KEYS = (  # VLLMEngine's own settings and vLLM's plain engine sizes, passed on as they are
    "dtype", "gpu_memory_utilization", "max_model_len", "enforce_eager",
    "allow_filtered_logprobs", "max_update_bytes", "tensor_parallel_size", "max_num_seqs",
    "max_num_batched_tokens", "enable_prefix_caching", "enable_chunked_prefill", "swap_space",
    "cpu_offload_gb", "kv_cache_dtype", "block_size", "quantization", "disable_log_stats",
)  # fmt: skip


def _vllm_problem(section: Any) -> str | None:
    """``vllm.KEY: ...`` for the first ``rollout.vllm`` argument outside :data:`_VLLM_KEYS`
    without the opt-in: vLLM's other arguments can load or run code (``trust_remote_code``,
    ``worker_cls``, ``logits_processors``, plugins, ...).

    >>> _vllm_problem({"vllm": {"dtype": "bfloat16"}}) is None
    True
    """
    vllm = section.get("vllm") or {}
    if type_name(vllm) != "mapping":
        return f"vllm: expected a mapping of VLLMEngine arguments, got a {type_name(vllm)}"
    for key in vllm.keys():  # noqa: SIM118 (a DictConfig or a dict)
        if key not in _VLLM_KEYS and not runtime_env_allowed():
            return (f"vllm.{key}: not one of the vLLM settings passed on as they are "
                    f"({', '.join(_VLLM_KEYS)}); vLLM's other arguments can load or run code "
                    "(trust_remote_code, worker_cls, logits_processors, plugins...): pass "
                    "--allow-runtime-env (or --allow-any-component) to use them")  # fmt: skip
    return None


def _workers_problem(keys: Sequence[str]) -> Callable[[Any], str | None]:
    """What is wrong in a ``rollout`` / ``reward_workers`` section: a key it does not have, a
    ``runtime_env`` without the opt-in (:func:`~tunesmith.rl.pipeline.section_runtime_env_problem`),
    the rollout's weight sync."""

    def problem(section: Any) -> str | None:
        if section is None:
            return None
        rollout = "weight_sync" in keys
        return (_unknown_key(section, keys) or section_runtime_env_problem(section)
                or (_vllm_problem(section) if rollout else None)
                or (_weight_sync_problem(section) if rollout else None))  # fmt: skip

    return problem


def _ray_problem(section: Any) -> str | None:
    """What is wrong in the ``ray`` section: an unknown key, an address that is not one, a
    connect timeout that is not a positive number.

    >>> _ray_problem({"address": "auto", "num_gpus": 1})
    'num_gpus: unknown key (allowed: address, num_cpus, temp_dir, log_to_driver, connect_timeout_s)'
    """
    if section is None:
        return None
    unknown = _unknown_key(section, RAY_KEYS)
    if unknown is not None:
        return unknown
    address = ray_address_problem(section.get("address"))
    if address is not None:
        return f"address: {address}"
    timeout = number(above=0, null="30 s").problem(section.get("connect_timeout_s"))
    return None if timeout is None else f"connect_timeout_s: {timeout}"


RL_RULES: dict[str, Rule] = {  # the keys every RL recipe reads besides the loop's
    "prompts": component(required=True), "val_prompts": component(null="no held-out rewards"),
    "rewards": component(required=True), "policy_loss": component(required=True),
    "reference_model": component(null="the policy with its adapters off, or a frozen copy"),
    "reference_offload": flag(), "group_size": integer(1, required=True),
    "prompts_per_step": integer(1, required=True), "updates_per_batch": integer(1),
    "generation": mapping("a mapping of generation settings"), "overlong_filter": flag(),
    "max_logprob_mismatch": number(above=0, null="no limit"),
    "importance_cap": number(at_least=1, null="no importance correction"),
    "chat_template": flag(), "log_samples_every": integer(0), "eval_batch_size": integer(1),
}  # fmt: skip


ASYNC_RULES: dict[str, Rule] = {  # asynchronous GRPO (grpo_async): the rollout pipeline
    "async_mode": choice("sync", "overlap", "off_policy", null="generate in the trainer"),
    "max_staleness": integer(0), "buffer_size": integer(1, null="enough for the mode"),
    "max_worker_restarts": integer(0),
    "rollout": replace(
        mapping("workers, num_cpus, num_gpus, engine (local or vllm), vllm, merge_adapters, runtime_env (with --allow-runtime-env), weight_sync (object_store or collective), weight_sync_timeout_s"),
        extra=_workers_problem(_ROLLOUT_KEYS), nested=True),
    "reward_workers": replace(
        mapping("workers, num_cpus, num_gpus, runtime_env (with --allow-runtime-env)"),
        extra=_workers_problem(_REWARD_KEYS), nested=True),
    "ray": replace(
        mapping("address (null: a local instance; auto or HOST:PORT: a cluster), num_cpus, temp_dir, log_to_driver, connect_timeout_s"),
        extra=_ray_problem, nested=True),
    "trainer_group": TRAINER_GROUP_RULE,  # torchrun's ranks (default) or Ray actors
}  # fmt: skip

ASYNC_RESUMABLE = frozenset(
    {"ray", "rollout", "reward_workers", "max_worker_restarts", "buffer_size", "trainer_group"}
)
"""Asynchronous GRPO's keys a resume may change: where and with what its workers and trainer
ranks run (besides the loop's :data:`~tunesmith.training.settings.RESUMABLE_KEYS`)."""


def rl_keys(extra: Mapping[str, Rule]) -> tuple[list[str], dict[str, Rule]]:
    """An RL recipe's ``KEYS`` and ``RULES``: the loop's (less the dataset's), the model
    step's, :data:`RL_RULES` and the recipe's own ``extra``.

    >>> keys, rules = rl_keys({"gamma": number(at_least=0, at_most=1)})
    >>> "dataset" in keys, "prompts" in keys, "gamma" in rules
    (False, True, True)
    """
    own = {**RL_RULES, **extra}
    keys = [k for k in LOOP_KEYS if k not in _DATASET_KEYS] + [*MODEL_KEYS, *own]
    rules = {k: v for k, v in LOOP_RULES.items() if k not in _DATASET_KEYS}
    return keys, {**rules, **MODEL_RULES, **own}


def plain(node: DictConfig | None) -> dict[str, Any]:
    """A config section as a plain dict (``{}`` for null).

    >>> plain(OmegaConf.create({"coef": 0.1}))
    {'coef': 0.1}
    """
    return {} if node is None else dict(OmegaConf.to_container(node, resolve=True))


def generation_config(cfg: DictConfig) -> GenerationConfig:
    """The ``generation:`` section (defaults for what it leaves out)."""
    return GenerationConfig(**plain(cfg.get("generation")))


def prompt_stream(
    cfg: DictConfig, ctx: DistributedContext, prompts: Sequence[Prompt], log: Log = print
) -> PromptStream:
    """This data-parallel rank's share of ``cfg.prompts_per_step`` prompts per step, a new
    order every epoch drawn from ``cfg.seed`` (``shuffle``)."""
    log(f"prompts: {len(prompts)}, {cfg.prompts_per_step} per step x group_size "
        f"{cfg.group_size} = {int(cfg.prompts_per_step) * int(cfg.group_size)} completions")  # fmt: skip
    return PromptStream(prompts, int(cfg.prompts_per_step), dp_rank=ctx.dp_rank,
                        dp_size=ctx.dp_size, shuffle=bool(cfg.get("shuffle", True)),
                        seed=int(cfg.get("seed", 0)))  # fmt: skip


def source_options(cfg: DictConfig) -> dict[str, Any]:
    """The :class:`~tunesmith.rl.source.RolloutSource` keyword arguments read from ``cfg``
    as they are (the recipe adds the model, tokenizer, prompts, rewards and reference)."""
    return {
        "group_size": int(cfg.group_size), "generation": generation_config(cfg),
        "micro_batch_size": int(cfg.batch_size),
        "updates_per_batch": int(cfg.get("updates_per_batch", 1)),
        "overlong_filter": bool(cfg.get("overlong_filter", False)),
        "max_logprob_mismatch": cfg.get("max_logprob_mismatch"),
        "mixed_precision": cfg.get("mixed_precision"),
        "chat_template": bool(cfg.get("chat_template", True)), "seed": int(cfg.get("seed", 0)),
        "samples_file": Path(cfg.output_dir) / "samples.jsonl",
        "log_samples_every": int(cfg.get("log_samples_every", 0)),
    }  # fmt: skip


def reward_evaluator(
    cfg: DictConfig, ctx: DistributedContext, model: nn.Module, tokenizer: Any,
    rewards: RewardSet, source: RolloutSource,
) -> Callable[[], dict[str, float]] | None:  # fmt: skip
    """Held-out rewards of ``model``'s greedy answers to ``cfg.val_prompts`` (decoded as the
    source decodes), or None without ``val_prompts``."""
    if not cfg.get("val_prompts"):
        return None
    val_prompts = instantiate(cfg.val_prompts)
    generation = source.generation

    def evaluator() -> dict[str, float]:
        return evaluate_rewards(
            model, tokenizer, val_prompts, rewards, ctx,
            max_new_tokens=generation.max_new_tokens,
            batch_size=int(cfg.get("eval_batch_size", 16)),
            stop_token_ids=source.stop_token_ids, stop_strings=generation.stop_strings,
            chat_template=source.chat_template,
        )  # fmt: skip

    return evaluator


def check_one_update_per_backward(cfg: DictConfig, ctx: DistributedContext) -> None:
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


def asynchronous_source(
    cfg: DictConfig, ctx: DistributedContext, *, model: nn.Module, tokenizer: Any,
    prompts: Sequence[Prompt], rewards: RewardSet, advantage: Any,
) -> tuple[AsyncRolloutSource, RolloutPipeline | None]:  # fmt: skip
    """The batch source of asynchronous GRPO (``cfg.async_mode`` set) and, on rank 0, its
    started rollout pipeline (close it when the run ends). The whole prompt stream is rank
    0's: it draws every step's prompts and shares the groups out."""
    stream = PromptStream(prompts, int(cfg.prompts_per_step), shuffle=bool(cfg.get("shuffle", True)),
                          seed=int(cfg.get("seed", 0)))  # fmt: skip
    updates = int(cfg.get("updates_per_batch", 1))
    total_steps = int(cfg.max_steps)
    rollout = plain(cfg.get("rollout"))
    pipeline = None
    if ctx.is_rank_zero:
        config = OmegaConf.to_container(cfg, resolve=True)
        pipeline = RolloutPipeline(
            config, stream, mode=str(cfg.async_mode), max_staleness=int(cfg.get("max_staleness", 0)),
            updates_per_batch=updates, total_batches=-(-total_steps // updates),
            capacity=cfg.get("buffer_size"), max_restarts=int(cfg.get("max_worker_restarts", 3)),
            shares=ctx.dp_size,
        )  # fmt: skip
        pipeline.start()
        pids = pipeline.worker_pids()
        print(f"async_mode {cfg.async_mode}: rollout workers (pids {pids['rollout']}), reward "
              f"workers (pids {pids['reward']}), buffer of {pipeline.capacity} groups")  # fmt: skip
    try:
        source = AsyncRolloutSource(
            pipeline=pipeline, total_steps=total_steps, model=model, tokenizer=tokenizer,
            prompts=stream, rewards=rewards, advantage=advantage, ctx=ctx,
            dynamic_sampling=bool(cfg.get("dynamic_sampling", False)),
            rollout_log=Path(cfg.output_dir) / "rollouts.jsonl", **source_options(cfg),
            merged_adapters=rollout.get("engine", "local") == "vllm"
            or bool(rollout.get("merge_adapters", False)),
        )  # fmt: skip
    except BaseException:
        if pipeline is not None:
            pipeline.close()
        raise
    return source, pipeline
