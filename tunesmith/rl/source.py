"""The rollout source: a :class:`~tunesmith.training.sources.BatchSource` whose batches the
policy generates. One collection, on every data-parallel rank at once:

1. this rank's prompts of the step (:class:`~tunesmith.rl.prompts.PromptStream`), each
   chat-templated and repeated ``group_size`` times;
2. completions sampled by the policy in eval mode (keyed sampling: a completion depends only on
   ``seed``, the collection round, the prompt and its sample number, so rollouts are the same
   on any number of ranks and after a resume); all ranks decode the same number of steps;
3. rewards (:class:`~tunesmith.rl.rewards.RewardSet`) and advantages (per group);
   with ``dynamic_sampling`` groups whose rewards are all equal are dropped and more prompts
   drawn (up to ``max_refills`` rounds, then the zero-advantage groups fill the gap);
4. the trainer's own log-probs of the sampled tokens (no gradient: the PPO ratio's "old"
   policy) compared with the sampler's, the **log-prob parity check** (mean/max ``|delta|``, and
   the run stops above ``max_logprob_mismatch``), and the reference's log-probs for the KL;
5. ``updates_per_batch`` optimizer steps on the batch, each over all its rows in
   micro-batches of ``micro_batch_size``.

Its state (prompt position, collection round, the current batch while it is being trained
on) is saved with every checkpoint, so a resumed run continues exactly.

Example::

    source = RolloutSource(model=model, tokenizer=tok, prompts=stream, rewards=rewards,
                           advantage=GroupNormalized(), group_size=8, ctx=ctx,
                           generation=GenerationConfig(max_new_tokens=64))
    micro_batches = source.next_step()
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tunesmith.generation import generate
from tunesmith.generation.generate import GenerationOutput
from tunesmith.models.atomic import open_no_follow
from tunesmith.modules.dtypes import AUTOCAST
from tunesmith.rl.groups import Group, sample_groups, score_groups
from tunesmith.rl.prompts import Prompt, PromptStream
from tunesmith.rl.rewards import RewardSet
from tunesmith.rl.rollout import completion_logprobs, micro_batches, rollout_batch
from tunesmith.training.distributed import DistributedContext
from tunesmith.training.setup import FrozenPolicy

__all__ = ["GenerationConfig", "LogprobMismatchError", "RolloutSource", "stop_token_ids"]

Batch = dict[str, torch.Tensor]


@dataclass
class GenerationConfig:
    """How completions are sampled (the ``generation:`` section of an RL config).

    ``stop_strings`` end a completion after the token that completes one; ``stop_tokens``
    (token strings such as ``"<|im_end|>"``) and the tokenizer's end-of-sequence token end
    it at that token.
    """

    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    stop_strings: Sequence[str] = ()
    stop_tokens: Sequence[str] = ()

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError(
                f"generation.temperature must be > 0 for RL sampling, got {self.temperature}"
            )


class LogprobMismatchError(RuntimeError):
    """The trainer's log-probs of the sampled tokens differ from the sampler's too much."""


@dataclass
class _Collected:
    """One collection's rows on this rank."""

    prompts: list[Prompt] = field(default_factory=list)
    prompt_ids: list[list[int]] = field(default_factory=list)
    prompt_texts: list[str] = field(default_factory=list)
    completions: list[list[int]] = field(default_factory=list)
    logprobs: list[list[float]] = field(default_factory=list)
    finish: list[str] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    rewards: list[torch.Tensor] = field(default_factory=list)
    per_reward: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    failures: dict[str, int] = field(default_factory=dict)

    @classmethod
    def of(cls, groups: Sequence[Group], failures: dict[str, int] | None = None) -> _Collected:
        """The rows of ``groups``, in order."""
        out = cls(failures=dict(failures or {}))
        for g in groups:
            out.prompts.append(g.prompt)
            out.prompt_ids.extend([g.prompt_ids] * g.size)
            out.prompt_texts.extend([g.prompt_text] * g.size)
            out.completions.extend(g.completions)
            out.logprobs.extend(g.logprobs)
            out.finish.extend(g.finish)
            out.texts.extend(g.texts)
            out.rewards.append(g.rewards)
            for key, values in g.per_reward.items():
                out.per_reward.setdefault(key, []).append(values)
        return out


