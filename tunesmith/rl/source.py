"""The rollout source: a :class:`~tunesmith.training.sources.BatchSource` whose batches the
policy generates, one collection at a time, on every data-parallel rank at once, in stages
that hand each other explicit records:

1. **sample** (a :class:`SampleStage`, called with the batch's index): this rank's scored
   groups of the batch as a :class:`Rollouts` record. :class:`LocalGroups` (the default)
   draws this rank's prompts of the step (:class:`~tunesmith.rl.prompts.PromptStream`),
   samples ``group_size`` completions of each with the policy itself through
   :func:`~tunesmith.generation.engine.generate_with` (keyed sampling: a completion depends
   only on ``seed``, the collection round, the prompt and its sample number, so rollouts are
   the same on any number of ranks and after a resume; all ranks decode the same number of
   steps) and **scores** them (:class:`~tunesmith.rl.rewards.RewardSet`); with
   ``dynamic_sampling`` groups whose rewards are all equal are dropped and more prompts drawn
   (up to ``max_refills`` rounds, then the zero-advantage groups fill the gap). Asynchronous
   GRPO passes :class:`~tunesmith.rl.asynchronous.source.PipelineGroups` instead.
2. **rows**: the groups as training rows (:func:`~tunesmith.rl.rollout.group_batch`).
3. **log-probs** (:class:`PolicyLogprobs`): the trainer's own log-probs of the sampled tokens
   (no gradient: the PPO ratio's "old" policy), the reference's for the KL, and the
   **log-prob parity check** against the sampler's (mean/max ``|delta|``; the run stops with
   :class:`LogprobMismatchError` above ``max_logprob_mismatch``).
4. **advantages** (an :class:`AdvantageStage`, after the log-probs, which PPO's needs):
   :class:`GroupAdvantages` (a group's rewards relative to each other); PPO passes
   :class:`~tunesmith.rl.ppo.trainer.GAEAdvantages` (the critic's values and GAE).
5. **batches**: the collection's metrics over all ranks (:func:`rollout_metrics`), then
   ``updates_per_batch`` optimizer steps on the batch, each over all its rows in micro-batches
   of ``micro_batch_size``.

The plain values come in one :class:`RolloutSettings`. The source's state (prompt position,
the sample stage's, the current batch while it is being trained on) is saved with every
checkpoint, so a resumed run continues exactly.

Example::

    settings = RolloutSettings(group_size=8, generation=GenerationConfig(max_new_tokens=64))
    source = RolloutSource(model=model, tokenizer=tok, prompts=stream, rewards=rewards,
                           ctx=ctx, settings=settings,
                           advantages=GroupAdvantages(GroupNormalized(), group_size=8))
    micro_batches = source.next_step()
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from tunesmith.generation.config import GenerationConfig
from tunesmith.generation.engine import LocalEngine, generate_with
from tunesmith.generation.generate import GenerationOutput
from tunesmith.models.atomic import open_no_follow
from tunesmith.modules.dtypes import AUTOCAST
from tunesmith.rl.envs.base import Environment
from tunesmith.rl.envs.trajectory import EpisodeSettings
from tunesmith.rl.groups import (
    Group,
    episode_failures,
    sample_groups,
    sample_trajectory_groups,
    score_groups,
)
from tunesmith.rl.prompts import PromptStream
from tunesmith.rl.rewards import RewardSet
from tunesmith.rl.rollout import completion_logprobs, group_batch, micro_batches, per_micro_batch
from tunesmith.training.parallel.distributed import DistributedContext
from tunesmith.training.setup import FrozenPolicy, pad_id

__all__ = [
    "AdvantageStage",
    "CollectionCycle",
    "GenerationConfig",
    "GroupAdvantages",
    "LocalGroups",
    "LogprobMismatchError",
    "PolicyLogprobs",
    "RolloutSettings",
    "RolloutSource",
    "advantage_stage",
    "all_reduce_values",
    "logprobs_under",
    "Rollouts",
    "SampleStage",
    "rollout_metrics",
    "stop_token_ids",
]

Batch = dict[str, torch.Tensor]


class LogprobMismatchError(RuntimeError):
    """The trainer's log-probs of the sampled tokens differ from the sampler's too much."""


@dataclass(frozen=True)
class RolloutSettings:
    """The rollout source's plain settings (:func:`tunesmith.rl.setup.rollout_settings` reads
    them from a config).

    Attributes:
        group_size: completions per prompt.
        generation: how completions are sampled.
        micro_batch_size: rows per forward (log-probs, values, the update).
        updates_per_batch: optimizer steps on each batch.
        dynamic_sampling / max_refills: groups with all-equal rewards replaced by refills,
            at most this many rounds of them.
        overlong_filter: a completion cut at ``max_new_tokens`` trains no token.
        max_logprob_mismatch: the parity check's limit (None: none).
        mixed_precision: the autocast of the forwards (``bf16``...; None: none).
        chat_template: prompts through the tokenizer's chat template.
        seed: keyed sampling's seed.
        chunk_size: completion tokens per head application in the log-probs.
        samples_file / log_samples_every: a group of completions appended every this many
            batches (0: never).
        episode: multi-turn rollouts' limits (with an environment; None: single-turn).

    Example::

        >>> RolloutSettings(group_size=4).updates_per_batch
        1
        >>> RolloutSettings(group_size=0)
        Traceback (most recent call last):
        ValueError: group_size must be >= 1, got 0
    """

    group_size: int
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    micro_batch_size: int = 8
    updates_per_batch: int = 1
    dynamic_sampling: bool = False
    max_refills: int = 4
    overlong_filter: bool = False
    max_logprob_mismatch: float | None = None
    mixed_precision: str | None = None
    chat_template: bool = True
    seed: int = 0
    chunk_size: int = 1024
    samples_file: Path | None = None
    log_samples_every: int = 0
    episode: EpisodeSettings | None = None

    def __post_init__(self) -> None:
        if self.group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {self.group_size}")
        if self.episode is not None and not self.chat_template:
            raise ValueError(
                "chat_template: false, but an environment's turns are chat messages: "
                "multi-turn rollouts render them with the chat template"
            )
        check_sampled(self.generation)

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        return AUTOCAST[self.mixed_precision]


def check_sampled(config: GenerationConfig) -> GenerationConfig:
    """``config``, refused when it decodes greedily: a policy gradient needs samples.

    >>> check_sampled(GenerationConfig(temperature=0.0))
    Traceback (most recent call last):
    ValueError: generation.temperature must be > 0 for RL sampling, got 0.0
    """
    if config.temperature == 0:
        raise ValueError(
            f"generation.temperature must be > 0 for RL sampling, got {config.temperature}"
        )
    return config


@dataclass
class Rollouts:
    """What a sample stage hands on: this rank's scored groups of one batch.

    Attributes:
        groups: the groups of the batch, in order (scored: ``rewards``, ``per_reward``).
        failures: the reward functions' failure counts.
        drawn_groups / flat_groups: the groups drawn for the batch (refills included) and how
            many of them had all-equal rewards (summed over the ranks: counted where drawn).
        times: ``generate_s``, ``reward_s`` (seconds) and ``generated_tokens``.
        epoch: the prompt stream's epoch after the draw.
        version: the policy being trained, when the groups were sampled elsewhere (the rows
            then get their ``policy_lag``); None: sampled by the policy itself.
        metrics: the stage's own metrics, the same on every rank (added to the batch's).
    """

    groups: list[Group]
    failures: dict[str, int] = field(default_factory=dict)
    drawn_groups: int = 0
    flat_groups: int = 0
    times: dict[str, float] = field(default_factory=dict)
    epoch: int = 0
    version: int | None = None
    metrics: dict[str, float] = field(default_factory=dict)


class SampleStage(Protocol):
    """Where a batch's groups come from: ``stage(batch_index)`` returns the :class:`Rollouts`
    of that batch (0 first); its state is saved with the source's."""

    def __call__(self, batch_index: int) -> Rollouts: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class AdvantageStage(Protocol):
    """``stage(batch)`` puts ``advantages`` (and whatever else its update reads) in a batch
    that has its log-probs, and returns its metrics, reduced over the ranks (they replace the
    rollout metrics of the same name)."""

    def __call__(self, batch: Batch) -> dict[str, float]: ...


