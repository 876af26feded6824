"""What the trained weights, their optimizer copies and the optimizer's states are stored in:
the ``precision`` config key (autocast stays ``mixed_precision``).

``precision: {weights, master_weights, optimizer_states, save_dtype, matmuls}`` (every key
optional):

- ``weights``: ``fp32`` or ``bf16``, the dtype the trained model's parameters are cast to,
  hence of its forward, backward and gradients (:func:`cast_weights`); null (default): as the
  ``model`` component builds them (its ``dtype``). Gradients accumulate over micro-batches in
  this dtype (autograd keeps a gradient in its parameter's dtype).
- ``master_weights``: ``fp32`` or null (default). With ``bf16`` weights, an fp32 copy of each
  trained parameter that the optimizer steps; the bf16 weight is the copy rounded to nearest
  after every step (:class:`MasterWeightOptimizer`). Null: the optimizer steps the weights
  themselves, in their dtype.
- ``optimizer_states``: ``fp32`` or ``bf16``; null (default): the dtype of what the optimizer
  steps (the masters, else the weights). ``bf16`` with fp32 masters stores the states (AdamW's
  moments) in bf16 between steps and steps them in fp32.
- ``save_dtype``: dtype of the exported HF weights; null (default): the weights' own. A dtype
  narrower than ``weights`` is refused (resume must be exact).
- ``matmuls``: ``fp8_rowwise`` or ``fp8_tensorwise``: the linear layers' matmuls in float8
  (torchao; CUDA compute capability 8.9+, bf16 compute: :mod:`tunesmith.training.fp8`); null
  (default): in the weights' (or autocast's) dtype. The stored dtypes above do not change.

The modes, and bytes per trained parameter at rest (weights + masters + AdamW's two moments;
the gradients add the weights' size during a step):

- fp32 weights (the default; ``mixed_precision: bf16`` adds autocast): 4 + 0 + 8 = 12;
- bf16 weights, fp32 masters, fp32 states: 2 + 4 + 8 = 14 (bf16 compute, fp32 updates);
- bf16 weights, fp32 masters, bf16 states: 2 + 4 + 4 = 10;
- bf16 weights, no masters (bf16 states): 2 + 0 + 4 = 6 ("pure bf16": each update is
  rounded into the bf16 weight, so updates below half a bf16 step of a weight are lost).

Refused (:func:`precision_problem`, :func:`check_precision`), each with its reason:
``master_weights`` with fp32 weights (the weights are the fp32 copy); ``optimizer_states:
fp32`` with bf16 weights and no masters (torch's optimizers keep their states in the dtype of
the tensors they step: keep fp32 masters for fp32 states); ``optimizer_states: bf16`` with
fp32 weights (same reason); ``mixed_precision`` with bf16 weights (the matmuls already run in
bf16: autocast would add casts only); ``master_weights`` with ``optimizer_in_backward`` (the
masters are stepped after the backward, not in it); a ``save_dtype`` narrower than the weights.

Example::

    >>> p = Precision.from_mapping({"weights": "bf16", "master_weights": "fp32"})
    >>> p.weights, p.master_weights, p.optimizer_states, p.save_dtype
    (torch.bfloat16, torch.float32, torch.float32, None)
    >>> precision_problem({"weights": "fp32", "master_weights": "fp32"})
    'master_weights: fp32 needs weights: bf16 (fp32 weights are their own master copy)'
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tunesmith.config import ConfigError, ConfigIssue
from tunesmith.modules.dtypes import dtype_from_name

__all__ = [
    "PRECISION_KEYS",
    "MasterWeightOptimizer",
    "Precision",
    "build_optimizer",
    "cast_weights",
    "check_precision",
    "device_problem",
    "machine_problem",
    "precision_problem",
]

PRECISION_KEYS = ("weights", "master_weights", "optimizer_states", "save_dtype", "matmuls")
MATMULS = ("fp8_rowwise", "fp8_tensorwise")
MIN_CAPABILITY = (8, 9)
"""The oldest CUDA compute capability with float8 tensor cores (Ada; Hopper is 9.0)."""
_NAMES = {"fp32": torch.float32, "bf16": torch.bfloat16}
_WORDS = {v: k for k, v in _NAMES.items()}


@dataclass(frozen=True)
class Precision:
    """The resolved ``precision`` key (see the module docs): dtypes; None: no cast (weights),
    no masters, the stepped tensors' dtype (states), the weights' own (save).

    Example::

        >>> Precision.from_mapping(None) == Precision()
        True
        >>> Precision.from_mapping({"weights": "bf16"}).optimizer_states
        torch.bfloat16
    """

    weights: torch.dtype | None = None
    master_weights: torch.dtype | None = None
    optimizer_states: torch.dtype | None = None
    save_dtype: torch.dtype | None = None
    matmuls: str | None = None

    @classmethod
    def from_mapping(cls, value: Mapping[str, Any] | None) -> Precision:
        """The precision a ``precision`` mapping (or null) asks for; a refused combination or
        an unknown key/value raises ``ValueError`` with :func:`precision_problem`'s words."""
        problem = precision_problem(value)
        if problem is not None:
            raise ValueError(f"precision: {problem}")
        value = value or {}
        weights = _NAMES.get(value.get("weights"))
        master = _NAMES.get(value.get("master_weights"))
        states = _NAMES.get(value.get("optimizer_states"))
        save = value.get("save_dtype")
        return cls(
            weights=weights,
            master_weights=master,
            optimizer_states=states or master or weights,
            save_dtype=dtype_from_name(save) if save else None,
            matmuls=value.get("matmuls"),
        )

    def describe(self) -> str:
        """One line for the run's log.

        >>> Precision(torch.bfloat16, torch.float32, torch.bfloat16).describe()
        'precision: bf16 weights, fp32 master weights, bf16 optimizer states, saved as the weights'
        """

        def word(dtype: torch.dtype | None) -> str:
            return _WORDS.get(dtype, str(dtype))

        weights = "model-built" if self.weights is None else word(self.weights)
        master = f"{word(self.master_weights)} master" if self.master_weights else "no master"
        states = "same-dtype" if self.optimizer_states is None else word(self.optimizer_states)
        saved = "as the weights" if self.save_dtype is None else f"in {word(self.save_dtype)}"
        matmuls = "" if self.matmuls is None else f", {self.matmuls} matmuls"
        return (
            f"precision: {weights} weights, {master} weights, {states} optimizer states, "
            f"saved {saved}{matmuls}"
        )


