"""Optimizer in backward: each parameter is updated the moment its gradient is complete.

:class:`OptimizerInBackward` builds one small optimizer per parameter and registers a
``post_accumulate_grad`` hook that steps it and frees the gradient, so no gradient outlives
its own update and the peak memory holds one parameter's gradient instead of all of them.
Under FSDP2 the hook fires on the sharded parameter right after its gradient is
reduce-scattered, so each rank updates its own shard.

The object *is* a :class:`torch.optim.Optimizer` to everything around the loop:

* ``param_groups`` lists the inner optimizers' own groups (one per parameter), so an LR
  scheduler such as :func:`~tunesmith.training.cosine_with_warmup` drives every parameter;
* ``state_dict()``/``load_state_dict()`` use the ordinary layout (state keyed by parameter
  index, one group per parameter), so ``torch.save`` and
  ``torch.distributed.checkpoint``'s ``get_optimizer_state_dict``/``set_optimizer_state_dict``
  (which key it by parameter name) work unchanged;
* ``step()`` and ``zero_grad()`` only touch parameters that still hold a gradient, which in
  the normal flow is none: the training loop may keep calling them.

Because a parameter is updated before the rest of the backward pass has run, gradients can
neither be accumulated over micro-batches nor clipped by their global norm, and an update
cannot be undone after a non-finite loss: :func:`check_compatible` turns such configs down.

Example::

    >>> from functools import partial
    >>> from tunesmith.training.lr_schedules import cosine_with_warmup
    >>> model = torch.nn.Linear(4, 2)
    >>> opt = OptimizerInBackward(model.parameters(), partial(torch.optim.AdamW, lr=1e-3))
    >>> sched = cosine_with_warmup(opt, num_warmup_steps=2, num_training_steps=10)
    >>> before = model.bias.detach().clone()
    >>> model(torch.randn(3, 4)).sum().backward()   # parameters are updated here
    >>> sched.step()
    >>> model.bias.grad is None, torch.equal(model.bias, before)  # step 0 of warmup: lr 0
    (True, True)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from tunesmith.config import ConfigError, ConfigIssue

__all__ = ["OptimizerInBackward", "check_compatible"]

OptimizerFactory = Callable[[list[dict[str, Any]]], Optimizer]


class _StateView(Mapping):
    """``optimizer.state`` of the wrapper: each parameter's state in its own optimizer."""

    def __init__(self, owner: OptimizerInBackward) -> None:
        self._owner = owner

    def __getitem__(self, param: torch.Tensor) -> dict[str, Any]:
        return self._owner._optimizer_of[param].state[param]

    def __iter__(self) -> Iterator[torch.Tensor]:
        for opt in self._owner.optimizers:
            yield from opt.state

    def __len__(self) -> int:
        return sum(len(opt.state) for opt in self._owner.optimizers)


