"""Learning-rate schedules with linear warmup, as :class:`torch.optim.lr_scheduler.LambdaLR`.

Conventions (the same as Hugging Face ``transformers``' ``get_*_schedule_with_warmup``):

* The multiplier at step ``s`` during warmup is ``s / num_warmup_steps``, so **step 0 has
  learning rate 0** and the peak (the optimizer's configured ``lr``) is reached at step
  ``num_warmup_steps``. With ``num_warmup_steps=0`` step 0 already has the peak learning rate.
* After warmup, decay progress is ``(s - num_warmup_steps) / max(1, num_training_steps -
  num_warmup_steps)``. Unlike ``transformers``, progress is clamped to ``[0, 1]``: stepping past
  ``num_training_steps`` holds the final value instead of climbing back up the cosine.
* ``min_lr_ratio`` is the floor as a fraction of the peak: the decaying part is rescaled to
  ``min_lr_ratio + (1 - min_lr_ratio) * decay``.
* A warmup longer than the run (a smoke test's ``max_steps=1`` on a config with
  ``num_warmup_steps: 2``) is allowed, as in ``transformers``: the whole run is warmup and the
  learning rate never reaches its peak.

The multiplier is a small callable object rather than a lambda, so ``scheduler.state_dict()``
records its parameters and a scheduler rebuilt on resume and given ``load_state_dict`` continues
the exact same learning-rate sequence (with the saved parameters, which win over the rebuilt
ones). To resume with another schedule length instead, take :func:`schedule_params` of the
rebuilt scheduler before loading and give them back with :func:`set_schedule_params` after: the
run then follows the new length's schedule from the step it resumed at. Resume in this order: build the optimizer and the scheduler exactly as at the start,
then ``optimizer.load_state_dict(...)`` and ``scheduler.load_state_dict(...)`` (building the
scheduler after loading the optimizer would reset the groups' ``lr``). Everything in the state dict is a plain number, so it survives
``torch.load(..., weights_only=True)``.

Example::

    >>> model = torch.nn.Linear(4, 2)
    >>> opt = torch.optim.AdamW(model.parameters(), lr=2e-5)
    >>> sched = cosine_with_warmup(opt, num_warmup_steps=2, num_training_steps=10)
    >>> lrs = []
    >>> for step in range(4):
    ...     lrs.append(opt.param_groups[0]["lr"])
    ...     model(torch.randn(3, 4)).sum().backward(); opt.step(); opt.zero_grad(); sched.step()
    >>> lrs  # 0 at step 0, the peak at step num_warmup_steps, then the cosine
    [0.0, 1e-05, 2e-05, 1.92...e-05]
"""

from __future__ import annotations

import math
import types
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR, LRScheduler

from tunesmith.config.registry import component

__all__ = [
    "constant_with_warmup",
    "cosine_with_warmup",
    "linear_with_warmup",
    "schedule_params",
    "set_schedule_params",
]


def _check_args(
    num_warmup_steps: int, num_training_steps: int | None, min_lr_ratio: float = 0.0
) -> None:
    if isinstance(num_warmup_steps, bool) or not isinstance(num_warmup_steps, int):
        raise TypeError(f"num_warmup_steps must be an int, got {num_warmup_steps!r}")
    if num_warmup_steps < 0:
        raise ValueError(f"num_warmup_steps must be >= 0, got {num_warmup_steps}")
    if num_training_steps is not None:
        if isinstance(num_training_steps, bool) or not isinstance(num_training_steps, int):
            raise TypeError(f"num_training_steps must be an int, got {num_training_steps!r}")
        if num_training_steps < 1:
            raise ValueError(f"num_training_steps must be >= 1, got {num_training_steps}")
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(f"min_lr_ratio must be in [0, 1], got {min_lr_ratio}")


@dataclass
class _WarmupDecay:
    """The multiplier ``LambdaLR`` calls: linear warmup, then ``decay`` with a floor.

    A dataclass rather than a closure so ``LambdaLR.state_dict`` stores its fields.
    """

    decay: str  # "constant" | "linear" | "cosine"
    num_warmup_steps: int
    num_training_steps: int | None = None
    min_lr_ratio: float = 0.0
    num_cycles: float = 0.5

    def __call__(self, step: int) -> float:
        if step < self.num_warmup_steps:
            return step / self.num_warmup_steps
        if self.decay == "constant" or self.num_training_steps is None:
            return 1.0
        span = max(1, self.num_training_steps - self.num_warmup_steps)
        progress = min(1.0, max(0.0, (step - self.num_warmup_steps) / span))
        if self.decay == "linear":
            factor = 1.0 - progress
        else:
            factor = 0.5 * (1.0 + math.cos(2.0 * math.pi * self.num_cycles * progress))
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * max(0.0, factor)


