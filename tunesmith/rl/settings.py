"""The settings every RL recipe reads besides the loop's, each declared once: name, rule,
default, whether a resume may change it, and a one-line doc (as
:mod:`tunesmith.training.settings` declares the loop's).

:class:`RLSettings` is the typed, frozen form of the RL keys (``group_size``,
``prompts_per_step``, ``updates_per_batch``...) and :class:`AsyncSettings` asynchronous GRPO's
(``async_mode``, ``max_staleness``...); the sections read by what they build (``prompts``,
``rewards``, ``generation``, the Ray ``rollout`` workers...) are in :data:`RL_SECTIONS` and
:data:`ASYNC_SECTIONS`. :data:`RL_RULES`, :data:`ASYNC_RULES`, :data:`ASYNC_RESUMABLE` and
:func:`rl_keys` (an RL recipe's ``KEYS`` and ``RULES``) are derived from them.

Example::

    >>> settings = RLSettings(group_size=8, prompts_per_step=4)
    >>> settings.updates_per_batch, settings.chat_template, settings.eval_batch_size
    (1, True, 16)
    >>> sorted(ASYNC_RESUMABLE)
    ['buffer_size', 'max_worker_restarts', 'ray', 'reward_workers', 'rollout', 'trainer_group']
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

from omegaconf import DictConfig, OmegaConf

from tunesmith.generation.config import GenerationConfig
from tunesmith.rl.asynchronous.pipeline import (
    RAY_KEYS,
    ray_address_problem,
    runtime_env_allowed,
    section_runtime_env_problem,
)
from tunesmith.rl.asynchronous.trainer_group import TRAINER_GROUP_RULE
from tunesmith.rl.asynchronous.weight_sync import SYNC_MODES
from tunesmith.rl.envs.trajectory import EpisodeSettings
from tunesmith.training.rules import Rule, choice, component, flag, integer, number, type_name
from tunesmith.training.settings import (
    LOOP_KEYS,
    LOOP_RULES,
    MODEL_KEYS,
    MODEL_RULES,
    REQUIRED,
    Setting,
    Settings,
    resumable_keys,
    rules_of,
    setting,
    settings_of,
)

__all__ = [
    "ASYNC_RESUMABLE",
    "ASYNC_RULES",
    "ASYNC_SECTIONS",
    "ASYNC_SETTINGS",
    "RL_RULES",
    "RL_SECTIONS",
    "RL_SETTINGS",
    "DYNAMIC_RULES",
    "ENVIRONMENT_RULES",
    "ENVIRONMENT_SECTIONS",
    "GENERATION_RULE",
    "AsyncSettings",
    "DynamicSampling",
    "RLSettings",
    "mapping",
    "rl_keys",
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
    for key, rule in (
        ("weight_sync", choice(*SYNC_MODES, null="object_store")),
        ("weight_sync_timeout_s", number(above=0, null="1800 s")),
    ):
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
            return (
                f"vllm.{key}: not one of the vLLM settings passed on as they are "
                f"({', '.join(_VLLM_KEYS)}); vLLM's other arguments can load or run code "
                "(trust_remote_code, worker_cls, logits_processors, plugins...): pass "
                "--allow-runtime-env (or --allow-any-component) to use them"
            )
    return None


def _workers_problem(keys: Sequence[str]) -> Callable[[Any], str | None]:
    """What is wrong in a ``rollout`` / ``reward_workers`` section: a key it does not have, a
    ``runtime_env`` without the opt-in
    (:func:`~tunesmith.rl.asynchronous.pipeline.section_runtime_env_problem`), the rollout's
    weight sync."""

    def problem(section: Any) -> str | None:
        if section is None:
            return None
        rollout = "weight_sync" in keys
        return (
            _unknown_key(section, keys)
            or section_runtime_env_problem(section)
            or (_vllm_problem(section) if rollout else None)
            or (_weight_sync_problem(section) if rollout else None)
        )

    return problem


def _generation_problem(section: Any) -> str | None:
    """What is wrong in the ``generation`` section: what building its
    :class:`~tunesmith.generation.config.GenerationConfig` (and its ``engine`` settings)
    raises, so ``validate`` refuses what a run would.

    >>> _generation_problem({"engine": {"max_slots": 0}})
    'engine.max_slots must be an int >= 1, got 0'
    >>> _generation_problem({"max_new_token": 8})
    'max_new_token: unknown key (allowed: max_new_tokens, temperature, top_p, top_k, min_p, stop_strings, stop_tokens, engine)'
    """
    if section is None:
        return None
    unknown = _unknown_key(section, [f.name for f in fields(GenerationConfig)])
    if unknown is not None:
        return unknown
    values = OmegaConf.to_container(section) if isinstance(section, DictConfig) else section
    try:
        GenerationConfig(**dict(values))
    except (TypeError, ValueError) as error:
        return str(error)
    return None


def _sampled_generation_problem(section: Any) -> str | None:
    """:func:`_generation_problem`, and a greedy ``temperature: 0`` refused as the run refuses
    it (:func:`~tunesmith.rl.source.check_sampled`: a policy gradient needs samples).

    >>> _sampled_generation_problem({"temperature": 0.0})
    'temperature must be > 0 for RL sampling, got 0.0'
    """
    if (problem := _generation_problem(section)) is not None:
        return problem
    temperature = (section or {}).get("temperature")
    if temperature is not None and temperature == 0:
        return f"temperature must be > 0 for RL sampling, got {temperature}"
    return None


GENERATION_RULE = replace(mapping("a mapping of generation settings"), extra=_generation_problem)
"""The ``generation`` section of a recipe that may decode greedily (``gkd``); the RL
recipes' own refuses ``temperature: 0``."""


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


