"""Advantages from rewards: group baselines (GRPO, Dr. GRPO, RLOO, REINFORCE++-baseline) and
GAE for PPO.

The group estimators are small callables a config names by ``_component_``
(``tunesmith.rl.advantages.GroupNormalized``, ...): ``estimator(rewards, group_size)`` takes
one reward per completion ``[n]``, laid out as ``n / group_size`` consecutive groups of
``group_size`` completions of the same prompt, and returns one advantage per completion
``[n]`` (float32 at least), which the policy loss broadcasts over the completion's tokens.
Every estimator gives a group whose rewards are all equal exactly zero advantage (no NaN).

:func:`gae` and :func:`whiten` work on per-token ``[b, T]`` tensors for PPO's critic.

Example::

    >>> rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0])  # 2 prompts x 3 samples
    >>> GroupNormalized(std_normalize=False)(rewards, group_size=3)
    tensor([ 0.6667, -0.3333, -0.3333,  0.0000,  0.0000,  0.0000])
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from tunesmith.config.registry import component

__all__ = [
    "BatchNormalized", "GroupNormalized", "LeaveOneOut", "TeacherReverseKL", "gae", "whiten",
]  # fmt: skip


def _groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """``rewards`` ``[n]`` as ``[n / group_size, group_size]`` in float32 at least."""
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be an int >= 1, got {group_size!r}")
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be [n] (one per completion), got {list(rewards.shape)}")
    if rewards.numel() % group_size:
        raise ValueError(
            f"{rewards.numel()} rewards do not split into groups of group_size={group_size} "
            "(every prompt needs group_size completions)"
        )
    dtype = torch.float32
    if rewards.is_floating_point():
        dtype = torch.promote_types(rewards.dtype, dtype)
    return rewards.detach().to(dtype).reshape(-1, group_size)


def _centered(groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(r - group mean, tied)``: the centred rewards, exactly 0 in a group whose rewards are
    all equal (``tied``, ``[groups, 1]``), where the mean's rounding would leave crumbs."""
    tied = (groups == groups[:, :1]).all(dim=1, keepdim=True)
    centered = groups - groups.mean(dim=1, keepdim=True)
    return centered.masked_fill(tied, 0.0), tied


@component
@dataclass(frozen=True)
class GroupNormalized:
    """GRPO's advantage (Shao et al. 2024): ``(r - mean_g) / (std_g + eps)`` over each
    prompt's group; with ``std_normalize=False`` it is Dr. GRPO's ``r - mean_g`` (Liu et al.
    2025, which drops the std as a difficulty bias).

    ``std_g`` is the *unbiased* standard deviation (``torch.std``'s default, Bessel's
    correction ``1/(G-1)``), as TRL's GRPO computes it. A group with all-equal rewards gets
    zeros (it teaches nothing), and so does a group of one completion (``group_size=1``: its
    own reward is its mean).

    Example::

        >>> GroupNormalized()(torch.tensor([1.0, 0.0, 2.0, 2.0]), group_size=2)  # std 0.7071
        tensor([ 0.7070, -0.7070,  0.0000,  0.0000])
    """

    std_normalize: bool = True
    eps: float = 1e-4

    def __post_init__(self) -> None:
        if not self.eps >= 0:
            raise ValueError(f"eps must be >= 0, got {self.eps!r}")

    def __call__(self, rewards: torch.Tensor, group_size: int) -> torch.Tensor:
        groups = _groups(rewards, group_size)
        centered, tied = _centered(groups)
        if self.std_normalize and group_size > 1:
            std = groups.std(dim=1, keepdim=True).masked_fill(tied, 1.0)
            centered = centered / (std + self.eps)
        return centered.reshape(-1)


@component
@dataclass(frozen=True)
class LeaveOneOut:
    """RLOO's advantage (Ahmadian et al. 2024): each completion's reward minus the mean of the
    *other* completions of its group, ``r_i - (sum_g - r_i) / (G - 1)``
    (``= G / (G - 1) · (r_i - mean_g)``). Needs ``group_size >= 2``.

    Example::

        >>> LeaveOneOut()(torch.tensor([1.0, 0.0, 0.0]), group_size=3)  # 1 - 0, 0 - 1/2
        tensor([ 1.0000, -0.5000, -0.5000])
    """

    def __call__(self, rewards: torch.Tensor, group_size: int) -> torch.Tensor:
        if group_size == 1:
            raise ValueError(
                "LeaveOneOut (RLOO) needs group_size >= 2: with one completion per prompt "
                "there are no other samples to form its baseline"
            )
        groups = _groups(rewards, group_size)
        others = (groups.sum(dim=1, keepdim=True) - groups) / (group_size - 1)
        tied = (groups == groups[:, :1]).all(dim=1, keepdim=True)
        return (groups - others).masked_fill(tied, 0.0).reshape(-1)