def precision_problem(value: Any) -> str | None:
    """What is wrong with a ``precision`` value (a mapping or null), or None; the rule of
    :data:`~tunesmith.training.settings.LOOP_RULES` ``precision`` uses it.

    >>> precision_problem({"weights": "bf16", "optimizer_states": "fp32"})
    'optimizer_states: fp32 with bf16 weights needs master_weights: fp32 (torch optimizers keep their states in the dtype of the tensors they step)'
    >>> precision_problem({"weight": "bf16"})
    "unknown key 'weight' (allowed: weights, master_weights, optimizer_states, save_dtype, matmuls)"
    """
    if value is None:
        return None
    if not isinstance(value, Mapping) and not hasattr(value, "keys"):
        return f"expected a mapping of {', '.join(PRECISION_KEYS)}, or null (fp32)"
    for key in value.keys():  # noqa: SIM118 (a DictConfig or a dict)
        if key not in PRECISION_KEYS:
            return f"unknown key {key!r} (allowed: {', '.join(PRECISION_KEYS)})"
    for key in ("weights", "master_weights", "optimizer_states"):
        got = value.get(key)
        if got is not None and got not in _NAMES:
            return f"{key}: expected 'fp32' or 'bf16'{_null_words(key)}, got {got!r}"
    matmuls = value.get("matmuls")
    if matmuls is not None and matmuls not in MATMULS:
        allowed = ", ".join(MATMULS)
        return f"matmuls: expected one of {allowed}, or null (the weights' dtype), got {matmuls!r}"
    if value.get("master_weights") == "bf16":
        return "master_weights: bf16 is no master copy of bf16 weights; use fp32 or null"
    weights = _NAMES.get(value.get("weights"))
    master, states = value.get("master_weights"), value.get("optimizer_states")
    if master and weights != torch.bfloat16:
        return "master_weights: fp32 needs weights: bf16 (fp32 weights are their own master copy)"
    if states == "fp32" and weights == torch.bfloat16 and not master:
        return (
            "optimizer_states: fp32 with bf16 weights needs master_weights: fp32 (torch "
            "optimizers keep their states in the dtype of the tensors they step)"
        )
    if states == "bf16" and weights != torch.bfloat16:
        return (
            "optimizer_states: bf16 needs weights: bf16 (torch optimizers keep their states "
            "in the dtype of the tensors they step)"
        )
    save = value.get("save_dtype")
    if save is not None:
        try:
            saved = dtype_from_name(save, what="save_dtype")
        except ValueError as err:
            return str(err)
        if weights is not None and (
            torch.finfo(saved).bits < torch.finfo(weights).bits
            or (saved == torch.float16 and weights == torch.bfloat16)
        ):
            return (
                f"save_dtype: {save} is narrower than the {_WORDS[weights]} weights (a "
                "resume would not be exact)"
            )
    return None