class RolloutSource:
    """Batches generated by ``model`` from ``prompts``, scored by ``rewards`` (see the module
    docs). ``reference`` (a :class:`~tunesmith.training.setup.FrozenPolicy`) adds
    ``ref_logprobs`` to the batch; ``importance_cap`` adds the truncated importance weights'
    inputs (the sampler's log-probs are always in the batch as ``sampling_logprobs``)."""

    def __init__(
        self, *, model: nn.Module, tokenizer: Any, prompts: PromptStream, rewards: RewardSet,
        advantage: Callable[[torch.Tensor, int], torch.Tensor], group_size: int,
        ctx: DistributedContext, generation: GenerationConfig | None = None,
        micro_batch_size: int = 8, updates_per_batch: int = 1,
        reference: FrozenPolicy | None = None, dynamic_sampling: bool = False,
        max_refills: int = 4, overlong_filter: bool = False,
        max_logprob_mismatch: float | None = None, mixed_precision: str | None = None,
        chat_template: bool = True, seed: int = 0, chunk_size: int = 1024,
        samples_file: str | Path | None = None, log_samples_every: int = 0,
    ) -> None:  # fmt: skip
        if group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}")
        self.model, self.tokenizer, self.prompts, self.rewards = model, tokenizer, prompts, rewards
        self.advantage, self.group_size, self.ctx = advantage, int(group_size), ctx
        self.generation = generation or GenerationConfig()
        self.micro_batch_size, self.updates_per_batch = (
            int(micro_batch_size),
            int(updates_per_batch),
        )
        self.reference, self.dynamic_sampling = reference, bool(dynamic_sampling)
        self.max_refills, self.overlong_filter = int(max_refills), bool(overlong_filter)
        self.max_logprob_mismatch = max_logprob_mismatch
        self.autocast_dtype = AUTOCAST[mixed_precision]
        self.chat_template, self.seed, self.chunk_size = chat_template, int(seed), int(chunk_size)
        self.samples_file = Path(samples_file) if samples_file else None
        self.log_samples_every = int(log_samples_every)
        self.pad_id = tokenizer.pad_id if tokenizer.pad_id is not None else 0
        self.stop_token_ids = stop_token_ids(tokenizer, self.generation.stop_tokens)
        self.epoch = 0  # kept in step with the prompt stream
        self.round = 0  # collections so far (one or more per batch with dynamic sampling)
        self.batches = 0
        self._batch: Batch | None = None
        self._updates_left = 0
        self._metrics: dict[str, float] = {}

    # -- BatchSource

    def next_step(self) -> list[Batch]:
        """The micro-batches of the next optimizer step (collecting a new batch when the
        current one has had its ``updates_per_batch`` steps)."""
        self._metrics = {}
        if self._batch is None or self._updates_left == 0:
            self._batch = self._collect()
            self._updates_left = self.updates_per_batch
            self.batches += 1
        self._updates_left -= 1
        return micro_batches(self._batch, self.micro_batch_size)

    def step_metrics(self) -> dict[str, float]:
        """The metrics of the collection the last step made (empty when it made none)."""
        return dict(self._metrics)

    def state_dict(self) -> dict[str, Any]:
        return {
            "prompts": self.prompts.state_dict(), "round": self.round, "batches": self.batches,
            "updates_left": self._updates_left,
            "batch": None if self._batch is None else {k: v.cpu() for k, v in self._batch.items()},
        }  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.prompts.load_state_dict(state["prompts"])
        self.epoch = self.prompts.epoch
        self.round, self.batches = int(state["round"]), int(state["batches"])
        self._updates_left = int(state["updates_left"])
        self._batch = state["batch"]

    # -- one collection

    @torch.no_grad()
    def _collect(self) -> Batch:
        ctx, groups_wanted = self.ctx, None
        times = {"generate_s": 0.0, "reward_s": 0.0, "logprobs_s": 0.0}
        kept, spare = _Collected(), _Collected()
        zero_variance = drawn_groups = 0
        for _ in range(1 + (self.max_refills if self.dynamic_sampling else 0)):
            got = self._generate_and_score(times)
            groups_wanted = groups_wanted or len(got.prompts)
            drawn_groups += len(got.prompts)
            for key, count in got.failures.items():
                kept.failures[key] = kept.failures.get(key, 0) + count
            for g, rewards in enumerate(got.rewards):
                flat = bool((rewards == rewards[0]).all())
                zero_variance += int(flat)
                _append_group(spare if (self.dynamic_sampling and flat) else kept, got, g)
            short = groups_wanted - len(kept.prompts)
            if not self.dynamic_sampling or not _any_rank(short > 0, ctx):
                break
        for g in range(len(spare.prompts)):  # refills ran out: zero-advantage groups fill up
            if len(kept.prompts) >= groups_wanted:
                break
            _append_group(kept, spare, g)
        _truncate(kept, groups_wanted)  # a refill may bring more groups than needed
        batch = self._to_batch(kept)
        start = time.perf_counter()
        self._trainer_and_reference_logprobs(batch)
        times["logprobs_s"] = time.perf_counter() - start
        self._metrics = self._reduce_metrics(kept, batch, times, zero_variance, drawn_groups)
        self._metrics |= self._finish_batch(batch)
        self._maybe_log_samples(kept)
        return batch

    def _finish_batch(self, batch: Batch) -> dict[str, float]:
        """A subclass's last stage of a collection, after the log-probs (PPO: the critic's
        values and GAE, :mod:`tunesmith.rl.ppo`); returns its metrics, already reduced over the
        ranks (they replace the base's of the same name). Nothing here."""
        return {}

    def _generate_and_score(self, times: dict[str, float]) -> _Collected:
        prompts = self.prompts.next_prompts()
        self.epoch = self.prompts.epoch
        start = time.perf_counter()
        groups = sample_groups(
            self._generate, self.tokenizer, prompts, round=self.round,
            group_size=self.group_size, seed=self.seed, chat_template=self.chat_template,
        )  # fmt: skip
        self.round += 1
        times["generate_s"] += time.perf_counter() - start
        times["generated_tokens"] = times.get("generated_tokens", 0) + sum(
            len(c) for g in groups for c in g.completions
        )
        start = time.perf_counter()
        failures = score_groups(self.rewards, groups)
        times["reward_s"] += time.perf_counter() - start
        return _Collected.of(groups, failures)

    def _generate(self, rows: list[list[int]], keys: list[int]) -> GenerationOutput:
        """The policy's completions of ``rows`` (eval mode; every rank decodes the same number
        of steps)."""
        g = self.generation
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.autocast(self.ctx.device.type, self.autocast_dtype,
                                enabled=bool(self.autocast_dtype)):  # fmt: skip
                return generate(
                    self.model, rows, max_new_tokens=g.max_new_tokens, temperature=g.temperature,
                    top_k=g.top_k, top_p=g.top_p, min_p=g.min_p,
                    stop_token_ids=self.stop_token_ids, stop_strings=list(g.stop_strings),
                    decode=self.tokenizer.decode if g.stop_strings else None, pad_id=self.pad_id,
                    row_keys=torch.tensor(keys, dtype=torch.int64),
                    sync_ranks=self.ctx.world_size > 1,
                )  # fmt: skip
        finally:
            self.model.train(was_training)

    def _to_batch(self, got: _Collected) -> Batch:
        rewards = torch.cat(got.rewards).float()
        advantages = self.advantage(rewards, self.group_size).float()
        completions = got.completions
        if self.overlong_filter:  # truncated completions are not trained on
            completions = [c if f == "stop" else [] for c, f in zip(completions, got.finish)]
        logprobs = [lp if f == "stop" or not self.overlong_filter else []
                    for lp, f in zip(got.logprobs, got.finish)]  # fmt: skip
        return rollout_batch(
            got.prompt_ids, completions, self.pad_id,
            per_token={"sampling_logprobs": logprobs},
            per_row={"advantages": advantages, "rewards": rewards,
                     "stopped": torch.tensor([float(f == "stop") for f in got.finish])},
        )  # fmt: skip

    def _trainer_and_reference_logprobs(self, batch: Batch) -> None:
        """``old_logprobs`` (the policy now, in train mode as the update will see it) and,
        with a reference, ``ref_logprobs``; micro-batch by micro-batch (on every rank the same
        number of forwards: a sharded model needs each on all ranks)."""
        models: list[tuple[str, Callable[[], Any]]] = [("old_logprobs", _no_grad(self.model))]
        if self.reference is not None:
            models.append(("ref_logprobs", self.reference))
        temperature = self.generation.temperature
        for key, context in models:
            parts = []
            for start in range(0, batch["input_ids"].shape[0], self.micro_batch_size):
                part = {k: v[start : start + self.micro_batch_size].to(self.ctx.device)
                        for k, v in batch.items()}  # fmt: skip
                with (
                    context() as model,
                    torch.autocast(
                        self.ctx.device.type, self.autocast_dtype, enabled=bool(self.autocast_dtype)
                    ),
                ):
                    parts.append(completion_logprobs(model, part, temperature=temperature,
                                                     chunk_size=self.chunk_size).cpu())  # fmt: skip
            batch[key] = torch.cat(parts)

    # -- metrics and samples

    def _reduce_metrics(
        self, got: _Collected, batch: Batch, times: dict[str, float], zero_variance: int,
        drawn_groups: int,
    ) -> dict[str, float]:  # fmt: skip
        """This collection's metrics over all data-parallel ranks (one all-reduce of sums, one
        of maxima)."""
        mask = batch["labels"] != -100
        if "policy_lag" in batch:  # asynchronous: only what the current policy sampled compares
            mask = mask & (batch["policy_lag"] == 0)[:, None]
        delta = (batch["old_logprobs"] - batch["sampling_logprobs"]).abs() * mask
        rewards = batch["rewards"]
        lengths = torch.tensor([len(c) for c in got.completions], dtype=torch.float64)
        names = sorted(got.per_reward)
        sums = {
            "samples": float(len(rewards)), "reward_sum": float(rewards.sum()),
            "reward_sq": float((rewards.double() ** 2).sum()),
            "length_sum": float(lengths.sum()), "stopped": float(sum(f == "stop" for f in got.finish)),
            "tokens": float(mask.sum()), "delta_sum": float(delta.sum()),
            "kl_sum": float(((batch["sampling_logprobs"] - batch["old_logprobs"]) * mask).sum()),
            "zero_variance": float(zero_variance), "groups": float(drawn_groups),
            "adv_sum": float(batch["advantages"].sum()),
            "adv_sq": float((batch["advantages"].double() ** 2).sum()),
            "failures": float(sum(got.failures.values())),
            **{f"r/{k}": float(torch.cat(got.per_reward[k]).sum()) for k in names},
            **{f"t/{k}": v for k, v in times.items()},
        }  # fmt: skip
        maxima = {"delta_max": float(delta.max()) if mask.any() else 0.0,
                  "length_max": float(lengths.max()) if len(lengths) else 0.0}  # fmt: skip
        sums = _all_reduce(sums, self.ctx, dist.ReduceOp.SUM)
        maxima = _all_reduce(maxima, self.ctx, dist.ReduceOp.MAX)
        n, tokens = max(sums["samples"], 1.0), max(sums["tokens"], 1.0)
        mean = sums["reward_sum"] / n
        adv_mean = sums["adv_sum"] / n
        metrics = {
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
            "generate_s": sums["t/generate_s"] / self.ctx.dp_size,
            "reward_s": sums["t/reward_s"] / self.ctx.dp_size,
            "logprobs_s": sums["t/logprobs_s"] / self.ctx.dp_size,
            "generated_tokens_per_s": sums["t/generated_tokens"]
            / max(sums["t/generate_s"] / self.ctx.dp_size, 1e-9),
            "rollout_samples": sums["samples"],
        }  # fmt: skip
        limit = self.max_logprob_mismatch
        if limit is not None and maxima["delta_max"] > limit:
            raise LogprobMismatchError(
                f"the trainer's log-probs of the sampled tokens differ from the sampler's by up "
                f"to {maxima['delta_max']:.3g} (mean {metrics['logprob_mismatch_mean']:.3g}), "
                f"above max_logprob_mismatch={limit}: the generator does not run the policy "
                "being trained (different weights, dtype or sampling temperature?)"
            )
        return metrics

    def _maybe_log_samples(self, got: _Collected) -> None:
        if not (self.samples_file and self.log_samples_every and self.ctx.is_rank_zero):
            return
        if self.batches % self.log_samples_every:
            return
        n = self.group_size
        record = {
            "batch": self.batches + 1, "prompt": got.prompt_texts[0],
            "answer": _plain(got.prompts[0].answer),
            "completions": got.texts[:n], "rewards": got.rewards[0].tolist(),
        }  # fmt: skip
        self.samples_file.parent.mkdir(parents=True, exist_ok=True)
        with open_no_follow(self.samples_file, "a") as f:  # a planted link: refused
            f.write(json.dumps(record, ensure_ascii=False) + "\n")