@dataclass(frozen=True)
class RLSettings(Settings):
    """What an RL recipe is told besides the loop's keys, typed and checked (see the module
    docs)."""

    group_size: int = setting(
        REQUIRED, integer(1, required=True), "completions sampled per prompt (a group)"
    )
    prompts_per_step: int = setting(
        REQUIRED, integer(1, required=True), "prompts per step, over all data-parallel ranks"
    )
    updates_per_batch: int = setting(
        1, integer(1), "optimizer steps per batch of rollouts (the batch split in as many parts)"
    )
    overlong_filter: bool = setting(
        False, flag(), "completions cut at max_new_tokens train no token"
    )
    max_logprob_mismatch: float | None = setting(
        None,
        number(above=0, null="no limit"),
        "stop when the trainer's log-probs of sampled tokens differ more from the sampler's",
    )
    importance_cap: float | None = setting(
        None,
        number(at_least=1, null="no importance correction"),
        "cap of the trainer/sampler importance ratio of each token",
    )
    chat_template: bool = setting(True, flag(), "prompts through the tokenizer's chat template")
    log_samples_every: int = setting(
        0, integer(0), "samples.jsonl gets a step's completions every this many steps (0: never)"
    )
    eval_batch_size: int = setting(16, integer(1), "prompts per batch of the held-out rewards")
    reference_offload: bool = setting(
        False, flag(), "the reference policy waits in CPU memory between uses"
    )


@dataclass(frozen=True)
class DynamicSampling(Settings):
    """GRPO's dynamic sampling (DAPO), synchronous or asynchronous: the keys ``grpo`` adds.

    >>> DynamicSampling().max_refills
    4
    """

    dynamic_sampling: bool = setting(
        False, flag(), "groups whose rewards are all equal are replaced by refills"
    )
    max_refills: int = setting(
        4, integer(0), "refill rounds a step may draw, then all-equal groups fill the gap"
    )


DYNAMIC_RULES = rules_of(settings_of(DynamicSampling))
"""The rule of each dynamic-sampling key."""


def _episode_problem(section: Any) -> str | None:
    """What building the ``episode`` section's
    :class:`~tunesmith.rl.envs.trajectory.EpisodeSettings` raises, or None.

    >>> _episode_problem({"max_turns": 0})
    'EpisodeLimits: max_turns must be an int >= 1, got 0'
    """
    if section is None:
        return None
    values = OmegaConf.to_container(section) if isinstance(section, DictConfig) else section
    try:
        EpisodeSettings.of(dict(values))
    except (TypeError, ValueError) as error:
        return str(error)
    return None


ENVIRONMENT_SECTIONS: tuple[Setting, ...] = (
    Setting("environment", component(null="single-turn rollouts"),
            "multi-turn rollouts: the environment each trajectory runs in (tools, feedback, "
            "rewards); then rewards, if given, add their scores of the last reply", None),
    Setting("rewards", component(null="the environment's rewards alone"),
            "the reward functions and their weights (or an environment's)", None),
    Setting("episode", replace(mapping("max_turns, step_timeout_s, max_tokens"),
                               extra=_episode_problem),
            "limits of each multi-turn trajectory (with an environment)", None),
)  # fmt: skip
"""GRPO's multi-turn sections (``environment`` makes ``rewards`` optional)."""
ENVIRONMENT_RULES = rules_of(ENVIRONMENT_SECTIONS)
"""The rule of each of GRPO's multi-turn sections."""