# -- stages


class LocalGroups:
    """The sample stage of the synchronous recipes: every rank samples its prompts' groups
    with ``model`` and scores them with ``rewards`` (see the module docs). With an
    ``environment``, each completion is a multi-turn trajectory
    (:func:`~tunesmith.rl.envs.trajectory.sample_trajectories`, limits in
    ``settings.episode``) scored by the environment, plus ``rewards`` (if any) of its last
    reply. Its state is the collection round.

    Example::

        sample = LocalGroups(model, tokenizer, stream, rewards, ctx, settings)
        rollouts = sample(0)  # rollouts.groups: this rank's prompts_per_step / dp groups
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any,
        prompts: PromptStream,
        rewards: RewardSet | None,
        ctx: DistributedContext,
        settings: RolloutSettings,
        environment: Environment | None = None,
    ) -> None:
        if rewards is None and environment is None:
            raise ValueError("LocalGroups: rewards=, environment= or both score the groups")
        self.tokenizer, self.prompts, self.rewards = tokenizer, prompts, rewards
        self.environment = environment
        self.ctx, self.settings = ctx, settings
        self.stop_token_ids = stop_token_ids(tokenizer, settings.generation.stop_tokens)
        self.engine = LocalEngine(
            model,
            tokenizer,
            pad_id=pad_id(tokenizer),
            autocast_dtype=settings.autocast_dtype,
            sync_ranks=ctx.world_size > 1,
            settings=settings.generation.engine,
        )
        self.round = 0  # collections so far (one or more per batch with dynamic sampling)

    def __call__(self, batch_index: int) -> Rollouts:
        dynamic = self.settings.dynamic_sampling
        times = {"generate_s": 0.0, "reward_s": 0.0}
        kept, spare, failures = [], [], {}
        wanted, drawn, flat_groups = 0, 0, 0  # wanted: the first round's groups
        for _ in range(1 + (self.settings.max_refills if dynamic else 0)):
            groups = self.sample(times)
            for key, count in self.score(groups, times).items():
                failures[key] = failures.get(key, 0) + count
            wanted = wanted or len(groups)
            drawn += len(groups)
            for g in groups:
                flat = bool((g.rewards == g.rewards[0]).all())
                flat_groups += int(flat)
                (spare if dynamic and flat else kept).append(g)
            if not dynamic or not _any_rank(wanted - len(kept) > 0, self.ctx):
                break
        kept += spare[: max(wanted - len(kept), 0)]  # refills ran out: zero-advantage groups
        return Rollouts(
            kept[:wanted],
            failures,
            drawn_groups=drawn,
            flat_groups=flat_groups,
            times=times,
            epoch=self.prompts.epoch,
            metrics=episode_metrics(kept[:wanted], self.ctx) if self.environment else {},
        )

    def sample(self, times: dict[str, float]) -> list[Group]:
        """The groups of the stream's next prompts (one collection round)."""
        prompts = self.prompts.next_prompts()
        start = time.perf_counter()
        s = self.settings
        if self.environment is not None:
            with self.engine.keep_prefixes():  # each turn continues its conversation's cache
                groups = sample_trajectory_groups(
                    self._generate,
                    self.tokenizer,
                    self.environment,
                    prompts,
                    round=self.round,
                    group_size=s.group_size,
                    seed=s.seed,
                    episode=s.episode or EpisodeSettings(),
                    max_new_tokens=s.generation.max_new_tokens,
                    stop_token_ids=self.stop_token_ids,
                    keep_going=lambda live: _any_rank(live, self.ctx),
                )
        else:
            groups = sample_groups(
                self._generate,
                self.tokenizer,
                prompts,
                round=self.round,
                group_size=s.group_size,
                seed=s.seed,
                chat_template=s.chat_template,
            )
        self.round += 1
        times["generate_s"] += time.perf_counter() - start
        times["generated_tokens"] = times.get("generated_tokens", 0) + sum(
            len(c) for g in groups for c in g.completions
        )
        return groups

    def score(self, groups: list[Group], times: dict[str, float]) -> dict[str, int]:
        """Score ``groups`` (their ``rewards``); returns the reward failures."""
        start = time.perf_counter()
        failures = episode_failures(groups)
        if self.rewards is not None:
            for key, count in score_groups(self.rewards, groups).items():
                failures[key] = failures.get(key, 0) + count
        times["reward_s"] += time.perf_counter() - start
        return failures

    def _generate(
        self, rows: list[list[int]], keys: list[int], limits: list[int] | None = None
    ) -> GenerationOutput:
        """The policy's completions of ``rows`` (``limits``: one token limit per row instead
        of ``generation.max_new_tokens``), through the engine every rollout decodes with (the
        trained model itself here; every rank decodes the same number of steps)."""
        return generate_with(
            self.engine,
            rows,
            keys,
            self.settings.generation,
            self.stop_token_ids,
            max_new_tokens=limits,
        )

    def state_dict(self) -> dict[str, Any]:
        return {"round": self.round}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.round = int(state["round"])