class OptimizerInBackward(Optimizer):
    """Per-parameter optimizers stepped from ``post_accumulate_grad`` hooks.

    Args:
        params: parameters, or parameter-group dicts whose options (``lr``,
            ``weight_decay``, ...) apply to each of their parameters. Parameters that do not
            require a gradient are left out (their hook would never fire).
        optimizer_factory: builds one optimizer from a list of parameter-group dicts, e.g.
            ``functools.partial(torch.optim.AdamW, lr=1e-4)``,
            ``lambda groups: instantiate(cfg.optimizer, groups)``, or any low-precision
            optimizer class (``bitsandbytes.optim.AdamW8bit``, ``torchao.optim.AdamW8bit``).

    ``optimizers`` is the list of inner optimizers, in parameter order.

    Example::

        >>> from functools import partial
        >>> model = torch.nn.Linear(2, 1, bias=False)
        >>> with torch.no_grad():
        ...     _ = model.weight.fill_(1.0)
        >>> opt = OptimizerInBackward(model.parameters(), partial(torch.optim.SGD, lr=0.1))
        >>> loss = model(torch.tensor([[1.0, 2.0]])).sum()
        >>> loss.backward()              # every parameter has been updated, grads are None
        >>> model.weight, model.weight.grad  # 1 - 0.1 * x
        (Parameter containing:
        tensor([[0.9000, 0.8000]], requires_grad=True), None)
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        optimizer_factory: OptimizerFactory,
    ) -> None:
        if not callable(optimizer_factory):
            raise TypeError(
                f"optimizer_factory must be callable, got {type(optimizer_factory).__name__}"
            )
        self._factory = optimizer_factory
        self.optimizers: list[Optimizer] = []
        self._optimizer_of: dict[torch.Tensor, Optimizer] = {}
        self._handles: list[RemovableHandle] = []
        super().__init__(params, {})  # calls add_param_group for each group
        if not self.optimizers:
            raise ValueError("OptimizerInBackward got no parameter that requires a gradient")
        self.state = _StateView(self)  # type: ignore[assignment]

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Build one optimizer (and register one hook) per parameter of ``param_group``."""
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        options = {key: value for key, value in param_group.items() if key != "params"}
        for param in params:
            if not isinstance(param, torch.Tensor):
                raise TypeError(f"params must be tensors, got {type(param).__name__}")
            if not param.requires_grad:
                continue
            if param in self._optimizer_of:
                raise ValueError(
                    f"a parameter of shape {list(param.shape)} appears twice in the parameters "
                    "given to OptimizerInBackward"
                )
            opt = self._factory([{**options, "params": [param]}])
            if not isinstance(opt, Optimizer):
                raise TypeError(
                    f"optimizer_factory returned {type(opt).__name__}, not a torch Optimizer"
                )
            if len(opt.param_groups) != 1 or len(opt.param_groups[0]["params"]) != 1:
                raise ValueError(
                    "optimizer_factory must build an optimizer over exactly the "
                    "one parameter group it is given"
                )
            if not self.defaults:
                self.defaults = dict(opt.defaults)
            self.optimizers.append(opt)
            self._optimizer_of[param] = opt
            self.param_groups.append(opt.param_groups[0])
            self._handles.append(param.register_post_accumulate_grad_hook(self._hook_for(opt)))

    def _hook_for(self, opt: Optimizer) -> Callable[[torch.Tensor], None]:
        def step_and_free(param: torch.Tensor) -> None:
            opt.step()
            opt.zero_grad(set_to_none=True)
            # LR schedulers check this flag to tell "scheduler stepped before the optimizer"
            # (a warning) from the intended order; the update has just happened.
            self._opt_called = True

        return step_and_free

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Step the inner optimizers of parameters that still hold a gradient (normally none;
        ``torch.distributed.checkpoint`` uses this to create the state of a fresh optimizer)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for param, opt in self._optimizer_of.items():
            if param.grad is not None:
                opt.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """``{"state": {i: state of parameter i}, "param_groups": [group of parameter i]}``."""
        state: dict[int, Any] = {}
        groups: list[dict[str, Any]] = []
        for index, opt in enumerate(self.optimizers):
            inner = opt.state_dict()
            (group,) = inner["param_groups"]
            groups.append({**group, "params": [index]})
            if inner["state"]:
                (state[index],) = inner["state"].values()
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load what :meth:`state_dict` (or distributed checkpoint, keyed by names) returned."""
        groups = state_dict["param_groups"]
        if len(groups) != len(self.optimizers):
            raise ValueError(
                f"optimizer state has {len(groups)} parameter groups, but OptimizerInBackward "
                f"holds {len(self.optimizers)} parameters (one group each)"
            )
        for index, (opt, group) in enumerate(zip(self.optimizers, groups)):
            if len(group["params"]) != 1:
                raise ValueError(
                    f"optimizer state group {index} has {len(group['params'])} parameters; "
                    "OptimizerInBackward states have one parameter per group"
                )
            (key,) = group["params"]
            inner_state = {0: state_dict["state"][key]} if key in state_dict["state"] else {}
            opt.load_state_dict({"state": inner_state, "param_groups": [{**group, "params": [0]}]})
        # load_state_dict replaces each inner optimizer's group dict: point at the new ones.
        self.param_groups[:] = [opt.param_groups[0] for opt in self.optimizers]

    def remove_hooks(self) -> None:
        """Detach from the parameters: later backward passes leave gradients in ``.grad``."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def __repr__(self) -> str:
        inner = type(self.optimizers[0]).__name__ if self.optimizers else "none"
        return f"OptimizerInBackward({len(self.optimizers)} x {inner})"


def check_compatible(
    gradient_accumulation_steps: int,
    max_grad_norm: float | None,
    *,
    on_nonfinite_loss: str = "stop",
) -> None:
    """Raise a :class:`~tunesmith.config.ConfigError` if a run config cannot use an
    optimizer in backward, naming every offending key.

    A parameter is updated as soon as its gradient exists, so there is no later moment to
    add the next micro-batch's gradient, to clip by the norm of all gradients, or to skip
    the update of a step whose loss turned out non-finite.

    Example::

        >>> check_compatible(1, None)                      # fine
        >>> check_compatible(4, 1.0)
        Traceback (most recent call last):
        tunesmith.config.errors.ConfigError: optimizer_in_backward cannot be used:
        gradient_accumulation_steps: is 4, but optimizer_in_backward updates each parameter ...
        max_grad_norm: is 1.0, but optimizer_in_backward updates each parameter before the ...
    """
    issues = []
    if int(gradient_accumulation_steps) != 1:
        issues.append(
            ConfigIssue(
                "gradient_accumulation_steps",
                f"is {gradient_accumulation_steps}, but optimizer_in_backward updates each "
                "parameter during backward, so gradients cannot be accumulated over micro-batches; "
                "set gradient_accumulation_steps=1 (raise batch_size instead) or turn "
                "optimizer_in_backward off",
            )
        )
    if max_grad_norm:
        issues.append(
            ConfigIssue(
                "max_grad_norm",
                f"is {max_grad_norm}, but optimizer_in_backward updates each parameter before the "
                "other gradients exist, so their global norm cannot be clipped; set "
                "max_grad_norm=null or turn optimizer_in_backward off",
            )
        )
    if on_nonfinite_loss != "stop":
        issues.append(
            ConfigIssue(
                "on_nonfinite_loss",
                f"is {on_nonfinite_loss!r}, but with optimizer_in_backward the update is applied "
                "during backward and cannot be skipped afterwards; use 'stop'",
            )
        )
    if issues:
        raise ConfigError.from_issues(issues, header="optimizer_in_backward cannot be used:")
