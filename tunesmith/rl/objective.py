"""The policy-gradient objective the Trainer optimises on rollout batches (GRPO and its
variants; PPO's policy side).

Per micro-batch of rollout rows (:func:`~tunesmith.rl.rollout.rollout_batch` plus
``advantages``, ``old_logprobs``, ``sampling_logprobs`` and, with a KL term, ``ref_logprobs``):
the policy's log-probs of the completion tokens at the sampling temperature, with gradient;
the clipped surrogate (:class:`~tunesmith.modules.losses.rl.PolicyLoss`) against the
``old_logprobs``; plus ``kl`` (:class:`~tunesmith.modules.losses.rl.KLPenalty`, same
aggregation) to the reference. With ``importance_cap`` each token's loss is weighted by the
truncated importance ratio ``min(exp(old - sampling), cap)`` between the trainer's and the
sampler's log-probs (for a generator that is not the trained policy bit for bit).

Example::

    >>> objective = PolicyGradient(PolicyLoss(clip_low=0.2, clip_high=0.28),
    ...                            kl=KLPenalty(0.01, "k3"), temperature=1.0)
    >>> objective.unit  # what its per-step metrics are means over
    'completion_tokens'

The Trainer then optimises it on the rollout source's batches::

    trainer = Trainer(cfg, ctx, model=model, objective=objective, source=source)
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from tunesmith.modules.losses import token_entropy, token_logprobs
from tunesmith.modules.losses.rl import KLPenalty, PolicyLoss, aggregate
from tunesmith.rl.rollout import completion_mask, tempered_hidden, tempered_transform
from tunesmith.training.forward import head_weight, router_aux_loss
from tunesmith.training.trainer import LossOutput

__all__ = ["PolicyGradient"]

_UNIT_NAMES = {"token_mean": "completion_tokens", "constant": "loss_normaliser"}


class PolicyGradient:
    """Summed clipped policy loss (+ KL) of a micro-batch of rollouts; see the module docs.

    Logged per step (means over the loss's unit): ``clip_fraction`` (and its low/high sides),
    ``ratio``, ``approx_kl`` (old vs new), ``kl`` (to the reference, without its coefficient)
    and ``entropy`` (of the policy at the sampled positions) when ``log_entropy``.
    """

    def __init__(
        self,
        loss: PolicyLoss,
        *,
        kl: KLPenalty | None = None,
        temperature: float = 1.0,
        importance_cap: float | None = None,
        chunk_size: int = 1024,
        log_entropy: bool = True,
    ) -> None:
        if kl is not None and (kl.aggregation, kl.max_tokens) != (
            loss.aggregation,
            loss.max_tokens,
        ):
            raise ValueError(
                f"the KL term is aggregated as {kl.aggregation!r} but the policy loss as "
                f"{loss.aggregation!r}: both must be the same (the Trainer divides their sum once)"
            )
        if importance_cap is not None and not importance_cap >= 1:
            raise ValueError(f"importance_cap must be >= 1 or null, got {importance_cap!r}")
        self.loss, self.kl, self.temperature = loss, kl, float(temperature)
        self.importance_cap, self.chunk_size = importance_cap, int(chunk_size)
        self.log_entropy = bool(log_entropy)
        self.unit = _UNIT_NAMES.get(loss.aggregation, "sequences")

    def units(self, batch: Mapping[str, torch.Tensor]) -> int:
        return self.loss.units(completion_mask(batch))

    def __call__(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> LossOutput:
        mask = completion_mask(batch)
        hidden, router_logits = tempered_hidden(model, batch, self.temperature)
        weight, transform = head_weight(model), tempered_transform(model, self.temperature)
        logprobs = token_logprobs(
            hidden, weight, batch["labels"], chunk_size=self.chunk_size, transform=transform
        )
        weights = None
        if self.importance_cap is not None:
            log_ratio = (batch["old_logprobs"] - batch["sampling_logprobs"]).clamp(max=30.0)
            weights = log_ratio.exp().clamp(max=self.importance_cap)
        out = self.loss(logprobs, batch["old_logprobs"], batch["advantages"], mask, weights=weights)
        loss, metrics = out.loss, dict(out.metrics)
        if self.kl is not None and self.kl.coef > 0:
            kl = self.kl(logprobs, batch["ref_logprobs"], mask)
            loss = loss + kl
            metrics["kl"] = kl.detach() / self.kl.coef
        if self.log_entropy:  # of the tempered policy at the sampled positions; no gradient
            entropy = token_entropy(
                hidden.detach(),
                weight.detach(),
                mask,
                chunk_size=self.chunk_size,
                transform=transform,
            )
            metrics["entropy"] = aggregate(
                entropy, mask, self.loss.aggregation, self.loss.max_tokens
            )
        return LossOutput(loss, metrics, aux_loss=router_aux_loss(model, router_logits, batch))