class PolicyLogprobs:
    """The log-probs stage: ``old_logprobs`` (the policy now, in train mode as the update
    will see it) and, with a ``reference``, ``ref_logprobs``, micro-batch by micro-batch;
    :meth:`check` is the parity check.

    Example::

        logprobs = PolicyLogprobs(model, reference, ctx, settings)
        logprobs(batch)  # batch["old_logprobs"], batch["ref_logprobs"]: [b, L]
    """

    def __init__(
        self,
        model: nn.Module,
        reference: FrozenPolicy | None,
        ctx: DistributedContext,
        settings: RolloutSettings,
    ) -> None:
        self.policies = {"old_logprobs": FrozenPolicy(model)}
        if reference is not None:
            self.policies["ref_logprobs"] = reference
        self.ctx, self.settings = ctx, settings

    def __call__(self, batch: Batch) -> None:
        s = self.settings
        for key, policy in self.policies.items():
            batch[key] = per_micro_batch(
                logprobs_under(policy, s.generation.temperature, s.chunk_size),
                batch,
                s.micro_batch_size,
                self.ctx,
                s.autocast_dtype,
            )

    def check(self, metrics: dict[str, float]) -> None:
        """Raise :class:`LogprobMismatchError` when the rollout ``metrics`` show a larger
        ``|delta|`` than ``max_logprob_mismatch``."""
        limit, worst = self.settings.max_logprob_mismatch, metrics["logprob_mismatch_max"]
        if limit is not None and worst > limit:
            raise LogprobMismatchError(
                f"the trainer's log-probs of the sampled tokens differ from the sampler's by up "
                f"to {worst:.3g} (mean {metrics['logprob_mismatch_mean']:.3g}), "
                f"above max_logprob_mismatch={limit}: the generator does not run the policy "
                "being trained (different weights, dtype or sampling temperature?)"
            )