def device_problem(device: torch.device, matmuls: str = "fp8_rowwise") -> str | None:
    """Why float8 matmuls cannot run on ``device`` (one line naming the requirement), or None.

    >>> device_problem(torch.device("cpu"), "fp8_tensorwise")[:60]
    'matmuls: fp8_tensorwise needs a CUDA GPU of compute capabili'
    """
    need = (
        f"matmuls: {matmuls} needs a CUDA GPU of compute capability "
        f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or newer (Ada, Hopper, Blackwell)"
    )
    if device.type != "cuda":
        where = "the CPU" if device.type == "cpu" else f"a {device.type} device"
        return f"{need}; this run is on {where}"
    if not torch.cuda.is_available():
        return f"{need}; this machine has no CUDA device"
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        return f"{need}; {name} is {capability[0]}.{capability[1]}"
    return None


def machine_problem(precision: Any) -> str | None:
    """:func:`device_problem` of the device a run gets here (``auto``: CUDA when there is
    one) for a ``precision`` mapping asking for float8 matmuls; None otherwise. The rule of
    the ``precision`` key calls it, so ``tunesmith validate`` and every run refuse the same
    line before anything is built (``device: cpu`` on a GPU machine is refused at set-up:
    :func:`~tunesmith.training.fp8.prepare`).

    >>> machine_problem({"weights": "bf16"}) is None
    True
    """
    matmuls = (precision or {}).get("matmuls") if hasattr(precision, "get") else None
    if matmuls not in MATMULS:
        return None
    return device_problem(torch.device("cuda"), matmuls)  # none here: "this machine has none"


def _null_words(key: str) -> str:
    return {
        "master_weights": ", or null (none)",
        "optimizer_states": ", or null (the dtype of what the optimizer steps)",
    }.get(key, "")


def check_precision(cfg: Mapping[str, Any]) -> Precision:
    """The run's :class:`Precision` from ``cfg.precision``, its combination with the other
    keys checked: ``mixed_precision`` with bf16 weights and ``master_weights`` with
    ``optimizer_in_backward`` are refused (:class:`~tunesmith.config.ConfigError`).

    >>> check_precision({"precision": {"weights": "bf16"}, "mixed_precision": "bf16"})
    Traceback (most recent call last):
    ...
    tunesmith.config.errors.ConfigError: mixed_precision: bf16 autocast with precision.weights: bf16 adds casts only (the matmuls already run in bf16); set mixed_precision: null
    """
    try:
        precision = Precision.from_mapping(cfg.get("precision"))
    except ValueError as err:
        issue = ConfigIssue("precision", str(err).split(": ", 1)[1])
        raise ConfigError.from_issues([issue]) from None
    issues = []
    if cfg.get("mixed_precision") and precision.weights == torch.bfloat16:
        issues.append(
            ConfigIssue(
                "mixed_precision",
                (
                    f"{cfg.get('mixed_precision')} autocast with precision.weights: "
                    f"{_WORDS[precision.weights]} adds casts only (the matmuls already run in "
                    f"{_WORDS[precision.weights]}); set mixed_precision: null"
                ),
            )
        )
    if precision.master_weights is not None and cfg.get("optimizer_in_backward"):
        issues.append(
            ConfigIssue(
                "optimizer_in_backward",
                (
                    "true with precision.master_weights: the master copies are stepped after the "
                    "backward, not in it; set one of them off"
                ),
            )
        )
    if issues:
        raise ConfigError.from_issues(issues)
    return precision


