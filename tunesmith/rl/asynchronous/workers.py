"""The remote roles of asynchronous GRPO, each run in its own Ray actor process:

* :class:`RolloutWorker`: a copy of the policy behind a rollout engine
  (:class:`~tunesmith.generation.engine.LocalEngine`, or vLLM's with ``rollout.engine: vllm``)
  that samples groups for the prompts it is sent, tagged with its policy version, and takes new
  weights by Hugging Face name, from Ray's object store (``load_weights``) or from a broadcast
  of trainer rank 0 (``join_weight_sync`` then ``receive_weights``,
  :mod:`tunesmith.rl.asynchronous.weight_sync`);
* :class:`RewardWorker`: scores groups (the config's ``rewards``) and, with a KL term, adds the
  reference policy's log-probs of the sampled tokens.

Both are plain classes built from :class:`WorkerSettings`: what they read of the run, typed,
built once by the driver (:func:`tunesmith.rl.setup.worker_settings`), with the few config
sections their builders read (tokenizer, model, precision, rewards, reference model), not the
whole config. Neither imports Ray: the pipeline that drives them makes a Ray actor of each
(:class:`~tunesmith.rl.asynchronous.pipeline.RolloutPipeline`).

Example::

    worker = RolloutWorker(settings, threads=1)
    groups, stats = worker.rollout(prompts, round=0)
    groups, failures, stats = RewardWorker(settings).score((groups, stats))
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from omegaconf import OmegaConf

from tunesmith.config import instantiate
from tunesmith.generation.config import GenerationConfig
from tunesmith.generation.engine import LocalEngine, generate_with
from tunesmith.modules.dtypes import AUTOCAST
from tunesmith.modules.peft.apply import adapter_modules, merge_adapters
from tunesmith.rl.asynchronous.weight_sync import TensorSpec, WeightReceiver
from tunesmith.rl.envs.trajectory import EpisodeSettings
from tunesmith.rl.groups import (
    Group,
    episode_failures,
    sample_groups,
    sample_trajectory_groups,
    score_groups,
)
from tunesmith.rl.prompts import Prompt
from tunesmith.rl.rollout import group_masks, per_micro_batch, rollout_batch
from tunesmith.rl.source import logprobs_under, stop_token_ids
from tunesmith.training import setup
from tunesmith.training.parallel.distributed import DistributedContext

BUILD_SECTIONS = ("model_dir", "tokenizer", "model", "precision", "mixed_precision",
                  "attention_backend", "rewards", "reference_model", "reference_offload",
                  "environment")  # fmt: skip
"""The config sections a worker's builders read (``setup.load_tokenizer``, ``build_policy``,
``reference_policy``, the rewards), resolved: all a worker gets of the config."""


@dataclass(frozen=True)
class WorkerSettings:
    """What the rollout and reward workers read of the run (see the module docs).

    Example::

        >>> settings = WorkerSettings(group_size=4, micro_batch_size=8, seed=3)
        >>> settings.engine, settings.kl_coef, settings.generation.temperature
        ('local', 0.0, 1.0)
    """

    group_size: int
    micro_batch_size: int
    seed: int = 0
    chat_template: bool = True
    overlong_filter: bool = False
    mixed_precision: str | None = None
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    engine: str = "local"
    vllm: Mapping[str, Any] = field(default_factory=dict)
    merge_adapters: bool = False
    kl_coef: float = 0.0
    reference_logprobs: bool = False
    """The reference's log-probs are wanted without a KL term (a teacher's, for the
    advantage: :class:`~tunesmith.rl.advantages.TeacherReverseKL`)."""
    device: str = "auto"
    episode: EpisodeSettings | None = None
    """Multi-turn trajectories' limits (the run has an ``environment``); None: single-turn."""
    build: Mapping[str, Any] = field(default_factory=dict)
    """:data:`BUILD_SECTIONS` of the run's config, resolved."""


__all__ = ["BUILD_SECTIONS", "RewardWorker", "RolloutWorker", "WorkerSettings", "local_context"]