def logprobs_under(
    policy: Callable[[], Any], temperature: float, chunk_size: int = 1024
) -> Callable[[Batch], torch.Tensor]:
    """The completion log-probs of a micro-batch under ``policy`` (a
    :class:`~tunesmith.training.setup.FrozenPolicy`) at ``temperature``: the trainer's and the
    reference's (here and in the reward workers), one micro-batch at a time with
    :func:`~tunesmith.rl.rollout.per_micro_batch`."""

    def logprobs(part: Batch) -> torch.Tensor:
        with policy() as model:
            return completion_logprobs(model, part, temperature=temperature, chunk_size=chunk_size)

    return logprobs


class GroupAdvantages:
    """The advantages stage of GRPO and its variants: ``estimator(rewards, group_size)``
    (e.g. :class:`~tunesmith.rl.advantages.GroupNormalized`), one advantage per row (the
    metrics' ``advantage_mean`` / ``advantage_std`` are theirs).

    Example::

        >>> from tunesmith.rl.advantages import LeaveOneOut
        >>> batch = {"rewards": torch.tensor([1.0, 0.0, 2.0, 2.0])}  # two groups of two
        >>> GroupAdvantages(LeaveOneOut(), group_size=2)(batch)
        {}
        >>> batch["advantages"]
        tensor([ 1., -1.,  0.,  0.])
    """

    def __init__(
        self, estimator: Callable[[torch.Tensor, int], torch.Tensor], group_size: int
    ) -> None:
        self.estimator, self.group_size = estimator, int(group_size)

    def __call__(self, batch: Batch) -> dict[str, float]:
        batch["advantages"] = self.estimator(batch["rewards"], self.group_size).float()
        return {}


def advantage_stage(advantage: Any, group_size: int) -> AdvantageStage:
    """The rollout source's advantages stage for a config's ``advantage``: a group estimator
    (``estimator(rewards, group_size)``) in :class:`GroupAdvantages`, or a stage of its own
    (per-token, e.g. :class:`~tunesmith.rl.advantages.TeacherReverseKL`) as it is.

    >>> from tunesmith.rl.advantages import LeaveOneOut, TeacherReverseKL
    >>> type(advantage_stage(LeaveOneOut(), 4)).__name__, type(advantage_stage(
    ...     TeacherReverseKL(), 4)).__name__
    ('GroupAdvantages', 'TeacherReverseKL')
    """
    from tunesmith.rl.advantages import is_stage

    return advantage if is_stage(advantage) else GroupAdvantages(advantage, group_size)