RL_SECTIONS: tuple[Setting, ...] = (
    Setting("prompts", component(required=True), "the prompts (with what the rewards need)",
            REQUIRED),
    Setting("val_prompts", component(null="no held-out rewards"),
            "held-out prompts: rewards of greedy answers at each evaluation", None),
    Setting("rewards", component(required=True), "the reward functions and their weights",
            REQUIRED),
    Setting("policy_loss", component(required=True), "the policy-gradient loss", REQUIRED),
    Setting("reference_model", component(
        null="the policy with its adapters off, or a frozen copy"),
        "the reference policy of the KL term", None),
    Setting("generation", replace(GENERATION_RULE, extra=_sampled_generation_problem),
            "how completions are sampled (max_new_tokens, "
            "temperature, ...) and the engine that samples them (engine: slots, cache)", None),
)  # fmt: skip
"""The RL keys whose values are components or sections read by what they build."""


@dataclass(frozen=True)
class AsyncSettings(Settings):
    """Asynchronous GRPO's keys (``grpo_async``, or ``grpo`` with ``async_mode`` set)."""

    async_mode: str | None = setting(
        None,
        choice("sync", "overlap", "off_policy", null="generate in the trainer"),
        "how rollouts overlap training (Ray workers)",
    )
    max_staleness: int = setting(
        0, integer(0), "policy versions a group may lag the trainer by (off_policy)"
    )
    buffer_size: int | None = setting(
        None,
        integer(1, null="enough for the mode"),
        "scored groups kept ready for the trainer",
        resumable=True,
    )
    max_worker_restarts: int = setting(
        3,
        integer(0),
        "restarts of a dead rollout or reward worker before the run stops",
        resumable=True,
    )


ASYNC_SECTIONS: tuple[Setting, ...] = (
    Setting("rollout", replace(
        mapping("workers, num_cpus, num_gpus, engine (local or vllm), vllm, merge_adapters, runtime_env (with --allow-runtime-env), weight_sync (object_store or collective), weight_sync_timeout_s"),
        extra=_workers_problem(_ROLLOUT_KEYS), nested=True),
        "the rollout workers (Ray actors) and their engine", None, resumable=True),
    Setting("reward_workers", replace(
        mapping("workers, num_cpus, num_gpus, runtime_env (with --allow-runtime-env)"),
        extra=_workers_problem(_REWARD_KEYS), nested=True),
        "the reward workers (Ray actors)", None, resumable=True),
    Setting("ray", replace(
        mapping("address (null: a local instance; auto or HOST:PORT: a cluster), num_cpus, temp_dir, log_to_driver, connect_timeout_s"),
        extra=_ray_problem, nested=True), "the Ray instance or cluster", None, resumable=True),
    Setting("trainer_group", TRAINER_GROUP_RULE,
            "who runs the trainer's ranks: torchrun's (default) or Ray actors", None,
            resumable=True),
)  # fmt: skip
"""Asynchronous GRPO's sections: where and with what its workers and trainer ranks run."""

RL_SETTINGS: tuple[Setting, ...] = (*settings_of(RLSettings), *RL_SECTIONS)
ASYNC_SETTINGS: tuple[Setting, ...] = (*settings_of(AsyncSettings), *ASYNC_SECTIONS)
RL_RULES = rules_of(RL_SETTINGS)
"""The rule of each key every RL recipe reads besides the loop's."""
ASYNC_RULES = rules_of(ASYNC_SETTINGS)
"""The rule of each asynchronous GRPO key."""
ASYNC_RESUMABLE = resumable_keys(ASYNC_SETTINGS)
"""Asynchronous GRPO's keys a resume may change (besides the loop's
:data:`~tunesmith.training.settings.RESUMABLE_KEYS`)."""


def rl_keys(extra: Mapping[str, Rule]) -> tuple[list[str], dict[str, Rule]]:
    """An RL recipe's ``KEYS`` and ``RULES``: the loop's (less the dataset's), the model
    step's (less ``loss``: RL's is ``policy_loss``), :data:`RL_RULES` and the recipe's own
    ``extra``.

    >>> keys, rules = rl_keys({"gamma": number(at_least=0, at_most=1)})
    >>> "dataset" in keys, "loss" in keys, "prompts" in keys, "gamma" in rules
    (False, False, True, True)
    """
    own = {**RL_RULES, **extra}
    model = [k for k in MODEL_KEYS if k != "loss"]  # RL's loss is policy_loss
    keys = [k for k in LOOP_KEYS if k not in _DATASET_KEYS] + [*model, *own]
    rules = {k: v for k, v in LOOP_RULES.items() if k not in _DATASET_KEYS}
    return keys, {**rules, **{k: MODEL_RULES[k] for k in model if k in MODEL_RULES}, **own}
