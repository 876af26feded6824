"""RL objectives on per-token log-probabilities: PPO-clip / GSPO policy losses, KL penalties
against a reference, the clipped value loss, and the aggregation that turns per-token losses
into the sums the Trainer divides.

Every tensor is ``[b, T]`` over completion positions (``mask`` is ``True`` on the tokens that
are trained: the completion up to and including its stop token; prompt and padding are
``False``). Like the other losses here these return *sums*; :func:`units` says what the
Trainer divides them by, which the aggregation mode decides:

================================  =========================================  ===================
``aggregation``                    summed here                                ``units``
================================  =========================================  ===================
``"token_mean"`` (DAPO)            every trained token's loss                 trained tokens
``"seq_mean_token_sum"``           every trained token's loss                 sequences
``"seq_mean_token_mean"`` (GRPO)   each sequence's mean token loss            sequences
``"constant"`` (Dr. GRPO)          every trained token's loss                 sequences x
                                                                              ``max_tokens``
================================  =========================================  ===================

"Sequences" are the rows with at least one trained token (a row of pure padding counts for
nothing). Metrics come back as sums over the same unit, so the Trainer logs them as means:
token means for ``"token_mean"``, otherwise the mean over sequences of each sequence's token
mean.

Example::

    >>> lp = torch.tensor([[-1.0, -2.0, 0.0]], requires_grad=True)
    >>> mask = torch.tensor([[True, True, False]])
    >>> out = PolicyLoss()(lp, lp.detach(), torch.tensor([0.5]), mask)
    >>> out.loss, units(mask, "token_mean")  # -(1 * 0.5) on two tokens
    (tensor(-1., grad_fn=<SumBackward0>), 2)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

import torch
from torch import nn

from tunesmith.config.registry import component

__all__ = [
    "AGGREGATIONS",
    "KL_KINDS",
    "KLPenalty",
    "PolicyLoss",
    "PolicyLossOutput",
    "ValueLoss",
    "ValueLossOutput",
    "aggregate",
    "kl_penalty",
    "units",
    "value_loss",
]

Aggregation = Literal["token_mean", "seq_mean_token_sum", "seq_mean_token_mean", "constant"]
KLKind = Literal["k1", "k2", "k3"]
Ratio = Literal["token", "sequence"]
AGGREGATIONS: tuple[str, ...] = get_args(Aggregation)
KL_KINDS: tuple[str, ...] = get_args(KLKind)


# -- aggregation -------------------------------------------------------------------------------


def _check_aggregation(mode: str, max_tokens: int | None) -> None:
    if mode not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {mode!r}")
    if mode == "constant" and (
        isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1
    ):
        raise ValueError(
            "aggregation='constant' (Dr. GRPO) needs max_tokens, the generation's max new "
            f"tokens (an int >= 1), got max_tokens={max_tokens!r}"
        )


def _check_mask(mask: torch.Tensor, like: torch.Tensor, name: str) -> torch.Tensor:
    """``mask`` as bool, with a clear error when it is not shaped like ``like``."""
    if mask.dim() != 2 or mask.shape != like.shape:
        raise ValueError(
            f"mask {list(mask.shape)} and {name} {list(like.shape)} must both be [b, T]"
        )
    return mask.bool()


def aggregate(
    per_token: torch.Tensor, mask: torch.Tensor, mode: str, max_tokens: int | None = None
) -> torch.Tensor:
    """The scalar *sum* of ``per_token`` ``[b, T]`` over the trained positions of ``mask``
    that aggregation ``mode`` divides by :func:`units` (see the module's table): the plain sum
    of the trained tokens' values, except ``"seq_mean_token_mean"``, which sums each row's
    mean. Untrained positions are dropped (``torch.where``), so padding values that are not
    finite do not leak into the sum or its gradient.

    Example::

        >>> x = torch.tensor([[1.0, 2.0, 9.0], [3.0, 9.0, 9.0]])
        >>> mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
        >>> aggregate(x, mask, "token_mean"), aggregate(x, mask, "seq_mean_token_mean")
        (tensor(6.), tensor(4.5000))
    """
    _check_aggregation(mode, max_tokens)
    mask = _check_mask(mask, per_token, "per_token")
    kept = torch.where(mask, per_token, torch.zeros((), dtype=per_token.dtype))
    if mode != "seq_mean_token_mean":
        return kept.sum()
    lengths = mask.sum(-1).clamp(min=1).to(kept.dtype)
    return (kept.sum(-1) / lengths).sum()


def units(mask: torch.Tensor, mode: str, max_tokens: int | None = None) -> int:
    """What the Trainer divides :func:`aggregate`'s sum by, for this micro-batch: trained
    tokens (``"token_mean"``), sequences with at least one trained token (the ``seq_*``
    modes), or those sequences times ``max_tokens`` (``"constant"``; a row with more trained
    tokens than ``max_tokens`` is refused, since the constant would no longer bound it).

    Example::

        >>> mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])
        >>> units(mask, "token_mean"), units(mask, "seq_mean_token_mean")
        (3, 2)
        >>> units(mask, "constant", max_tokens=4)
        8
    """
    _check_aggregation(mode, max_tokens)
    if mask.dim() != 2:
        raise ValueError(f"mask must be [b, T], got {list(mask.shape)}")
    mask = mask.bool()
    if mode == "token_mean":
        return int(mask.sum())
    lengths = mask.sum(-1)
    sequences = int((lengths > 0).sum())
    if mode != "constant":
        return sequences
    assert max_tokens is not None  # checked above
    longest = int(lengths.max()) if lengths.numel() else 0
    if longest > max_tokens:
        row = int(lengths.argmax())
        raise ValueError(
            f"aggregation='constant': row {row} has {longest} trained tokens, more than "
            f"max_tokens={max_tokens} (set max_tokens to the generation's max new tokens)"
        )
    return sequences * max_tokens


def _metric_sum(
    per_token: torch.Tensor, mask: torch.Tensor, mode: str, max_tokens: int | None
) -> torch.Tensor:
    """A metric's sum over the unit of ``mode``, detached: divided by :func:`units` it is the
    token mean (``"token_mean"``) or the mean over sequences of each sequence's token mean
    (every other mode; ``"constant"``'s per-sequence means are scaled by ``max_tokens``)."""
    per_token = per_token.detach().float()
    if mode == "token_mean":
        return aggregate(per_token, mask, mode)
    seq_means = aggregate(per_token, mask, "seq_mean_token_mean")
    return seq_means * max_tokens if mode == "constant" else seq_means


def _as_float(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``tensors`` in float32, or float64 when any is float64."""
    dtype = torch.float32
    for t in tensors:
        dtype = torch.promote_types(dtype, t.dtype) if t.is_floating_point() else dtype
    return tuple(t.to(dtype) for t in tensors)


# -- policy loss -------------------------------------------------------------------------------


@dataclass
class PolicyLossOutput:
    """What :class:`PolicyLoss` returns.

    Attributes:
        loss: the loss summed as the aggregation says (divide by :func:`units`).
        metrics: detached sums over the same unit: ``clip_fraction`` (positions where the
            clip cut the gradient), ``clip_low_fraction`` / ``clip_high_fraction`` (its two
            sides: ``A < 0`` below ``1 - clip_low``, ``A > 0`` above ``1 + clip_high``),
            ``dual_clip_fraction`` (with ``dual_clip``), ``ratio`` (the importance ratio, the
            sequence ratio for GSPO) and ``approx_kl`` (k3 estimate of ``KL(old || new)``).

    Example::

        >>> out = PolicyLossOutput(torch.tensor(1.0), {"ratio": torch.tensor(2.0)})
        >>> out.metrics["ratio"].item()
        2.0
    """

    loss: torch.Tensor
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)


def _check_clip(name: str, value: float | None, optional: bool = False) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} must be a number > 0, got {value!r}")


@component
class PolicyLoss(nn.Module):
    """PPO's clipped surrogate (Schulman et al. 2017) per token, with DAPO's asymmetric
    "clip-higher" range, optional dual clip, and GSPO's sequence-level ratio.

    Per trained token, with ratio ``r = exp(logprobs - old_logprobs)`` and advantage ``A``
    (one per sequence ``[b]``, broadcast over its tokens, or one per token ``[b, T]``)::

        loss_t = -min(r·A, clip(r, 1 - clip_low, 1 + clip_high)·A)

    ``clip_high`` defaults to ``clip_low`` (DAPO uses e.g. ``0.2`` / ``0.28``). With
    ``dual_clip = c > 1`` (Ye et al. 2020) a negative-advantage token's loss is also capped at
    ``-c·A``, so a huge ratio on a bad token cannot blow up the update. ``weights`` ``[b, T]``
    (e.g. truncated importance-sampling weights between the generator's and the trainer's
    log-probs) multiply each token's loss and are detached.

    ``ratio="sequence"`` is GSPO (Zheng et al. 2025): one ratio per sequence, the geometric
    mean of its token ratios ``s_i = exp(mean_t(logprobs - old_logprobs))``, clipped with the
    same ``clip_low``/``clip_high`` (GSPO's ranges are far smaller, e.g. ``3e-4``/``4e-4``).
    It is used in the token form ``s_i,t = sg(s_i)·exp(lp_t - sg(lp_t))``, whose value is
    ``s_i`` and whose gradient is ``s_i·∇lp_t``; paired with
    ``aggregation="seq_mean_token_mean"`` this is exactly GSPO's objective and gradient
    (``-mean_i min(s_i·A_i, clip(s_i)·A_i)``, and GSPO-token's for per-token advantages).
    Other aggregations weight sequences by their length instead.

    The loss is the *sum* that ``aggregation`` says (see :func:`aggregate`; ``max_tokens``
    for ``"constant"``); divide by :func:`units` (:meth:`units` here). Arithmetic is float32 at
    least. Log-ratios are not clamped: a non-finite loss is left to the Trainer's
    ``on_nonfinite_loss``.

    Example::

        >>> loss = PolicyLoss(clip_low=0.2, clip_high=0.28)
        >>> lp = torch.tensor([[-1.0, -1.0]], requires_grad=True)
        >>> old = torch.tensor([[-1.5, -1.0]])  # first token: r = e^0.5 > 1.28
        >>> out = loss(lp, old, torch.tensor([1.0]), torch.ones(1, 2, dtype=torch.bool))
        >>> round(out.loss.item(), 2), out.metrics["clip_fraction"].item()  # -(1.28 + 1)
        (-2.28, 1.0)
    """

    def __init__(
        self,
        clip_low: float = 0.2,
        clip_high: float | None = None,
        ratio: Ratio = "token",
        aggregation: Aggregation = "token_mean",
        max_tokens: int | None = None,
        dual_clip: float | None = None,
    ) -> None:
        super().__init__()
        _check_clip("clip_low", clip_low)
        _check_clip("clip_high", clip_high, optional=True)
        if ratio not in get_args(Ratio):
            raise ValueError(f"ratio must be 'token' or 'sequence' (GSPO), got {ratio!r}")
        if dual_clip is not None and (
            isinstance(dual_clip, bool) or not isinstance(dual_clip, (int, float)) or dual_clip <= 1
        ):
            raise ValueError(f"dual_clip must be a number > 1 or None, got {dual_clip!r}")
        _check_aggregation(aggregation, max_tokens)
        self.clip_low = float(clip_low)
        self.clip_high = float(clip_low if clip_high is None else clip_high)
        self.ratio = ratio
        self.aggregation = aggregation
        self.max_tokens = max_tokens
        self.dual_clip = dual_clip

    def extra_repr(self) -> str:
        return (
            f"clip_low={self.clip_low}, clip_high={self.clip_high}, ratio={self.ratio!r}, "
            f"aggregation={self.aggregation!r}, max_tokens={self.max_tokens}, "
            f"dual_clip={self.dual_clip}"
        )

    def units(self, mask: torch.Tensor) -> int:
        """:func:`units` of ``mask`` under this loss's aggregation."""
        return units(mask, self.aggregation, self.max_tokens)

    def forward(
        self,
        logprobs: torch.Tensor,
        old_logprobs: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        *,
        weights: torch.Tensor | None = None,
    ) -> PolicyLossOutput:
        if old_logprobs.shape != logprobs.shape:
            raise ValueError(
                f"old_logprobs {list(old_logprobs.shape)} and logprobs "
                f"{list(logprobs.shape)} must have the same shape [b, T]"
            )
        mask = _check_mask(mask, logprobs, "logprobs")
        if advantages.shape not in (logprobs.shape[:1], logprobs.shape):
            raise ValueError(
                f"advantages must be [b] or [b, T] = {list(logprobs.shape)}, got "
                f"{list(advantages.shape)}"
            )
        if weights is not None and weights.shape != logprobs.shape:
            raise ValueError(
                f"weights {list(weights.shape)} must be shaped like logprobs {list(logprobs.shape)}"
            )
        lp, old, adv = _as_float(logprobs, old_logprobs.detach(), advantages.detach())
        if adv.dim() == 1:
            adv = adv[:, None].expand_as(lp)
        zero = torch.zeros((), dtype=lp.dtype, device=lp.device)
        adv = torch.where(mask, adv, zero)
        # padding may hold anything: keep it out of exp() so no inf/NaN reaches the gradient
        log_ratio = torch.where(mask, lp - old, zero)
        if self.ratio == "token":
            ratio = log_ratio.exp()
        else:  # GSPO: sg(s_i) * exp(lp_t - sg(lp_t)), value s_i, gradient s_i * grad lp_t
            lengths = mask.sum(-1, keepdim=True).clamp(min=1)
            seq_log_ratio = log_ratio.sum(-1, keepdim=True) / lengths
            ratio = seq_log_ratio.detach().exp() * (log_ratio - log_ratio.detach()).exp()
        clipped = ratio.clamp(1 - self.clip_low, 1 + self.clip_high)
        per_token = -torch.minimum(ratio * adv, clipped * adv)
        r = ratio.detach()
        low = (adv < 0) & (r < 1 - self.clip_low)
        high = (adv > 0) & (r > 1 + self.clip_high)
        metrics: dict[str, torch.Tensor] = {}
        if self.dual_clip is not None:
            cap = -self.dual_clip * adv
            dual = (adv < 0) & (per_token.detach() > cap)
            per_token = torch.where(adv < 0, torch.minimum(per_token, cap), per_token)
            metrics["dual_clip_fraction"] = dual
        if weights is not None:
            per_token = per_token * torch.where(mask, weights.detach().to(lp.dtype), zero)
        loss = aggregate(per_token, mask, self.aggregation, self.max_tokens)
        metrics |= {
            "clip_fraction": low | high,
            "clip_low_fraction": low,
            "clip_high_fraction": high,
            "ratio": r,
            "approx_kl": kl_penalty(old, lp.detach(), "k3"),  # KL(old || new), samples of old
        }
        sums = {
            name: _metric_sum(value, mask, self.aggregation, self.max_tokens)
            for name, value in metrics.items()
        }
        return PolicyLossOutput(loss, sums)


# -- KL penalty --------------------------------------------------------------------------------


def kl_penalty(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: KLKind = "k3"
) -> torch.Tensor:
    """Per-token estimate of ``KL(π || ref)`` from the sampled tokens' log-probabilities
    (Schulman's estimators, http://joschu.net/blog/kl-approx.html), same shape as the inputs,
    float32 at least, unmasked (aggregate it with the mask). With ``d = ref - logprobs``:

    - ``"k1"``: ``-d = logprobs - ref`` (unbiased, high variance, can be negative);
    - ``"k2"``: ``d² / 2`` (biased, low variance, >= 0);
    - ``"k3"``: ``exp(d) - d - 1`` (unbiased for tokens sampled from ``π``, low variance,
      >= 0, and 0 exactly where the two agree) — GRPO's KL term.

    Example::

        >>> lp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.0, -1.0])
        >>> kl_penalty(lp, ref, "k1"), kl_penalty(lp, ref, "k2")
        (tensor([ 0., -1.]), tensor([0.0000, 0.5000]))
        >>> kl_penalty(lp, lp, "k3")
        tensor([0., 0.])
    """
    if kind not in KL_KINDS:
        raise ValueError(f"kind must be one of {KL_KINDS}, got {kind!r}")
    if ref_logprobs.shape != logprobs.shape:
        raise ValueError(
            f"ref_logprobs {list(ref_logprobs.shape)} and logprobs {list(logprobs.shape)} "
            "must have the same shape"
        )
    lp, ref = _as_float(logprobs, ref_logprobs)
    if kind == "k1":
        return lp - ref
    diff = ref - lp
    if kind == "k2":
        return 0.5 * diff.square()
    return torch.expm1(diff) - diff


@component
class KLPenalty(nn.Module):
    """``coef ·`` the aggregated :func:`kl_penalty` of the policy against a frozen reference:
    a loss term summed with the same ``aggregation`` (and ``max_tokens``) as the policy loss,
    so the two add up before the Trainer divides by the same :func:`units`. The reference
    log-probs get no gradient.

    Example::

        >>> kl = KLPenalty(coef=0.1, kind="k2")
        >>> lp, ref = torch.tensor([[-1.0, -3.0]]), torch.tensor([[-1.0, -1.0]])
        >>> kl(lp, ref, torch.ones(1, 2))  # 0.1 * (0 + 0.5 * 2²)
        tensor(0.2000)
    """

    def __init__(
        self,
        coef: float,
        kind: KLKind = "k3",
        aggregation: Aggregation = "token_mean",
        max_tokens: int | None = None,
    ) -> None:
        super().__init__()
        if isinstance(coef, bool) or not isinstance(coef, (int, float)) or coef < 0:
            raise ValueError(f"coef must be a number >= 0, got {coef!r}")
        if kind not in KL_KINDS:
            raise ValueError(f"kind must be one of {KL_KINDS}, got {kind!r}")
        _check_aggregation(aggregation, max_tokens)
        self.coef, self.kind = float(coef), kind
        self.aggregation, self.max_tokens = aggregation, max_tokens

    def extra_repr(self) -> str:
        return (
            f"coef={self.coef}, kind={self.kind!r}, aggregation={self.aggregation!r}, "
            f"max_tokens={self.max_tokens}"
        )

    def forward(
        self, logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        per_token = kl_penalty(logprobs, ref_logprobs.detach(), self.kind)
        return self.coef * aggregate(per_token, mask, self.aggregation, self.max_tokens)


# -- value loss --------------------------------------------------------------------------------


@dataclass
class ValueLossOutput:
    """What :func:`value_loss` returns.

    Attributes:
        loss: the value loss summed as the aggregation says (divide by :func:`units`).
        metrics: ``value_clip_fraction``, a detached sum over the same unit of the positions
            where the clipped error was the larger one (its gradient cut).

    Example::

        >>> ValueLossOutput(torch.tensor(0.5)).metrics
        {}
    """

    loss: torch.Tensor
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip: float | None = 0.2,
    aggregation: Aggregation = "token_mean",
    max_tokens: int | None = None,
) -> ValueLossOutput:
    """PPO's clipped value loss per token,
    ``0.5 · max((v - R)², (clip(v, v_old - c, v_old + c) - R)²)`` (``0.5 · (v - R)²`` with
    ``clip=None``), summed as ``aggregation`` says. ``old_values`` (the critic's values at
    rollout time) and ``returns`` are detached. Float32 at least.

    Example::

        >>> v, old = torch.tensor([[1.0, 0.0]]), torch.tensor([[0.5, 0.0]])
        >>> out = value_loss(v, old, torch.tensor([[2.0, 1.0]]), torch.ones(1, 2), clip=0.2)
        >>> out.loss  # 0.5 * max(1, 1.3²) + 0.5 * 1
        tensor(1.3450)
    """
    if clip is not None:
        _check_clip("clip", clip)
    _check_aggregation(aggregation, max_tokens)
    if old_values.shape != values.shape or returns.shape != values.shape:
        raise ValueError(
            f"values {list(values.shape)}, old_values {list(old_values.shape)} and returns "
            f"{list(returns.shape)} must have the same shape [b, T]"
        )
    mask = _check_mask(mask, values, "values")
    v, old, ret = _as_float(values, old_values.detach(), returns.detach())
    error = (v - ret).square()
    if clip is None:
        per_token, clipped_more = 0.5 * error, torch.zeros_like(mask)
    else:
        clipped_v = old + (v - old).clamp(-clip, clip)
        clipped_error = (clipped_v - ret).square()
        per_token = 0.5 * torch.maximum(error, clipped_error)
        clipped_more = clipped_error.detach() > error.detach()
    loss = aggregate(per_token, mask, aggregation, max_tokens)
    fraction = _metric_sum(clipped_more, mask, aggregation, max_tokens)
    return ValueLossOutput(loss, {"value_clip_fraction": fraction})


@component
class ValueLoss(nn.Module):
    """:func:`value_loss` with its ``clip`` and aggregation fixed, for a config's
    ``_component_``.

    Example::

        >>> loss = ValueLoss(clip=None)
        >>> loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2)).loss
        tensor(1.)
    """

    def __init__(
        self,
        clip: float | None = 0.2,
        aggregation: Aggregation = "token_mean",
        max_tokens: int | None = None,
    ) -> None:
        super().__init__()
        if clip is not None:
            _check_clip("clip", clip)
        _check_aggregation(aggregation, max_tokens)
        self.clip, self.aggregation, self.max_tokens = clip, aggregation, max_tokens

    def extra_repr(self) -> str:
        return f"clip={self.clip}, aggregation={self.aggregation!r}, max_tokens={self.max_tokens}"

    def units(self, mask: torch.Tensor) -> int:
        """:func:`units` of ``mask`` under this loss's aggregation."""
        return units(mask, self.aggregation, self.max_tokens)

    def forward(
        self,
        values: torch.Tensor,
        old_values: torch.Tensor,
        returns: torch.Tensor,
        mask: torch.Tensor,
    ) -> ValueLossOutput:
        return value_loss(
            values, old_values, returns, mask, self.clip, self.aggregation, self.max_tokens
        )