@component
def cosine_with_warmup(
    optimizer: Optimizer,
    *,
    num_warmup_steps: int,
    num_training_steps: int,
    min_lr_ratio: float = 0.0,
    num_cycles: float = 0.5,
    last_epoch: int = -1,
) -> LambdaLR:
    """Linear warmup from 0, then cosine decay to ``min_lr_ratio * lr``.

    ``num_cycles=0.5`` is a half cosine (peak -> floor once over the decay phase).

    Example::

        >>> opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=1.0)
        >>> sched = cosine_with_warmup(opt, num_warmup_steps=10, num_training_steps=100)
        >>> [round(sched.lr_lambdas[0](step), 4) for step in (0, 5, 10, 55, 100, 200)]
        [0.0, 0.5, 1.0, 0.5, 0.0, 0.0]
    """
    _check_args(num_warmup_steps, num_training_steps, min_lr_ratio)
    if not num_cycles > 0:
        raise ValueError(f"num_cycles must be > 0, got {num_cycles}")
    fn = _WarmupDecay(
        "cosine", num_warmup_steps, num_training_steps, float(min_lr_ratio), float(num_cycles)
    )
    return LambdaLR(optimizer, fn, last_epoch=last_epoch)


@component
def linear_with_warmup(
    optimizer: Optimizer,
    *,
    num_warmup_steps: int,
    num_training_steps: int,
    min_lr_ratio: float = 0.0,
    last_epoch: int = -1,
) -> LambdaLR:
    """Linear warmup from 0, then linear decay to ``min_lr_ratio * lr`` at ``num_training_steps``.

    Example::

        >>> opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=1.0)
        >>> sched = linear_with_warmup(opt, num_warmup_steps=10, num_training_steps=100)
        >>> [sched.lr_lambdas[0](step) for step in (0, 5, 10, 55, 100, 200)]
        [0.0, 0.5, 1.0, 0.5, 0.0, 0.0]
    """
    _check_args(num_warmup_steps, num_training_steps, min_lr_ratio)
    fn = _WarmupDecay("linear", num_warmup_steps, num_training_steps, float(min_lr_ratio))
    return LambdaLR(optimizer, fn, last_epoch=last_epoch)


@component
def constant_with_warmup(
    optimizer: Optimizer,
    *,
    num_warmup_steps: int,
    num_training_steps: int | None = None,
    last_epoch: int = -1,
) -> LambdaLR:
    """Linear warmup from 0, then the optimizer's ``lr`` unchanged.

    ``num_training_steps`` is optional and only checked (warmup must fit inside it), so all three
    schedules accept the same keyword arguments from a config.

    Example::

        >>> opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=1.0)
        >>> sched = constant_with_warmup(opt, num_warmup_steps=10)
        >>> [sched.lr_lambdas[0](step) for step in (0, 5, 10, 1000)]
        [0.0, 0.5, 1.0, 1.0]
    """
    _check_args(num_warmup_steps, num_training_steps)
    return LambdaLR(optimizer, _WarmupDecay("constant", num_warmup_steps), last_epoch=last_epoch)


def schedule_params(scheduler: LRScheduler) -> list[dict[str, Any]] | None:
    """The parameters of each group's multiplier (its length among them), or None when
    ``scheduler`` keeps them where they cannot be given back (not a ``LambdaLR`` of callable
    objects, e.g. of plain functions or another scheduler class).

    Example::

        >>> opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=1.0)
        >>> schedule_params(cosine_with_warmup(opt, num_warmup_steps=2, num_training_steps=8))
        [{'decay': 'cosine', 'num_warmup_steps': 2, 'num_training_steps': 8, ...}]
    """
    if not isinstance(scheduler, LambdaLR):
        return None
    if any(isinstance(fn, types.FunctionType) for fn in scheduler.lr_lambdas):
        return None  # LambdaLR saves nothing of a function: its length is in its code
    return [dict(vars(fn)) for fn in scheduler.lr_lambdas]


def set_schedule_params(scheduler: LambdaLR, params: list[dict[str, Any]]) -> None:
    """Give ``scheduler`` the multiplier ``params`` (from :func:`schedule_params` of a freshly
    built one) after ``load_state_dict`` restored the saved ones, and set each group's ``lr``
    to the new schedule's value at the current step, as ``scheduler.step()`` would have.

    Example (resume with a new length)::

        >>> def build(steps):
        ...     opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=1.0)
        ...     return opt, linear_with_warmup(opt, num_warmup_steps=0, num_training_steps=steps)
        >>> opt, sched = build(8)
        >>> for _ in range(4):
        ...     opt.step(); sched.step()
        >>> saved = sched.state_dict()                # a checkpoint at step 4 of 8
        >>> opt, sched = build(12)
        >>> fresh = schedule_params(sched)            # built for the new num_training_steps
        >>> sched.load_state_dict(saved)              # the old length's parameters come back
        >>> set_schedule_params(sched, fresh)         # the new length's schedule from here on
        >>> opt.param_groups[0]["lr"]                 # step 4 of 12
        0.666...
    """
    for fn, values in zip(scheduler.lr_lambdas, params, strict=True):
        vars(fn).update(values)
    lrs = [
        base * fn(scheduler.last_epoch)
        for fn, base in zip(scheduler.lr_lambdas, scheduler.base_lrs, strict=True)
    ]
    for group, lr in zip(scheduler.optimizer.param_groups, lrs, strict=True):
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(float(lr))
        else:
            group["lr"] = lr
    scheduler._last_lr = [group["lr"] for group in scheduler.optimizer.param_groups]