# -- the source


class CollectionCycle:
    """What every sampled batch source repeats: a new collection (``_collect()``, this rank's
    share of one batch) every ``settings.updates_per_batch`` optimizer steps, each step's
    micro-batches cut from it (``_step_batches``), its metrics for the step that made it, and
    the resumable state (prompt position, the sample stage's, the collection being trained on,
    saved under ``COLLECTED_KEY`` by ``_saved``). A class using it sets ``prompts``,
    ``sample``, ``settings`` and calls :meth:`_start_cycle` in its constructor."""

    COLLECTED_KEY = "batch"

    def _start_cycle(self) -> None:
        self.epoch = 0  # kept in step with the prompt stream
        self.batches = 0
        self.updates_left = 0
        self._collected: Any = None
        self._metrics: dict[str, float] = {}

    def next_step(self) -> list[Batch]:
        """The micro-batches of the next optimizer step (collecting anew when the current
        collection has had its ``updates_per_batch`` steps)."""
        self._metrics = {}
        if self._collected is None or self.updates_left == 0:
            self._collected = self._collect()
            self.updates_left = self.settings.updates_per_batch
            self.batches += 1
        self.updates_left -= 1
        return self._step_batches(self._collected)

    def step_metrics(self) -> dict[str, float]:
        """The metrics of the collection the last step made (empty when it made none)."""
        return dict(self._metrics)

    def state_dict(self) -> dict[str, Any]:
        return {
            "prompts": self.prompts.state_dict(), **self.sample.state_dict(),
            "batches": self.batches, "updates_left": self.updates_left,
            self.COLLECTED_KEY: None if self._collected is None else self._saved(self._collected),
        }  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.prompts.load_state_dict(state["prompts"])
        self.epoch = self.prompts.epoch
        self.batches, self.updates_left = int(state["batches"]), int(state["updates_left"])
        self._collected = state[self.COLLECTED_KEY]
        self.sample.load_state_dict(state)

    def _saved(self, collected: Any) -> Any:
        return collected

    def _collect(self) -> Any:
        raise NotImplementedError

    def _step_batches(self, collected: Any) -> list[Batch]:
        raise NotImplementedError


class RolloutSource(CollectionCycle):
    """Batches generated by ``model`` from ``prompts`` (see the module docs), stage by stage:
    ``sample`` (default: :class:`LocalGroups` of ``model`` scored by ``rewards``), the rows,
    :class:`PolicyLogprobs` (``reference``, a :class:`~tunesmith.training.setup.FrozenPolicy`,
    adds ``ref_logprobs``), ``advantages``, the metrics and micro-batches. The sampler's
    log-probs are always in the batch as ``sampling_logprobs``."""

    def __init__(
        self,
        *,
        model: nn.Module,
        tokenizer: Any,
        prompts: PromptStream,
        ctx: DistributedContext,
        settings: RolloutSettings,
        advantages: AdvantageStage,
        rewards: RewardSet | None = None,
        reference: FrozenPolicy | None = None,
        sample: SampleStage | None = None,
        environment: Environment | None = None,
    ) -> None:
        if sample is None:
            if rewards is None and environment is None:
                raise ValueError(
                    "RolloutSource: rewards=, environment= or both score the groups it samples"
                )
            sample = LocalGroups(model, tokenizer, prompts, rewards, ctx, settings, environment)
        self.model, self.tokenizer, self.prompts, self.ctx = model, tokenizer, prompts, ctx
        self.settings, self.pad_id = settings, pad_id(tokenizer)
        # the ids that end a completion: what an evaluator decoding as the source does stops at
        self.stop_token_ids = stop_token_ids(tokenizer, settings.generation.stop_tokens)
        self.sample: SampleStage = sample
        self.logprobs = PolicyLogprobs(model, reference, ctx, settings)
        self.advantages = advantages
        self._start_cycle()

    def _step_batches(self, collected: Batch) -> list[Batch]:
        return micro_batches(collected, self.settings.micro_batch_size)

    def _saved(self, collected: Batch) -> Batch:
        return {k: v.cpu() for k, v in collected.items()}

    # -- one collection: the stages in order

    @torch.no_grad()
    def _collect(self) -> Batch:
        rollouts = self.sample(self.batches)
        self.epoch = rollouts.epoch
        batch = group_batch(
            rollouts.groups,
            self.pad_id,
            version=rollouts.version,
            overlong_filter=self.settings.overlong_filter,
        )
        start = time.perf_counter()
        self.logprobs(batch)
        times = rollouts.times | {"logprobs_s": time.perf_counter() - start}
        advantage_metrics = self.advantages(batch)
        metrics = rollout_metrics(rollouts, batch, times, self.ctx)
        self.logprobs.check(metrics)
        self._metrics = metrics | rollouts.metrics | advantage_metrics
        self._log_samples(rollouts.groups)
        return batch

    def _log_samples(self, groups: Sequence[Group]) -> None:
        """Every ``log_samples_every`` batches, rank 0's first group to ``samples_file``."""
        s = self.settings
        if not (s.samples_file and s.log_samples_every and self.ctx.is_rank_zero):
            return
        if self.batches % s.log_samples_every:
            return
        first = groups[0]
        record = {
            "batch": self.batches + 1, "prompt": first.prompt_text,
            "answer": _plain(first.prompt.answer),
            "completions": first.texts[: s.group_size], "rewards": first.rewards.tolist(),
        }  # fmt: skip
        if first.episodes is not None:  # whole trajectories: messages, tool calls and results
            record["trajectories"] = _plain(first.episodes[: s.group_size])
        path = Path(s.samples_file)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open_no_follow(path, "a") as f:  # a planted link: refused
            f.write(json.dumps(record, ensure_ascii=False) + "\n")