def cast_weights(model: nn.Module, precision: Precision) -> nn.Module:
    """``model`` with its floating parameters and buffers in ``precision.weights`` (in place;
    non-persistent float32 buffers such as RoPE's frequencies are kept by their own modules);
    as it is when ``weights`` is null.

    >>> cast_weights(nn.Linear(2, 2), Precision(torch.bfloat16)).weight.dtype
    torch.bfloat16
    """
    return model if precision.weights is None else model.to(precision.weights)


def build_optimizer(
    precision: Precision, params: Iterable[Any], make: Callable[[Any], torch.optim.Optimizer]
) -> torch.optim.Optimizer:
    """The run's optimizer over ``params``: ``make(params)`` itself, or, with master weights,
    a :class:`MasterWeightOptimizer` whose inner ``make`` steps the fp32 copies.

    >>> opt = build_optimizer(Precision(), [nn.Parameter(torch.ones(2))], torch.optim.AdamW)
    >>> type(opt).__name__
    'AdamW'
    """
    if precision.master_weights is None:
        return make(params)
    return MasterWeightOptimizer(
        params, make, master_dtype=precision.master_weights, state_dtype=precision.optimizer_states
    )


class MasterWeightOptimizer(torch.optim.Optimizer):
    """An optimizer over low-precision parameters that keeps a ``master_dtype`` copy of each:
    ``step()`` hands the gradients (cast up) to an inner optimizer built by ``make`` over the
    copies, steps it, and writes each copy back into its parameter (rounded to nearest).

    The wrapper's ``param_groups`` hold the model's parameters (LR schedules and
    ``torch.distributed.checkpoint`` see it as any optimizer); their hyperparameters are
    handed to the inner optimizer at every step. Its state of a parameter is the inner state
    of the copy plus ``"master"``, the copy itself: a checkpoint holds the masters and resumes
    exactly. ``state_dtype`` (default ``master_dtype``) stores the inner optimizer's floating
    states (AdamW's moments) in that dtype between steps; they are stepped in ``master_dtype``.

    Example::

        >>> w = nn.Parameter(torch.ones(3, dtype=torch.bfloat16))
        >>> opt = MasterWeightOptimizer([w], lambda p: torch.optim.SGD(p, lr=1e-3))
        >>> for _ in range(10):
        ...     w.grad = torch.ones_like(w); opt.step()
        >>> round(opt.state[w]["master"][0].item(), 4), w[0].item()  # bf16 SGD alone: 1.0
        (0.99, 0.98828125)
    """

    def __init__(
        self,
        params: Iterable[Any],
        make: Callable[[Any], torch.optim.Optimizer],
        *,
        master_dtype: torch.dtype = torch.float32,
        state_dtype: torch.dtype | None = None,
    ) -> None:
        groups = list(params)
        if groups and not isinstance(groups[0], Mapping):
            groups = [{"params": groups}]
        groups = [{**g, "params": list(g["params"])} for g in groups]
        self.master_dtype = master_dtype
        self.state_dtype = state_dtype or master_dtype
        self._masters: dict[torch.Tensor, torch.Tensor] = {}
        for group in groups:
            for p in group["params"]:
                if not p.is_floating_point():
                    raise ValueError(f"cannot keep a master copy of a {p.dtype} parameter")
                self._masters[p] = p.detach().to(master_dtype, copy=True)
        inner_groups = [{**g, "params": [self._masters[p] for p in g["params"]]} for g in groups]
        self.inner = make(inner_groups)
        super().__init__(groups, self.inner.defaults)
        for group, inner_group in zip(self.param_groups, self.inner.param_groups, strict=True):
            group.update({k: v for k, v in inner_group.items() if k != "params"})
        self._refresh_state()

    def _pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(p, self._masters[p]) for g in self.param_groups for p in g["params"]]

    def _refresh_state(self) -> None:
        """``self.state[p]``: the inner state of ``p``'s copy and the copy as ``"master"``."""
        self.state.clear()
        for p, master in self._pairs():
            self.state[p] = {**self.inner.state.get(master, {}), "master": master}

    def _init_inner(self) -> None:
        """Give a never stepped inner optimizer its states (a step with zero gradients and a
        zero learning rate, as ``torch.distributed.checkpoint`` does), so a state dict has
        every entry a checkpoint will hold."""
        if self.inner.state:
            return
        rates = [g.get("lr") for g in self.inner.param_groups]
        for group in self.inner.param_groups:
            if "lr" in group:
                group["lr"] = 0.0
            for master in group["params"]:
                master.grad = torch.zeros_like(master)
        self.inner.step()
        for group, rate in zip(self.inner.param_groups, rates, strict=True):
            if rate is not None:
                group["lr"] = rate
        self.inner.zero_grad(set_to_none=True)
        self._cast_states(self.state_dtype)
        self._refresh_state()

    def _cast_states(self, dtype: torch.dtype) -> None:
        """The inner optimizer's floating state tensors (not ``step``) in ``dtype``."""
        if self.state_dtype == self.master_dtype:
            return
        for state in self.inner.state.values():
            for key, value in state.items():
                if key != "step" and torch.is_tensor(value) and value.is_floating_point():
                    state[key] = value.to(dtype)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Step the master copies with the parameters' gradients, then copy them back."""
        if closure is not None:
            raise ValueError("MasterWeightOptimizer.step takes no closure")
        for group, inner_group in zip(self.param_groups, self.inner.param_groups, strict=True):
            inner_group.update({k: v for k, v in group.items() if k != "params"})
        pairs = [(p, m) for p, m in self._pairs() if p.grad is not None]
        for p, master in pairs:
            master.grad = p.grad.to(self.master_dtype)
        self._cast_states(self.master_dtype)
        self.inner.step()
        self._cast_states(self.state_dtype)
        for p, master in pairs:
            master.grad = None
            p.copy_(master)
        self._refresh_state()
        return None

    def state_dict(self) -> dict[str, Any]:
        """``{"state": {index: {"master": ..., <inner state>...}}, "param_groups": [...]}``,
        indexed like any torch optimizer's (the parameters in ``param_groups`` order)."""
        self._init_inner()
        index = {p: i for i, (p, _) in enumerate(self._pairs())}
        state = {index[p]: dict(s) for p, s in self.state.items()}
        groups = [
            {
                **{k: v for k, v in g.items() if k != "params"},
                "params": [index[p] for p in g["params"]],
            }
            for g in self.param_groups
        ]
        return {"state": state, "param_groups": groups}

    @torch.no_grad()
    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned: the masters are copied in (in their
        dtype), the inner states keep the dtype they were saved in."""
        pairs = self._pairs()
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(
                f"the state has {len(saved_groups)} parameter groups, the "
                f"optimizer {len(self.param_groups)}"
            )
        for group, saved in zip(self.param_groups, saved_groups, strict=True):
            group.update({k: v for k, v in saved.items() if k != "params"})
        # the saved groups name their parameters (indices, or names from dcp) in our order
        ids = [key for saved in saved_groups for key in saved["params"]]
        if len(ids) != len(pairs):
            raise ValueError(f"the state has {len(ids)} parameters, the optimizer {len(pairs)}")
        by_id = dict(zip(ids, pairs, strict=True))
        self.inner.state.clear()
        for key, saved in state_dict["state"].items():
            p, master = by_id[key]
            if "master" not in saved:
                raise ValueError(f"the state of parameter {key} has no 'master' copy")
            master.copy_(saved["master"])
            self.inner.state[master] = {
                k: (v.to(device=master.device) if torch.is_tensor(v) and k != "step" else v)
                for k, v in saved.items()
                if k != "master"
            }
            p.copy_(master)
        self._refresh_state()

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=set_to_none)
        self.inner.zero_grad(set_to_none=True)
