"""PPO with a learned critic: the advantages stage that adds values and GAE advantages to
each collection, and the trainer that updates the policy and the critic, each with its own
optimizer, schedule and checkpoint.

:class:`GAEAdvantages` is the advantages stage PPO passes to a
:class:`~tunesmith.rl.source.RolloutSource` (which samples, scores and computes the trainer's
and the reference's log-probs before it); per collection it adds ``[b, L]`` tensors aligned
with the labels:

* ``old_values``: the critic's values of the completion positions (no gradient);
* the token-level rewards (:func:`token_rewards`): ``-kl_coef · (old_logprobs - ref_logprobs)``
  on every completion token (the k1 KL to the reference folded into the reward) plus the
  sequence's reward on its last completion token;
* ``advantages`` and ``returns`` = :func:`~tunesmith.rl.advantages.gae` of those rewards and
  values (``gamma``, ``lam``); the advantages whitened over all the completion tokens of the
  batch, every data-parallel rank's (``whiten_advantages``); the returns are not.

:class:`PPOTrainer` is the policy's :class:`~tunesmith.training.trainer.Trainer` driving a
second one for the critic (:class:`~tunesmith.rl.ppo.critic.ValueObjective`): every step updates
both on the same micro-batches, except the first ``warmup_steps``, which update only the
critic; :meth:`~PPOTrainer.save` writes the critic's checkpoint, then the policy's, at the
same step, and resuming loads both (refused when the two disagree on the step).

Example::

    advantages = GAEAdvantages(critic, ctx, settings, gamma=1.0, lam=0.95, kl_coef=0.05)
    source = RolloutSource(model=policy, tokenizer=tok, prompts=stream, rewards=rewards,
                           ctx=ctx, settings=settings, advantages=advantages, reference=ref)
    critic_trainer = Trainer(critic_config(cfg), ctx, model=critic,
                             objective=ValueObjective(ValueLoss(clip=0.2)))
    fit(cfg, ctx, model=policy, objective=PolicyGradient(loss), source=source,
        make_trainer=partial(PPOTrainer, critic=critic_trainer, warmup_steps=4))
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tunesmith.models.safetensors_io import CheckpointError
from tunesmith.rl.advantages import gae, whiten
from tunesmith.rl.ppo.critic import critic_checkpoint, critic_values
from tunesmith.rl.rewards import RewardSet
from tunesmith.rl.rollout import completion_mask, per_micro_batch
from tunesmith.rl.source import RolloutSettings
from tunesmith.training.parallel.distributed import DistributedContext, all_reduce_sum
from tunesmith.training.settings import LoopSettings
from tunesmith.training.trainer import Objective, Trainer

__all__ = [
    "GAEAdvantages",
    "PPOTrainer",
    "offload_reward_models",
    "token_rewards",
    "whiten_across_ranks",
]

Batch = dict[str, torch.Tensor]


def token_rewards(
    rewards: torch.Tensor,
    mask: torch.Tensor,
    kl: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> torch.Tensor:
    """``[b, L]`` float32 per-token rewards: ``-kl_coef · kl`` on the positions of ``mask``
    (``kl``, ``[b, L]``, e.g. ``old_logprobs - ref_logprobs``), plus each row's sequence
    reward ``rewards[i]`` on its last masked position; 0 elsewhere and on rows without one.

    Example::

        >>> mask = torch.tensor([[False, True, True, False]])
        >>> kl = torch.tensor([[9.0, 0.5, -1.0, 9.0]])
        >>> token_rewards(torch.tensor([2.0]), mask, kl, kl_coef=0.1)
        tensor([[ 0.0000, -0.0500,  2.1000,  0.0000]])
    """
    if mask.dim() != 2 or rewards.shape != mask.shape[:1]:
        raise ValueError(
            f"rewards must be [b] and mask [b, L], got {list(rewards.shape)} and {list(mask.shape)}"
        )
    mask = mask.bool()
    out = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    if kl is not None and kl_coef:
        out = torch.where(mask, -float(kl_coef) * kl.float(), out)
    positions = torch.arange(mask.shape[1], device=mask.device)
    last = torch.where(mask, positions, -1).amax(dim=1)
    rows = (last >= 0).nonzero().flatten()
    out[rows, last[rows]] += rewards[rows].float()
    return out


def whiten_across_ranks(
    x: torch.Tensor, mask: torch.Tensor, ctx: DistributedContext, eps: float = 1e-8
) -> torch.Tensor:
    """:func:`~tunesmith.rl.advantages.whiten` with the mean and the (unbiased) variance of the
    masked values of every data-parallel rank (two all-reduces), so the result equals one
    process whitening the whole batch; ``x`` unchanged with fewer than 2 masked values in all.

    Example::

        >>> from tunesmith.rl.asynchronous.workers import local_context
        >>> ctx = local_context()  # one process: as whiten() on the batch
        >>> whiten_across_ranks(torch.tensor([[1.0, 3.0]]), torch.ones(1, 2), ctx)
        tensor([[-0.7071,  0.7071]])
    """
    mask = mask.bool()
    group = ctx.dp_group
    if ctx.dp_size == 1:
        return whiten(x, mask, eps=eps) if int(mask.sum()) >= 2 else x
    x = x.to(torch.promote_types(x.dtype, torch.float32))
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    stats = torch.stack([torch.where(mask, x, zero).sum().double(), mask.sum().double()])
    total, count = all_reduce_sum(stats, ctx.device, group).tolist()
    if count < 2:
        return x
    mean = total / count
    squares = torch.where(mask, x - mean, zero).double().square().sum()
    variance = float(all_reduce_sum(squares, ctx.device, group)) / (count - 1)
    return torch.where(mask, (x - mean) / math.sqrt(variance + eps), zero)


class GAEAdvantages:
    """PPO's advantages stage of a :class:`~tunesmith.rl.source.RolloutSource` (see the module
    docs): the ``critic``'s values (sharded like the policy, forwards in micro-batches of
    ``settings.micro_batch_size``), ``gamma`` and ``lam`` (GAE), ``kl_coef`` (the k1 KL to the
    reference in the reward: the source needs a ``reference`` when it is > 0) and
    ``whiten_advantages``.

    Logged per collection (over all ranks, per completion token): ``values``, ``returns``,
    ``advantage_mean`` / ``advantage_std`` (before whitening), ``explained_variance``
    (``1 - Var(returns - values) / Var(returns)``), ``kl`` (k1, to the reference) and
    ``values_s`` (the critic's forwards).

    Example::

        advantages = GAEAdvantages(critic, ctx, settings, gamma=1.0, lam=0.95)
        source = RolloutSource(..., settings=settings, advantages=advantages)
    """

    def __init__(
        self,
        critic: nn.Module,
        ctx: DistributedContext,
        settings: RolloutSettings,
        *,
        gamma: float = 1.0,
        lam: float = 0.95,
        kl_coef: float = 0.0,
        whiten_advantages: bool = True,
    ) -> None:
        for name, value in (("gamma", gamma), ("lam", lam)):
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {value!r}")
        if not kl_coef >= 0:
            raise ValueError(f"kl_coef must be >= 0, got {kl_coef!r}")
        self.critic, self.ctx, self.settings = critic, ctx, settings
        self.gamma, self.lam = float(gamma), float(lam)
        self.kl_coef, self.whiten_advantages = float(kl_coef), bool(whiten_advantages)

    def __call__(self, batch: Batch) -> dict[str, float]:
        if self.kl_coef > 0 and "ref_logprobs" not in batch:
            raise ValueError(f"kl_coef={self.kl_coef} needs a reference policy (reference=...)")
        start = time.perf_counter()
        values = batch["old_values"] = self._values(batch)
        values_s = time.perf_counter() - start
        mask = completion_mask(batch)
        kl = batch["old_logprobs"] - batch["ref_logprobs"] if "ref_logprobs" in batch else None
        rewards = token_rewards(batch["rewards"], mask, kl, self.kl_coef)
        advantages, returns = gae(rewards, values, mask, self.gamma, self.lam)
        batch["returns"] = returns
        batch["advantages"] = (
            whiten_across_ranks(advantages, mask, self.ctx)
            if self.whiten_advantages
            else advantages
        )
        return self._metrics(mask, values, returns, advantages, kl, values_s)

    @torch.no_grad()
    def _values(self, batch: Batch) -> torch.Tensor:
        """The critic's values of every position, micro-batch by micro-batch (the same number
        of forwards on every rank), in the mode the update sees."""

        def values(part: Batch) -> torch.Tensor:
            return critic_values(self.critic, part)[0].float()

        s = self.settings
        every = per_micro_batch(values, batch, s.micro_batch_size, self.ctx, s.autocast_dtype)
        return torch.where(completion_mask(batch), every, 0.0)

    def _metrics(
        self,
        mask: torch.Tensor,
        values: torch.Tensor,
        returns: torch.Tensor,
        advantages: torch.Tensor,
        kl: torch.Tensor | None,
        values_s: float,
    ) -> dict[str, float]:
        def masked(x: torch.Tensor) -> torch.Tensor:
            return torch.where(mask, x.double(), 0.0)

        error = masked(returns - values)
        sums = torch.stack(
            [
                mask.sum().double(),
                masked(values).sum(),
                masked(returns).sum(),
                masked(returns).square().sum(),
                error.sum(),
                error.square().sum(),
                masked(advantages).sum(),
                masked(advantages).square().sum(),
                masked(kl).sum() if kl is not None else torch.zeros((), dtype=torch.float64),
                torch.tensor(values_s, dtype=torch.float64),
            ]
        )
        (n, v, r, r2, e, e2, a, a2, k, t) = all_reduce_sum(
            sums, self.ctx.device, self.ctx.dp_group
        ).tolist()
        n = max(n, 1.0)
        var_returns = r2 / n - (r / n) ** 2
        metrics = {
            "values": v / n, "returns": r / n, "advantage_mean": a / n,
            "advantage_std": math.sqrt(max(a2 / n - (a / n) ** 2, 0.0)),
            "explained_variance": (1.0 - (e2 / n - (e / n) ** 2) / var_returns
                                   if var_returns > 1e-12 else 0.0),
            "values_s": t / self.ctx.dp_size,
        }  # fmt: skip
        if kl is not None:
            metrics["kl"] = k / n
        return metrics


class PPOTrainer(Trainer):
    """The policy's :class:`~tunesmith.training.trainer.Trainer` that also trains ``critic``
    (a Trainer of the critic on :class:`~tunesmith.rl.ppo.critic.ValueObjective`, with its own
    optimizer, schedule and ``output_dir``; see :func:`~tunesmith.rl.ppo.critic.critic_config`).

    * :meth:`step`: the critic's step, then the policy's, on the same micro-batches; the critic's
      metrics join the policy's as ``critic/<name>``. The first ``warmup_steps`` steps update
      only the critic (``critic_warmup`` is logged as 1): the policy's optimizer and LR
      schedule stay, and its schedule spans the ``max_steps - warmup_steps`` steps that update
      it. Warm-up steps are steps of the run: they count against ``max_steps``, and a run
      resumed in the warm-up finishes it.
    * :meth:`save`: the critic's checkpoint, then the policy's, both at the step (so every
      policy checkpoint has its critic: ``<output_dir>/critic/checkpoints/step_N``).
    * :meth:`start` / :meth:`load`: the policy's checkpoint as the base class picks it, then
      the critic's of the same step (a missing one, or one at another step, is refused). A
      run that starts from step 0 starts the critic from step 0 too (with ``overwrite``, or a
      ``resume: true`` that found no policy checkpoint, the critic's leftovers are moved aside).

    Example::

        trainer = PPOTrainer.from_config(cfg, ctx, model=policy, objective=objective,
                                         source=source, critic=critic_trainer, warmup_steps=2)
        trainer.start(); trainer.step(source.next_step())["critic/loss"]
        # -> 0.41
    """

    def __init__(
        self,
        settings: LoopSettings,
        ctx: DistributedContext,
        *,
        model: nn.Module,
        objective: Objective,
        source: Any = None,
        critic: Trainer,
        warmup_steps: int = 0,
        **trainer_kwargs: Any,
    ) -> None:
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ValueError(f"warmup_steps must be an int >= 0, got {warmup_steps!r}")
        total = settings.max_steps or 0
        if warmup_steps and total and warmup_steps >= total:
            raise ValueError(
                f"the critic warm-up takes {warmup_steps} steps (critic_warmup_steps x "
                f"updates_per_batch) but the run has max_steps={total}: no step would update "
                "the policy"
            )
        super().__init__(
            settings,
            ctx,
            model=model,
            objective=objective,
            source=source,
            schedule_steps=total - warmup_steps if warmup_steps else None,
            **trainer_kwargs,
        )
        self.critic, self.warmup_steps = critic, warmup_steps

    def step(self, micro_batches: Sequence[Batch]) -> dict[str, float]:
        seen = self.critic.progress["tokens_seen"]
        critic = self.critic.step(micro_batches)
        if self.progress["step"] >= self.warmup_steps:
            metrics = super().step(micro_batches)
        else:
            metrics = self._critic_only(micro_batches, self.critic.progress["tokens_seen"] - seen)
        skip = ("tokens_seen", self.critic.objective.unit)
        return metrics | {f"critic/{k}": v for k, v in critic.items() if k not in skip}

    def _critic_only(self, micro_batches: Sequence[Batch], seen: int) -> dict[str, float]:
        """A warm-up step's bookkeeping for the policy (no forward, no update)."""
        ctx, step = self.ctx, self.progress["step"] + 1
        units = all_reduce_sum(
            sum(self.objective.units(mb) for mb in micro_batches), ctx.device, ctx.dp_cp_group
        )
        self.progress["step"] = step
        self.progress["tokens_seen"] += seen
        self.rank_tokens = self.critic.rank_tokens
        metrics = {"lr": self.scheduler.get_last_lr()[0],
                   "tokens_seen": self.progress["tokens_seen"],
                   self.objective.unit: int(units.item()), "critic_warmup": 1.0}  # fmt: skip
        for hook in self.on_step_end:
            hook(self, step, metrics)
        return metrics

    def save(self) -> Path:
        self.critic.save()  # first: a policy checkpoint never lacks its critic's
        return super().save()

    def start(self) -> Path | None:
        path = super().start()
        critic = self.critic.settings
        if path is None:  # a resume that found nothing: leftovers of a save that never completed
            overwrite = critic.overwrite or bool(self.settings.resume)
            self.critic.settings = replace(critic, resume=False, overwrite=overwrite)
        else:
            self.critic.settings = replace(critic, resume=str(self._critic_path(path)))
        self.critic.start()
        self._check_same_step(path)
        return path

    def load(self, path: str | Path) -> None:
        super().load(path)
        self.critic.load(self._critic_path(Path(path)))
        self._check_same_step(Path(path))

    def _critic_path(self, path: Path) -> Path:
        critic = critic_checkpoint(path)
        if not critic.is_dir():
            raise FileNotFoundError(
                f"{critic} is missing: PPO resumes the policy and the critic from the same step, "
                f"and the policy checkpoint {path} has no critic checkpoint (resume from an "
                "earlier step that has both)"
            )
        return critic

    def _check_same_step(self, path: Path | None) -> None:
        policy, critic = self.progress["step"], self.critic.progress["step"]
        if policy != critic:
            raise CheckpointError(
                f"the policy resumed at step {policy} ({path}) but the critic at step {critic} "
                f"({self.critic.last_checkpoint}): PPO resumes both from the same step"
            )


class _OffloadedReward:
    """A reward model reward whose weights wait in CPU memory and move onto its device only
    while it scores (whole, not layer by layer: each rank scores its own samples)."""

    def __init__(self, reward: Any) -> None:
        self.reward, self.name = reward, reward.name
        reward.model.to("cpu")

    def __call__(self, samples: Any) -> list[float]:
        self.reward.model.to(self.reward.device)
        try:
            return self.reward(samples)
        finally:
            self.reward.model.to("cpu")
            torch.cuda.empty_cache()


def offload_reward_models(rewards: RewardSet) -> list[str]:
    """Wrap each reward of ``rewards`` that runs a model on a GPU (``model`` and ``device``
    attributes, e.g. :class:`~tunesmith.rl.rewards.RewardModelScore`) so its weights stay in
    CPU memory between scorings (moved onto the GPU whole for each batch of samples); returns
    the names wrapped. Rewards on the CPU are left as they are.

    Example::

        rewards = RewardSet({"rm": RewardModelScore("out/rm", device="cuda")})
        offload_reward_models(rewards)
        # -> ['rm']
    """
    wrapped = []
    for name, reward in rewards.rewards.items():
        device = getattr(reward, "device", None)
        if isinstance(getattr(reward, "model", None), torch.nn.Module) and (
            device is not None and torch.device(device).type == "cuda"
        ):
            rewards.rewards[name] = _OffloadedReward(reward)
            wrapped.append(name)
    return wrapped