# -- helpers


def stop_token_ids(tokenizer: Any, stop_tokens: Sequence[str]) -> list[int]:
    """The ids that end a completion: the tokenizer's end of sequence and ``stop_tokens``."""
    ids = [] if tokenizer.eos_id is None else [tokenizer.eos_id]
    for token in stop_tokens:
        token_id = tokenizer.token_to_id(token)
        if token_id is None:
            raise ValueError(f"generation.stop_tokens: {token!r} is not a token of the tokenizer")
        ids.append(token_id)
    return sorted(set(ids))


def _no_grad(model: nn.Module) -> Callable[[], Any]:
    return FrozenPolicy(model)


def _any_rank(flag: bool, ctx: DistributedContext) -> bool:
    if ctx.world_size == 1:
        return flag
    value = torch.tensor(float(flag), device=ctx.device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def _all_reduce(values: dict[str, float], ctx: DistributedContext, op: Any) -> dict[str, float]:
    if ctx.world_size == 1 or not values:
        return values
    keys = sorted(values)
    tensor = torch.tensor([values[k] for k in keys], dtype=torch.float64, device=ctx.device)
    dist.all_reduce(tensor, op=op, group=ctx.dp_group)
    return dict(zip(keys, tensor.tolist()))


def _append_group(target: _Collected, source: _Collected, g: int) -> None:
    n = len(source.prompt_ids) // len(source.prompts)
    rows = slice(g * n, (g + 1) * n)
    target.prompts.append(source.prompts[g])
    for name in ("prompt_ids", "prompt_texts", "completions", "logprobs", "finish", "texts"):
        getattr(target, name).extend(getattr(source, name)[rows])
    target.rewards.append(source.rewards[g])
    for key, groups in source.per_reward.items():
        target.per_reward.setdefault(key, []).append(groups[g])


def _truncate(got: _Collected, groups: int) -> None:
    n = len(got.prompt_ids) // len(got.prompts)
    got.prompts = got.prompts[:groups]
    for name in ("prompt_ids", "prompt_texts", "completions", "logprobs", "finish", "texts"):
        setattr(got, name, getattr(got, name)[: groups * n])
    got.rewards = got.rewards[:groups]
    got.per_reward = {k: v[:groups] for k, v in got.per_reward.items()}


def _plain(value: Any) -> Any:
    try:
        json.dumps(value)
        return value
    except TypeError:
        return str(value)