# -- metrics


def rollout_metrics(
    rollouts: Rollouts, batch: Batch, times: dict[str, float], ctx: DistributedContext
) -> dict[str, float]:
    """A collection's metrics over all data-parallel ranks (one all-reduce of sums, one of
    maxima): rewards, lengths, the share of groups with all-equal rewards, the advantages
    (per row), the log-prob parity (``logprob_mismatch_*``) and the stages' times."""
    mask = batch["labels"] != -100
    if "policy_lag" in batch:  # asynchronous: only what the current policy sampled compares
        mask = mask & (batch["policy_lag"] == 0)[:, None]
    delta = (batch["old_logprobs"] - batch["sampling_logprobs"]).abs() * mask
    groups, rewards = rollouts.groups, batch["rewards"]
    lengths = torch.tensor([len(c) for g in groups for c in g.completions], dtype=torch.float64)
    names = sorted({k for g in groups for k in g.per_reward})
    per_reward = {
        k: torch.cat([g.per_reward[k] for g in groups if k in g.per_reward]) for k in names
    }
    sums = {
        "samples": float(len(rewards)), "reward_sum": float(rewards.sum()),
        "reward_sq": float((rewards.double() ** 2).sum()), "length_sum": float(lengths.sum()),
        "stopped": float(sum(f == "stop" for g in groups for f in g.finish)),
        "tokens": float(mask.sum()), "delta_sum": float(delta.sum()),
        "kl_sum": float(((batch["sampling_logprobs"] - batch["old_logprobs"]) * mask).sum()),
        "zero_variance": float(rollouts.flat_groups), "groups": float(rollouts.drawn_groups),
        "adv_sum": float(batch["advantages"].sum()),
        "adv_sq": float((batch["advantages"].double() ** 2).sum()),
        "failures": float(sum(rollouts.failures.values())),
        **{f"r/{k}": float(per_reward[k].sum()) for k in names},
        **{f"t/{k}": v for k, v in times.items()},
    }  # fmt: skip
    maxima = {"delta_max": float(delta.max()) if mask.any() else 0.0,
              "length_max": float(lengths.max()) if len(lengths) else 0.0}  # fmt: skip
    sums = all_reduce_values(sums, ctx, dist.ReduceOp.SUM)
    maxima = all_reduce_values(maxima, ctx, dist.ReduceOp.MAX)
    n, tokens, ranks = max(sums["samples"], 1.0), max(sums["tokens"], 1.0), ctx.dp_size
    mean, adv_mean = sums["reward_sum"] / n, sums["adv_sum"] / n
    return {
        "reward": mean, "reward_std": math.sqrt(max(sums["reward_sq"] / n - mean**2, 0.0)),
        **{f"reward/{k}": sums[f"r/{k}"] / n for k in names},
        "reward_failures": sums["failures"],
        "completion_length": sums["length_sum"] / n, "completion_length_max": maxima["length_max"],
        "stopped_fraction": sums["stopped"] / n,
        "zero_variance_groups": sums["zero_variance"] / max(sums["groups"], 1.0),
        "advantage_mean": adv_mean,
        "advantage_std": math.sqrt(max(sums["adv_sq"] / n - adv_mean**2, 0.0)),
        "logprob_mismatch_mean": sums["delta_sum"] / tokens,
        "logprob_mismatch_max": maxima["delta_max"],
        "logprob_mismatch_kl": sums["kl_sum"] / tokens,
        "generate_s": sums["t/generate_s"] / ranks, "reward_s": sums["t/reward_s"] / ranks,
        "logprobs_s": sums["t/logprobs_s"] / ranks,
        "generated_tokens_per_s": sums["t/generated_tokens"]
        / max(sums["t/generate_s"] / ranks, 1e-9),
        "rollout_samples": sums["samples"],
    }  # fmt: skip