@component
@dataclass(frozen=True)
class BatchNormalized:
    """REINFORCE++ with a group baseline (Hu et al. 2025): subtract each group's mean, then
    divide by the std of those centred values over the whole batch, all groups together:
    ``(r - mean_g) / (std_batch + eps)``.

    ``std_batch`` is the unbiased std (``1/(N-1)``) of the centred values around their batch
    mean (0 up to rounding). With a ``process_group`` of more than one rank the batch is every
    rank's completions: the sum, sum of squares and count are all-reduced over the group
    (each rank holds whole groups), so every rank divides by the same std and the result
    equals one process on the concatenated batch. A batch with a single completion, or whose
    groups are all tied, gets zeros.

    Example::

        >>> BatchNormalized()(torch.tensor([1.0, 0.0, 3.0, 3.0]), group_size=2)  # 0.5/sqrt(0.5/3)
        tensor([ 1.2244, -1.2244,  0.0000,  0.0000])
    """

    eps: float = 1e-4
    process_group: Any = None

    def __post_init__(self) -> None:
        if not self.eps >= 0:
            raise ValueError(f"eps must be >= 0, got {self.eps!r}")

    def __call__(self, rewards: torch.Tensor, group_size: int) -> torch.Tensor:
        centered, _ = _centered(_groups(rewards, group_size))
        flat = centered.reshape(-1)
        stats = torch.stack(
            [flat.double().sum(), flat.double().square().sum(), flat.new_tensor(flat.numel())]
        ).double()
        group = self.process_group
        if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(stats, op=dist.ReduceOp.SUM, group=group)
        total, total_sq, count = stats.tolist()
        if count < 2:
            return torch.zeros_like(flat)
        variance = max(total_sq - total * total / count, 0.0) / (count - 1)
        return flat / (variance**0.5 + self.eps)


# -- per token: a teacher's log-probs ------------------------------------------------------------


