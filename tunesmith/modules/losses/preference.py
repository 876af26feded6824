"""Pairwise preference losses: the DPO family (DPO/cDPO, IPO, hinge/RSO, SimPO, ORPO, CPO), the
Bradley-Terry loss of reward models, and KTO's loss of unpaired (thumbs up / down) completions
(:class:`KTOLoss` on :class:`UnpairedLogps`).

A DPO-family loss sees, for each preference pair, the summed log-probability of the chosen and
of the rejected response under the policy (and, for most, under a frozen reference model),
plus the number of response tokens of each (:class:`PairLogps`). It returns one loss per pair
(:class:`PreferenceLossOutput`): the recipe sums them and divides by the global pair count, so
gradient accumulation and data parallelism give the same update as one big batch. All
arithmetic is float32 at least (float64 for float64 inputs).

Notation used in the docstrings: ``π_c``/``π_r`` are the policy's summed log-probabilities of
the chosen/rejected response, ``ref_c``/``ref_r`` the reference's, ``|y|`` a response's token
count and ``h = (π_c - ref_c) - (π_r - ref_r)`` the difference of implicit rewards.

Example::

    >>> policy = PairLogps(
    ...     chosen=torch.tensor([-5.0]), rejected=torch.tensor([-7.0]),
    ...     chosen_tokens=torch.tensor([4]), rejected_tokens=torch.tensor([5]),
    ... )
    >>> reference = PairLogps(torch.tensor([-6.0]), torch.tensor([-6.0]), *policy.lengths())
    >>> out = DPOLoss(beta=0.1)(policy, reference)
    >>> out.losses.shape, round(out.chosen_rewards.item(), 3)
    (torch.Size([1]), 0.1)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch
import torch.nn.functional as F
from torch import nn

from tunesmith.config.registry import component

__all__ = [
    "CPO_LOSS_TYPES",
    "BradleyTerryLoss",
    "CPOLoss",
    "DPOLoss",
    "HingeLoss",
    "IPOLoss",
    "KTOLoss",
    "KTOLossOutput",
    "ORPOLoss",
    "PairLogps",
    "PreferenceLossOutput",
    "SimPOLoss",
    "UnpairedLogps",
]


@dataclass
class PairLogps:
    """Sequence log-probabilities of a batch of ``P`` preference pairs, each tensor ``[P]``.

    Attributes:
        chosen: summed log-probability of the chosen response's tokens.
        rejected: summed log-probability of the rejected response's tokens.
        chosen_tokens: number of response tokens of the chosen response (int or float).
        rejected_tokens: number of response tokens of the rejected response.

    Example::

        >>> logps = PairLogps(torch.tensor([-4.0]), torch.tensor([-9.0]),
        ...                   torch.tensor([2]), torch.tensor([3]))
        >>> logps.average()
        (tensor([-2.]), tensor([-3.]))
    """

    chosen: torch.Tensor
    rejected: torch.Tensor
    chosen_tokens: torch.Tensor
    rejected_tokens: torch.Tensor

    def lengths(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(chosen_tokens, rejected_tokens)``."""
        return self.chosen_tokens, self.rejected_tokens

    def average(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Length-averaged log-probabilities ``(π_c / |y_c|, π_r / |y_r|)``; every token count
        must be positive."""
        chosen, rejected = _as_float(self.chosen, self.rejected)
        return (
            chosen / _token_counts(self.chosen_tokens, chosen, "chosen_tokens"),
            rejected / _token_counts(self.rejected_tokens, rejected, "rejected_tokens"),
        )


@dataclass
class PreferenceLossOutput:
    """What a preference loss returns, each tensor ``[P]``.

    Attributes:
        losses: per-pair loss (the recipe sums it and divides by the global pair count).
        chosen_rewards: implicit reward of each chosen response, detached (for logging).
        rejected_rewards: implicit reward of each rejected response, detached.
        nll_loss: the mean token NLL of each chosen response, detached, for a loss with an SFT
            term (ORPO, CPO; logged as ``nll_loss``); ``None`` for the others.

    Example::

        >>> out = PreferenceLossOutput(torch.ones(2), torch.zeros(2), torch.zeros(2))
        >>> out.losses.sum().item(), out.nll_loss
        (2.0, None)
    """

    losses: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor
    nll_loss: torch.Tensor | None = None


# -- helpers -----------------------------------------------------------------------------------


def _as_float(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``tensors`` in float32, or float64 when any is float64."""
    dtype = torch.float32
    for t in tensors:
        dtype = torch.promote_types(dtype, t.dtype) if t.is_floating_point() else dtype
    return tuple(t.to(dtype) for t in tensors)


def _token_counts(counts: torch.Tensor, like: torch.Tensor, name: str) -> torch.Tensor:
    """``counts`` as ``like``'s float dtype; a clear error when a count is not positive."""
    counts = torch.as_tensor(counts, device=like.device)
    if counts.shape != like.shape:
        raise ValueError(
            f"PairLogps.{name} has shape {list(counts.shape)}, expected {list(like.shape)}"
        )
    if (counts <= 0).any():
        raise ValueError(
            f"PairLogps.{name} must be > 0 for every pair (a response with no trained "
            f"token), got {counts.tolist()}"
        )
    return counts.to(like.dtype)


def _check_pairs(logps: PairLogps, role: str) -> None:
    """Every log-probability tensor of ``logps`` is 1-D and the same size."""
    if logps.chosen.dim() != 1 or logps.chosen.shape != logps.rejected.shape:
        raise ValueError(
            f"{role} log-probs must both be [P], got chosen {list(logps.chosen.shape)} and "
            f"rejected {list(logps.rejected.shape)}"
        )


def _need_reference(
    loss: nn.Module, policy: PairLogps, reference: PairLogps | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ref_c, ref_r)``: the reference's log-probs, zeros for a reference-free loss, and a
    clear error when the loss needs a reference and got none."""
    _check_pairs(policy, "policy")
    if not loss.needs_reference:
        zeros = torch.zeros_like(policy.chosen)
        return zeros, zeros
    if reference is None:
        raise ValueError(
            f"{type(loss).__name__} needs the reference model's log-probs, got reference=None "
            "(compute them with the frozen reference model under torch.no_grad()"
            + (", or pass reference_free=True)" if isinstance(loss, DPOLoss) else ")")
        )
    _check_pairs(reference, "reference")
    if reference.chosen.shape != policy.chosen.shape:
        raise ValueError(
            f"reference log-probs {list(reference.chosen.shape)} and policy log-probs "
            f"{list(policy.chosen.shape)} must have the same number of pairs"
        )
    return reference.chosen.detach(), reference.rejected.detach()


def _output(
    losses: torch.Tensor,
    chosen_rewards: torch.Tensor,
    rejected_rewards: torch.Tensor,
    nll_loss: torch.Tensor | None = None,
) -> PreferenceLossOutput:
    nll = None if nll_loss is None else nll_loss.detach()
    return PreferenceLossOutput(losses, chosen_rewards.detach(), rejected_rewards.detach(), nll)


def _check_beta(beta: float, name: str = "beta") -> None:
    if not beta > 0:
        raise ValueError(f"{name} must be > 0, got {beta!r}")


def _check_label_smoothing(label_smoothing: float) -> None:
    if not 0.0 <= label_smoothing <= 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5], got {label_smoothing!r}")


def _log1m_exp(a: torch.Tensor) -> torch.Tensor:
    """``log(1 - exp(a))`` for ``a < 0``, accurate for every ``a`` (Mächler 2012): ``log(-expm1)``
    near 0, ``log1p(-exp)`` far from it."""
    return torch.where(a > -0.6931471805599453, torch.log(-torch.expm1(a)), torch.log1p(-a.exp()))


# -- reference-based losses --------------------------------------------------------------------


class _PairLoss(nn.Module):
    """A preference loss's β (checked) and other hyperparameters, all shown by ``repr``."""

    needs_reference: bool = True

    def __init__(self, beta: float, **hyperparameters: Any) -> None:
        super().__init__()
        _check_beta(beta)
        self.beta = beta
        self._shown = ["beta", *hyperparameters]
        for name, value in hyperparameters.items():
            setattr(self, name, value)

    def extra_repr(self) -> str:
        return ", ".join(f"{name}={getattr(self, name)}" for name in self._shown)


@component
class DPOLoss(_PairLoss):
    """Sigmoid DPO (Rafailov et al. 2023), with conservative label smoothing (cDPO, Mitchell
    2023): ``-(1-ε)·logσ(β·h) - ε·logσ(-β·h)``.

    ``ε`` (``label_smoothing``) is the assumed probability that a pair's preference label is
    flipped; ``ε = 0`` is plain DPO. With ``reference_free=True`` the reference log-probs are
    taken as 0 (no reference model; ``needs_reference`` is then ``False`` on the instance) and
    a passed ``reference`` is ignored. Rewards are ``β·(π - ref)``.

    Example::

        >>> loss = DPOLoss(beta=0.1, reference_free=True)
        >>> logps = PairLogps(torch.tensor([-1.0]), torch.tensor([-3.0]),
        ...                   torch.tensor([1]), torch.tensor([1]))
        >>> round(loss(logps).losses.item(), 4)  # -log σ(0.1 * 2)
        0.5981
    """

    needs_reference: bool = True

    def __init__(
        self, beta: float = 0.1, label_smoothing: float = 0.0, reference_free: bool = False
    ) -> None:
        _check_label_smoothing(label_smoothing)
        super().__init__(beta, label_smoothing=label_smoothing, reference_free=reference_free)
        if reference_free:
            self.needs_reference = False

    def forward(
        self, policy: PairLogps, reference: PairLogps | None = None
    ) -> PreferenceLossOutput:
        ref_c, ref_r = _need_reference(self, policy, reference)
        pi_c, pi_r, ref_c, ref_r = _as_float(policy.chosen, policy.rejected, ref_c, ref_r)
        logits = self.beta * ((pi_c - ref_c) - (pi_r - ref_r))
        eps = self.label_smoothing
        losses = -(1 - eps) * F.logsigmoid(logits) - eps * F.logsigmoid(-logits)
        return _output(losses, self.beta * (pi_c - ref_c), self.beta * (pi_r - ref_r))


@component
class IPOLoss(_PairLoss):
    """IPO (Azar et al. 2023): ``(h - 1/(2β))²``, a squared loss that pulls the reward margin
    to ``1/(2β)`` instead of pushing it to infinity.

    With ``average_log_prob=True`` (the default) ``h`` is computed from length-averaged
    log-probabilities (``π/|y|``, ``ref/|y|``), as in the IPO reference implementations:
    the target margin ``1/(2β)`` is then a per-token margin that does not depend on the
    response length. ``False`` uses the summed log-probabilities. Rewards are ``β·(π - ref)``
    on the same (averaged or summed) log-probabilities.

    Example::

        >>> logps = PairLogps(torch.tensor([-4.0]), torch.tensor([-9.0]),
        ...                   torch.tensor([2]), torch.tensor([3]))
        >>> ref = PairLogps(torch.tensor([-4.0]), torch.tensor([-9.0]), *logps.lengths())
        >>> IPOLoss(beta=0.5)(logps, ref).losses  # (0 - 1)^2
        tensor([1.])
    """

    needs_reference: bool = True

    def __init__(self, beta: float = 0.1, average_log_prob: bool = True) -> None:
        super().__init__(beta, average_log_prob=average_log_prob)

    def forward(
        self, policy: PairLogps, reference: PairLogps | None = None
    ) -> PreferenceLossOutput:
        ref_c, ref_r = _need_reference(self, policy, reference)
        pi_c, pi_r, ref_c, ref_r = _as_float(policy.chosen, policy.rejected, ref_c, ref_r)
        if self.average_log_prob:
            len_c = _token_counts(policy.chosen_tokens, pi_c, "chosen_tokens")
            len_r = _token_counts(policy.rejected_tokens, pi_r, "rejected_tokens")
            pi_c, ref_c, pi_r, ref_r = pi_c / len_c, ref_c / len_c, pi_r / len_r, ref_r / len_r
        chosen_margin, rejected_margin = pi_c - ref_c, pi_r - ref_r
        losses = (chosen_margin - rejected_margin - 1 / (2 * self.beta)) ** 2
        return _output(losses, self.beta * chosen_margin, self.beta * rejected_margin)


@component
class HingeLoss(_PairLoss):
    """Hinge loss of RSO (Liu et al. 2023): ``relu(1 - β·h)``. Rewards are ``β·(π - ref)``.

    Example::

        >>> logps = PairLogps(torch.tensor([-1.0]), torch.tensor([-3.0]),
        ...                   torch.tensor([1]), torch.tensor([1]))
        >>> ref = PairLogps(torch.tensor([-2.0]), torch.tensor([-2.0]), *logps.lengths())
        >>> HingeLoss(beta=0.1)(logps, ref).losses  # 1 - 0.1 * 2
        tensor([0.8000])
    """

    needs_reference: bool = True

    def __init__(self, beta: float = 0.1) -> None:
        super().__init__(beta)

    def forward(
        self, policy: PairLogps, reference: PairLogps | None = None
    ) -> PreferenceLossOutput:
        ref_c, ref_r = _need_reference(self, policy, reference)
        pi_c, pi_r, ref_c, ref_r = _as_float(policy.chosen, policy.rejected, ref_c, ref_r)
        chosen_margin, rejected_margin = pi_c - ref_c, pi_r - ref_r
        losses = torch.relu(1 - self.beta * (chosen_margin - rejected_margin))
        return _output(losses, self.beta * chosen_margin, self.beta * rejected_margin)


# -- reference-free losses ---------------------------------------------------------------------


@component
class SimPOLoss(_PairLoss):
    """SimPO (Meng et al. 2024): ``-logσ(β·π_c/|y_c| - β·π_r/|y_r| - γ)``, reference-free
    (a passed ``reference`` is ignored). The length-normalised log-probability is the implicit
    reward (``β·π/|y|``) and ``γ`` the target reward margin.

    Example::

        >>> logps = PairLogps(torch.tensor([-2.0]), torch.tensor([-6.0]),
        ...                   torch.tensor([2]), torch.tensor([3]))
        >>> out = SimPOLoss(beta=2.0, gamma=0.5)(logps)  # -log σ(2·(-1) - 2·(-2) - 0.5)
        >>> round(out.losses.item(), 4), out.chosen_rewards
        (0.2014, tensor([-2.]))
    """

    needs_reference: bool = False

    def __init__(self, beta: float = 2.0, gamma: float = 0.5) -> None:
        super().__init__(beta, gamma=gamma)

    def forward(
        self, policy: PairLogps, reference: PairLogps | None = None
    ) -> PreferenceLossOutput:
        _check_pairs(policy, "policy")
        avg_c, avg_r = policy.average()
        chosen_rewards, rejected_rewards = self.beta * avg_c, self.beta * avg_r
        losses = -F.logsigmoid(chosen_rewards - rejected_rewards - self.gamma)
        return _output(losses, chosen_rewards, rejected_rewards)


@component
class ORPOLoss(_PairLoss):
    """ORPO (Hong et al. 2024), reference-free: per pair
    ``NLL_c - β·logσ(log odds(y_c) - log odds(y_r))``.

    ``NLL_c = -π_c/|y_c|`` is the mean token NLL of the chosen response (the SFT term);
    ``log odds(y) = a - log(1 - exp(a))`` with ``a = π/|y|`` the average token log-prob,
    computed in a numerically safe form. ``a`` is clamped just below 0 so a response the
    model is certain of gives large finite odds, not infinity. Rewards are ``β·π/|y|``.

    Example::

        >>> logps = PairLogps(torch.tensor([-2.0]), torch.tensor([-6.0]),
        ...                   torch.tensor([2]), torch.tensor([3]))
        >>> out = ORPOLoss(beta=0.1)(logps)
        >>> round(out.losses.item(), 4)  # 1 - 0.1 * log σ(log odds(-1) - log odds(-2))
        1.0238
    """

    needs_reference: bool = False

    def __init__(self, beta: float = 0.1) -> None:
        super().__init__(beta)

    def forward(
        self, policy: PairLogps, reference: PairLogps | None = None
    ) -> PreferenceLossOutput:
        _check_pairs(policy, "policy")
        avg_c, avg_r = policy.average()
        log_odds = _log_odds(avg_c) - _log_odds(avg_r)
        losses = -avg_c - self.beta * F.logsigmoid(log_odds)
        return _output(losses, self.beta * avg_c, self.beta * avg_r, nll_loss=-avg_c)


def _log_odds(avg_logp: torch.Tensor) -> torch.Tensor:
    """``log(p / (1 - p))`` of ``p = exp(avg_logp)``, finite for every ``avg_logp <= 0``."""
    tiny = torch.finfo(avg_logp.dtype).eps
    a = avg_logp.clamp(max=-tiny)
    return a - _log1m_exp(a)


CPOLossType = Literal["sigmoid", "hinge", "ipo", "simpo"]
CPO_LOSS_TYPES: tuple[str, ...] = get_args(CPOLossType)


@component
class CPOLoss(_PairLoss):
    """CPO (Xu et al. 2024) and its SimPO variant, reference-free, with the names and
    ``loss_type`` values of TRL's ``CPOConfig``. Per pair, with ``x = l_c - l_r``:

    - ``sigmoid``: ``-(1-ε)·logσ(β·x) - ε·logσ(-β·x)`` (the paper's Eq. 3 at ``ε = 0``);
    - ``hinge``: ``relu(1 - β·x)``;
    - ``ipo``: ``(x - 1/(2β))²``;
    - ``simpo``: ``sigmoid`` on ``x - γ/β`` (``γ`` = ``simpo_gamma``), i.e.
      ``-logσ(β·x - γ)`` at ``ε = 0``;

    plus ``cpo_alpha · NLL_c``, the behaviour-cloning term. ``l = π`` (summed log-probs) for
    ``sigmoid``/``hinge``, ``l = π/|y|`` (length-averaged) for ``ipo``/``simpo``, as TRL.
    Rewards are ``β·l``. ``NLL_c = -π_c/|y_c|`` is the mean token NLL of each chosen
    response, so the recipe's mean over pairs is a mean of per-response means: TRL instead
    averages over all chosen tokens of its batch (a token-weighted mean), which is the same
    when the chosen responses have equal lengths; the per-pair form keeps gradient
    accumulation and data parallelism equal to one big batch. ``simpo_gamma`` is used by
    ``simpo`` only. Every token count must be positive; a passed ``reference`` is ignored.

    Example::

        >>> logps = PairLogps(torch.tensor([-2.0]), torch.tensor([-6.0]),
        ...                   torch.tensor([2]), torch.tensor([3]))
        >>> out = CPOLoss(beta=0.5, loss_type="hinge", cpo_alpha=1.0)(logps)
        >>> out.losses, out.nll_loss  # relu(1 - 0.5·4) + 1·(2/2)
        (tensor([1.]), tensor([1.]))
    """

    needs_reference: bool = False

    def __init__(
        self,
        beta: float = 0.1,
        loss_type: CPOLossType = "sigmoid",
        label_smoothing: float = 0.0,
        cpo_alpha: float = 1.0,
        simpo_gamma: float = 0.5,
    ) -> None:
        _check_cpo(loss_type, label_smoothing, cpo_alpha)
        super().__init__(
            beta,
            loss_type=loss_type,
            label_smoothing=label_smoothing,
            cpo_alpha=cpo_alpha,
            simpo_gamma=simpo_gamma,
        )

    def forward(
        self, policy: PairLogps, reference: PairLogps | None = None
    ) -> PreferenceLossOutput:
        _check_pairs(policy, "policy")
        avg_c, avg_r = policy.average()
        if self.loss_type in ("ipo", "simpo"):
            chosen, rejected = avg_c, avg_r
        else:
            chosen, rejected = _as_float(policy.chosen, policy.rejected)
        losses = self._preference(chosen - rejected)
        return _output(
            losses - self.cpo_alpha * avg_c, self.beta * chosen, self.beta * rejected, -avg_c
        )

    def _preference(self, x: torch.Tensor) -> torch.Tensor:
        """The preference term of each pair from ``x = l_c - l_r``."""
        if self.loss_type == "hinge":
            return torch.relu(1 - self.beta * x)
        if self.loss_type == "ipo":
            return (x - 1 / (2 * self.beta)) ** 2
        if self.loss_type == "simpo":
            x = x - self.simpo_gamma / self.beta
        eps = self.label_smoothing
        return -(1 - eps) * F.logsigmoid(self.beta * x) - eps * F.logsigmoid(-self.beta * x)


def _check_cpo(loss_type: str, label_smoothing: float, cpo_alpha: float) -> None:
    """One clear line naming the key of a bad :class:`CPOLoss` setting."""
    if loss_type not in CPO_LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {', '.join(CPO_LOSS_TYPES)}, got {loss_type!r}")
    _check_label_smoothing(label_smoothing)
    if label_smoothing and loss_type in ("hinge", "ipo"):
        raise ValueError(
            f"label_smoothing applies to loss_type sigmoid or simpo only, got "
            f"label_smoothing={label_smoothing!r} with loss_type={loss_type!r}"
        )
    if not cpo_alpha >= 0:
        raise ValueError(f"cpo_alpha must be >= 0, got {cpo_alpha!r}")


# -- unpaired feedback ------------------------------------------------------------------------


@dataclass
class UnpairedLogps:
    """Sequence log-probabilities of ``N`` rated completions (unpaired), each tensor ``[N]``.

    Attributes:
        logps: summed log-probability of each completion's tokens.
        tokens: number of trained tokens of each completion (every one must be > 0).
        desirable: bool, the completion's label (True: desirable / thumbs up).

    Example::

        >>> rows = UnpairedLogps(torch.tensor([-4.0, -9.0]), torch.tensor([2, 3]),
        ...                      torch.tensor([True, False]))
        >>> rows.desirable.sum().item()
        1
    """

    logps: torch.Tensor
    tokens: torch.Tensor
    desirable: torch.Tensor


@dataclass
class KTOLossOutput:
    """What :class:`KTOLoss` returns.

    Attributes:
        losses: per-completion loss ``[N]``, weighted (the recipe sums it and divides by the
            global completion count).
        rewards: implicit reward ``β·(π - ref)`` of each completion, detached ``[N]``.
        kl: the KL estimate the losses used: detached and clamped at 0 (a scalar).

    Example::

        >>> out = KTOLossOutput(torch.ones(2), torch.zeros(2), torch.tensor(0.0))
        >>> out.losses.sum().item(), out.kl.item()
        (2.0, 0.0)
    """

    losses: torch.Tensor
    rewards: torch.Tensor
    kl: torch.Tensor


@component
class KTOLoss(nn.Module):
    """KTO (Ethayarajh et al. 2024, Eq. 7-8), with the names of TRL's ``KTOConfig``. Per
    completion, with ``r = π - ref`` its log-ratio and ``z`` the reference point:

    - desirable: ``desirable_weight · (1 - σ(β·(r - z)))``;
    - undesirable: ``undesirable_weight · (1 - σ(β·(z - r)))``.

    ``z = max(0, kl)``, detached: ``kl`` is the estimate of ``KL(π‖ref)`` that the caller
    computed from mismatched (prompt, completion) pairs, the mean of their ``π - ref`` over
    the whole step (all micro-batches, all data-parallel ranks), so this loss only clamps it.
    Rewards are ``β·r``. A completion with no trained token is refused (its log-ratio would be
    0 whatever the model does); a batch of one label only is fine.

    Example::

        >>> rows = UnpairedLogps(torch.tensor([-4.0, -9.0]), torch.tensor([2, 3]),
        ...                      torch.tensor([True, False]))
        >>> out = KTOLoss(beta=1.0)(rows, torch.tensor([-4.0, -9.0]), torch.tensor(-0.5))
        >>> out.losses, out.kl  # r = 0, z = max(0, -0.5) = 0: 1 - σ(0) each
        (tensor([0.5000, 0.5000]), tensor(0.))
    """

    needs_reference: bool = True

    def __init__(
        self, beta: float = 0.1, desirable_weight: float = 1.0, undesirable_weight: float = 1.0
    ) -> None:
        super().__init__()
        _check_beta(beta)
        for name, weight in (("desirable_weight", desirable_weight),
                             ("undesirable_weight", undesirable_weight)):  # fmt: skip
            if not weight > 0:
                raise ValueError(f"{name} must be > 0, got {weight!r}")
        self.beta = beta
        self.desirable_weight = desirable_weight
        self.undesirable_weight = undesirable_weight

    def extra_repr(self) -> str:
        return (
            f"beta={self.beta}, desirable_weight={self.desirable_weight}, "
            f"undesirable_weight={self.undesirable_weight}"
        )

    def forward(
        self, policy: UnpairedLogps, reference: torch.Tensor, kl: torch.Tensor
    ) -> KTOLossOutput:
        _check_unpaired(policy, reference)
        pi, ref, kl = _as_float(policy.logps, reference.detach(), torch.as_tensor(kl).detach())
        z = kl.clamp(min=0)
        ratio = pi - ref
        desirable = policy.desirable.to(device=pi.device, dtype=torch.bool)
        losses = torch.where(
            desirable,
            self.desirable_weight * (1 - torch.sigmoid(self.beta * (ratio - z))),
            self.undesirable_weight * (1 - torch.sigmoid(self.beta * (z - ratio))),
        )
        return KTOLossOutput(losses, (self.beta * ratio).detach(), z)


def _check_unpaired(policy: UnpairedLogps, reference: torch.Tensor) -> None:
    """Shapes agree and every completion has a trained token."""
    shape = list(policy.logps.shape)
    if policy.logps.dim() != 1:
        raise ValueError(f"policy log-probs must be [N], got {shape}")
    for name, value in (("reference", reference), ("desirable", policy.desirable)):
        if list(value.shape) != shape:
            raise ValueError(f"{name} has shape {list(value.shape)}, expected {shape}")
    tokens = torch.as_tensor(policy.tokens)
    if list(tokens.shape) != shape:
        raise ValueError(f"tokens has shape {list(tokens.shape)}, expected {shape}")
    if (tokens <= 0).any():
        empty = (tokens <= 0).nonzero().flatten().tolist()
        raise ValueError(
            f"KTOLoss: completions {empty} of the batch have no trained token (zero-length "
            "completions): a completion's log-ratio would be 0 whatever the policy does"
        )


# -- reward models ----------------------------------------------------------------------------


@component
class BradleyTerryLoss(nn.Module):
    """Bradley-Terry loss of a reward model: ``-logσ(s_c - s_r - margin)`` per pair.

    Unlike the DPO-family losses this one takes the reward model's scalar scores, not
    log-probabilities: ``forward(chosen_scores [P], rejected_scores [P]) -> [P]``. ``margin``
    (default from the constructor) may also be a per-pair tensor ``[P]``, as in Llama 2's
    reward model with graded preference strengths.

    Example::

        >>> loss = BradleyTerryLoss()
        >>> loss(torch.tensor([2.0]), torch.tensor([2.0]))  # log 2
        tensor([0.6931])
    """

    needs_reference: bool = False

    def __init__(self, margin: float = 0.0) -> None:
        super().__init__()
        self.margin = margin

    def extra_repr(self) -> str:
        return f"margin={self.margin}"

    def forward(
        self,
        chosen_scores: torch.Tensor,
        rejected_scores: torch.Tensor,
        margin: torch.Tensor | float | None = None,
    ) -> torch.Tensor:
        if chosen_scores.dim() != 1 or chosen_scores.shape != rejected_scores.shape:
            raise ValueError(
                f"chosen_scores {list(chosen_scores.shape)} and rejected_scores "
                f"{list(rejected_scores.shape)} must both be [P] (one score per pair)"
            )
        chosen, rejected = _as_float(chosen_scores, rejected_scores)
        margin = self.margin if margin is None else margin
        return -F.logsigmoid(chosen - rejected - margin)