def episode_metrics(groups: Sequence[Group], ctx: DistributedContext) -> dict[str, float]:
    """Multi-turn groups' trajectory metrics over all data-parallel ranks: ``env/turns``
    (mean assistant turns), ``env/<count>`` (mean per trajectory of each counted event:
    ``tool_calls``, ``malformed_calls``, ``tool_errors``...), ``env/ended_<ending>`` (the share
    of trajectories that ended so) and ``env/policy_tokens`` (mean sampled tokens).

    Example::

        >>> ctx = DistributedContext(rank=0, world_size=1, local_rank=0,
        ...                          device=torch.device("cpu"), mesh=None)
        >>> episode_metrics([], ctx)["env/turns"]
        0.0
    """
    from tunesmith.rl.envs.episode import ENDINGS

    summaries = [e for g in groups for e in g.episodes or []]
    masks = [m for g in groups for m in g.masks or []]
    counts = sorted({k for e in summaries for k in e["counts"]} | {"tool_calls"})
    sums = {
        "n": float(len(summaries)), "turns": float(sum(e["turns"] for e in summaries)),
        "policy_tokens": float(sum(sum(m) for m in masks)),
        **{f"count/{k}": float(sum(e["counts"].get(k, 0) for e in summaries)) for k in counts},
        **{f"ended/{k}": float(sum(e["ended"] == k for e in summaries)) for k in ENDINGS},
    }  # fmt: skip
    sums = all_reduce_values(sums, ctx, dist.ReduceOp.SUM)
    n = max(sums.pop("n"), 1.0)
    out = {"env/turns": sums["turns"] / n, "env/policy_tokens": sums["policy_tokens"] / n}
    for key, value in sums.items():
        kind, _, name = key.partition("/")
        if kind == "count":
            out[f"env/{name}"] = value / n
        elif kind == "ended":
            out[f"env/ended_{name}"] = value / n
    return out


# -- helpers


def stop_token_ids(tokenizer: Any, stop_tokens: Sequence[str]) -> list[int]:
    """The ids that end a completion: the tokenizer's own stop ids (end of sequence, the
    generation config's, the end-of-turn tokens its vocabulary has: the ones ``generate`` and
    ``chat`` stop at) and ``stop_tokens``."""
    ids = list(getattr(tokenizer, "stop_token_ids", ()))
    ids += [] if tokenizer.eos_id is None else [tokenizer.eos_id]
    for token in stop_tokens:
        token_id = tokenizer.token_to_id(token)
        if token_id is None:
            raise ValueError(f"generation.stop_tokens: {token!r} is not a token of the tokenizer")
        ids.append(token_id)
    return sorted(set(ids))


def _any_rank(flag: bool, ctx: DistributedContext) -> bool:
    if ctx.world_size == 1:
        return flag
    value = torch.tensor(float(flag), device=ctx.device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def all_reduce_values(
    values: dict[str, float], ctx: DistributedContext, op: Any
) -> dict[str, float]:
    """``values`` reduced with ``op`` (``dist.ReduceOp.SUM``, ``MAX``...) over the
    data-parallel ranks, key by key (every rank passes the same keys); one process: as given."""
    if ctx.world_size == 1 or not values:
        return values
    keys = sorted(values)
    tensor = torch.tensor([values[k] for k in keys], dtype=torch.float64, device=ctx.device)
    dist.all_reduce(tensor, op=op, group=ctx.dp_group)
    return dict(zip(keys, tensor.tolist()))


def _plain(value: Any) -> Any:
    try:
        json.dumps(value)
        return value
    except TypeError:
        return str(value)