@component
@dataclass(frozen=True)
class TeacherReverseKL:
    """On-policy distillation as RL: the negative reverse KL to a teacher, token by token, as
    the advantage. Each completion token ``y_t`` sampled by the policy gets
    ``coef · (log p_teacher(y_t | y_<t) - log π_old(y_t | y_<t))`` (no discount, no baseline:
    the per-token reward of "on-policy distillation"; Agarwal et al. 2024, Lu et al. 2025),
    which the policy loss (PPO-clip, token mean) turns into the reverse KL's gradient.

    The teacher is the run's reference policy: ``reference_model`` (a teacher folder, same
    tokenizer), computed by the trainer in ``grpo`` and by the reward workers in
    ``grpo_async`` (teacher scoring as the reward worker's job), at the sampling temperature.
    The ``rewards`` are scored and logged but do not enter the update. Unlike the group
    estimators it is a stage of the rollout source: it reads the batch's ``old_logprobs`` and
    ``ref_logprobs`` and writes per-token ``advantages`` ``[b, L]``. Logged:
    ``teacher_reverse_kl``, the mean of ``log π_old - log p_teacher`` over the completion
    tokens of every rank (``process_group``).

    Example::

        >>> batch = {"labels": torch.tensor([[-100, 5, 6]]),
        ...          "old_logprobs": torch.tensor([[0.0, -1.0, -2.0]]),
        ...          "ref_logprobs": torch.tensor([[0.0, -1.5, -1.0]])}
        >>> TeacherReverseKL()(batch), batch["advantages"]
        ({'teacher_reverse_kl': -0.25}, tensor([[ 0.0000, -0.5000,  1.0000]]))
    """

    coef: float = 1.0
    process_group: Any = None
    needs_reference: ClassVar[bool] = True  # the source computes ``ref_logprobs``: the teacher's
    per_token: ClassVar[bool] = True  # a stage of the source, not ``estimator(rewards, n)``

    def __post_init__(self) -> None:
        if not self.coef > 0:
            raise ValueError(f"coef must be > 0, got {self.coef!r}")

    def __call__(self, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        if "ref_logprobs" not in batch:
            raise ValueError(
                "TeacherReverseKL needs the teacher's log-probs: set reference_model to the "
                "teacher's folder"
            )
        mask = (batch["labels"] != -100).float()
        toward = (batch["ref_logprobs"].float() - batch["old_logprobs"].float()) * mask
        batch["advantages"] = self.coef * toward
        sums = torch.stack([-toward.double().sum(), mask.double().sum()])
        group = self.process_group
        if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
        total, tokens = sums.tolist()
        return {"teacher_reverse_kl": total / max(tokens, 1.0)}


def needs_reference(advantage: Any) -> bool:
    """Whether an ``advantage`` component (an instance, or its class) reads the reference's
    log-probs (:class:`TeacherReverseKL`).

    >>> needs_reference(TeacherReverseKL), needs_reference(GroupNormalized())
    (True, False)
    """
    return bool(getattr(advantage, "needs_reference", False))


def is_stage(advantage: Any) -> bool:
    """Whether ``advantage`` is a stage of the rollout source (``advantage(batch)``) rather
    than a group estimator (``estimator(rewards, group_size)``)."""
    return bool(getattr(advantage, "per_token", False))


# -- GAE ---------------------------------------------------------------------------------------


def _check_contiguous(mask: torch.Tensor) -> None:
    """Each row's trained positions form one run (padding before and after, no holes)."""
    m = mask.int()
    starts = (m[:, 1:] - m[:, :-1] == 1).sum(dim=1) + m[:, 0]
    if (starts > 1).any():
        row = int((starts > 1).nonzero()[0])
        raise ValueError(
            f"mask row {row} has holes ({int(starts[row])} separate runs of trained tokens); "
            "gae needs one contiguous run per row"
        )


@torch.no_grad()
def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 0.95,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016) per token:
    ``δ_t = r_t + γ·V_{t+1} - V_t`` and ``A_t = δ_t + γλ·A_{t+1}``, backwards over each row;
    returns ``(advantages, returns = advantages + values)``, both ``[b, T]``, float32 at least,
    0 where ``mask`` is false, no gradient.

    ``rewards`` ``[b, T]`` are token-level (typically the sequence's reward on its last
    completion token, minus a per-token KL penalty), ``values`` ``[b, T]`` the critic's values
    at rollout time. ``mask`` ``[b, T]`` marks each row's completion tokens as one contiguous
    run (padding may come before and after; a row with holes is refused): past a row's last
    trained token the value bootstraps to 0 (the episode ended), and untrained positions are
    ignored.

    Example::

        >>> rewards = torch.tensor([[0.0, 1.0, 0.0]])
        >>> values = torch.tensor([[0.5, 0.5, 9.0]])
        >>> mask = torch.tensor([[True, True, False]])
        >>> adv, ret = gae(rewards, values, mask, gamma=1.0, lam=1.0)  # A_t = 1 - V_t
        >>> adv, ret
        (tensor([[0.5000, 0.5000, 0.0000]]), tensor([[1., 1., 0.]]))
    """
    if rewards.dim() != 2 or values.shape != rewards.shape or mask.shape != rewards.shape:
        raise ValueError(
            f"rewards {list(rewards.shape)}, values {list(values.shape)} and mask "
            f"{list(mask.shape)} must all be [b, T]"
        )
    for name, value in (("gamma", gamma), ("lam", lam)):
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"{name} must be in [0, 1], got {value!r}")
    mask = mask.bool()
    _check_contiguous(mask)
    dtype = torch.promote_types(torch.promote_types(rewards.dtype, values.dtype), torch.float32)
    rewards, values = rewards.to(dtype), values.to(dtype)
    zero = torch.zeros((), dtype=dtype, device=rewards.device)
    advantages = torch.zeros_like(rewards)
    next_value = torch.zeros_like(rewards[:, 0])
    next_advantage = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        live = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        advantage = torch.where(live, delta + gamma * lam * next_advantage, zero)
        advantages[:, t] = advantage
        next_value = torch.where(live, values[:, t], zero)
        next_advantage = advantage
    returns = torch.where(mask, advantages + values, zero)
    return advantages, returns


@torch.no_grad()
def whiten(
    x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8
) -> torch.Tensor:
    """``(x - mean) / sqrt(var + eps)`` over the positions where ``mask`` is true (the
    unbiased variance, ``1/(N-1)``); with ``shift_mean=False`` the mean is added back, so
    only the scale changes (e.g. for rewards). Float32 at least, 0 where ``mask`` is false, no gradient. Statistics are this
    process's only. Needs at least 2 masked positions.

    Example::

        >>> x = torch.tensor([[1.0, 3.0, 100.0]])
        >>> whiten(x, torch.tensor([[True, True, False]]))  # mean 2, unbiased var 2
        tensor([[-0.7071,  0.7071,  0.0000]])
    """
    if mask.shape != x.shape:
        raise ValueError(f"x {list(x.shape)} and mask {list(mask.shape)} must have the same shape")
    mask = mask.bool()
    count = int(mask.sum())
    if count < 2:
        raise ValueError(f"whiten needs at least 2 masked positions, got {count}")
    x = x.to(torch.promote_types(x.dtype, torch.float32))
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    kept = torch.where(mask, x, zero)
    mean = kept.sum() / count
    variance = torch.where(mask, x - mean, zero).square().sum() / (count - 1)
    out = (x - mean) * torch.rsqrt(variance + eps)
    if not shift_mean:
        out = out + mean
    return torch.where(mask, out, zero)