def local_context(device: str = "cpu") -> DistributedContext:
    """The context of a process that trains nothing and joins no process group."""
    return DistributedContext(
        rank=0, world_size=1, local_rank=0, device=torch.device(device), mesh=None
    )  # type: ignore[arg-type]


class _Role:
    """What both roles share: the settings, threads, tokenizer and busy time."""

    def __init__(self, settings: WorkerSettings, threads: int = 1, cwd: str | None = None) -> None:
        if cwd is not None and os.path.isdir(cwd):  # the driver's: relative paths hold
            os.chdir(cwd)
        torch.set_num_threads(max(1, int(threads)))
        self.settings = settings
        self.build = OmegaConf.create(dict(settings.build))  # what the builders read
        self.tokenizer = setup.load_tokenizer(self.build)
        self.device = "cuda" if torch.cuda.is_available() and settings.device != "cpu" else "cpu"
        self.ctx = local_context(self.device)
        self.busy_s = 0.0

    def pid(self) -> int:
        """This process (a test kills it to check that nothing is lost)."""
        return os.getpid()


class RolloutWorker(_Role):
    """Samples groups with its copy of the policy (see the module docs)."""

    def __init__(self, settings: WorkerSettings, threads: int = 1, cwd: str | None = None) -> None:
        super().__init__(settings, threads, cwd)
        self.generation = settings.generation
        self.stop_token_ids = stop_token_ids(self.tokenizer, self.generation.stop_tokens)
        self.pad_id = setup.pad_id(self.tokenizer)
        if settings.engine == "vllm":
            from tunesmith.generation.vllm_engine import VLLMEngine

            self.engine: Any = VLLMEngine(
                self.build.model_dir, seed=settings.seed, **dict(settings.vllm)
            )
        else:
            model = setup.build_policy(self.build, self.ctx, self.tokenizer)
            if settings.merge_adapters and adapter_modules(model):
                merge_adapters(model)  # a dense copy: the trainer sends merged weights
            self.engine = LocalEngine(
                model,
                self.tokenizer,
                pad_id=self.pad_id,
                autocast_dtype=AUTOCAST[settings.mixed_precision],
                settings=self.generation.engine,
            )
        self.version = 0
        self.receiver = WeightReceiver(self.device)
        environment = self.build.get("environment")  # runs here, trajectory by trajectory
        self.environment = instantiate(environment) if environment is not None else None

    def load_weights(self, named: Mapping[str, torch.Tensor], version: int) -> int:
        """Take the policy of ``version`` (every trainable tensor, by name)."""
        start = time.perf_counter()
        self.engine.load_weights(named)
        self.version = int(version)
        self.busy_s += time.perf_counter() - start
        return self.version

    def join_weight_sync(
        self,
        host: str,
        port: int,
        generation: int,
        *,
        rank: int,
        size: int,
        backend: str,
        timeout_s: float,
        layout: Sequence[TensorSpec],
    ) -> None:
        """Join ``generation`` of the weight-sync group of trainer rank 0 (its store at
        ``host:port``) as ``rank`` of ``size``; ``layout``: the tensors every send holds."""
        self.receiver.join(
            host,
            port,
            generation,
            rank=rank,
            size=size,
            backend=backend,
            timeout_s=timeout_s,
            layout=layout,
        )

    def receive_weights(self, generation: int, seq: int, version: int) -> bool | None:
        """Take the policy of ``version`` from send ``seq`` of the group (by name, as
        :meth:`load_weights`): True; False when this process is not in ``generation`` (it
        restarted since); None when the trainer abandoned the send (a newer group follows)."""
        if self.receiver.generation != generation:
            return False
        named = self.receiver.receive(generation, seq)
        if named is None:
            return None
        self.load_weights(named, version)
        return True

    def rollout(
        self, prompts: Sequence[Prompt], round: int
    ) -> tuple[list[Group], dict[str, float]]:
        """``group_size`` completions of each prompt (keys of collection ``round``), tagged
        with this worker's policy version; and the time and tokens it took."""
        settings, g = self.settings, self.generation
        start = time.perf_counter()

        def generate(rows: list[list[int]], keys: list[int], limits: Any = None) -> Any:
            return generate_with(
                self.engine, rows, keys, g, self.stop_token_ids, max_new_tokens=limits
            )

        if self.environment is not None:
            with self.engine.keep_prefixes():  # each turn continues its conversation's cache
                groups = sample_trajectory_groups(
                    generate,
                    self.tokenizer,
                    self.environment,
                    prompts,
                    round=round,
                    group_size=settings.group_size,
                    seed=settings.seed,
                    episode=settings.episode or EpisodeSettings(),
                    max_new_tokens=g.max_new_tokens,
                    stop_token_ids=self.stop_token_ids,
                    version=self.version,
                )
        else:
            groups = sample_groups(
                generate,
                self.tokenizer,
                prompts,
                round=round,
                group_size=settings.group_size,
                seed=settings.seed,
                chat_template=settings.chat_template,
                version=self.version,
            )
        seconds = time.perf_counter() - start
        self.busy_s += seconds
        tokens = sum(len(c) for group in groups for c in group.completions)
        return groups, {"generate_s": seconds, "generated_tokens": float(tokens)}


class RewardWorker(_Role):
    """Scores groups and adds the reference's log-probs (see the module docs)."""

    def __init__(self, settings: WorkerSettings, threads: int = 1, cwd: str | None = None) -> None:
        super().__init__(settings, threads, cwd)
        rewards = self.build.get("rewards")  # None: the environment's rewards alone
        self.rewards = instantiate(rewards) if rewards is not None else None
        self.reference = None
        if settings.kl_coef > 0 or settings.reference_logprobs:
            policy = setup.build_policy(self.build, self.ctx, self.tokenizer)
            self.reference = setup.reference_policy(
                self.build, self.ctx, policy, lambda *a: None, tokenizer=self.tokenizer
            )
        self.temperature = settings.generation.temperature
        self.micro_batch_size = settings.micro_batch_size
        self.overlong_filter = settings.overlong_filter
        self.autocast_dtype = AUTOCAST[settings.mixed_precision]

    def score(
        self, rolled: tuple[list[Group], dict[str, float]]
    ) -> tuple[list[Group], dict[str, int], dict[str, float]]:
        """A rollout's ``(groups, stats)`` scored: the groups with their rewards (and
        reference log-probs), the reward failures, and the stats with the time it took."""
        groups, stats = rolled
        start = time.perf_counter()
        failures = episode_failures(groups)
        if self.rewards is not None:
            for key, count in score_groups(self.rewards, groups).items():
                failures[key] = failures.get(key, 0) + count
        reward_s = time.perf_counter() - start
        if self.reference is not None:
            self._reference_logprobs(groups)
        seconds = time.perf_counter() - start
        self.busy_s += seconds
        return groups, failures, {**stats, "reward_s": reward_s, "reference_s": seconds - reward_s}

    @torch.no_grad()
    def _reference_logprobs(self, groups: list[Group]) -> None:
        """Each completion's tokens' log-probs under the reference, computed on the groups'
        rows padded together and cut in micro-batches as the synchronous recipe does."""
        prompts = [g.prompt_ids for g in groups for _ in range(g.size)]
        completions = [
            c if f == "stop" or not self.overlong_filter else []
            for g in groups
            for c, f in zip(g.completions, g.finish)
        ]
        cut = [not c for c in completions]  # by the overlong filter, or empty
        batch = rollout_batch(
            prompts, completions, setup.pad_id(self.tokenizer), masks=group_masks(groups, cut)
        )
        logprobs = logprobs_under(self.reference, self.temperature)
        values = per_micro_batch(
            logprobs, batch, self.micro_batch_size, self.ctx, self.autocast_dtype
        )
        row = 0
        for g in groups:
            g.ref_logprobs = []
            for completion in completions[row : row + g.size]:
                start = len(prompts[row]) - 1
                g.ref_logprobs.append(values[row, start : start + len(completion)].tolist())
                row += 1
