"""Every training objective of tunesmith, one file per kind, all re-exported here.

- :mod:`~tunesmith.modules.losses.token`: next-token losses on shifted labels —
  :class:`CrossEntropyLoss`, :class:`LinearCrossEntropyLoss` (chunked, no full logits),
  :func:`token_logprobs` (per-token log-probabilities, chunked) and :data:`IGNORE_INDEX`
  (the label of positions that are not trained; its one definition).
- :mod:`~tunesmith.modules.losses.preference`: pairwise preference losses on summed response
  log-probabilities (:class:`PairLogps`): the DPO family (:class:`DPOLoss` (cDPO),
  :class:`IPOLoss`, :class:`HingeLoss`, :class:`SimPOLoss`, :class:`ORPOLoss`,
  :class:`CPOLoss`), the reward model's :class:`BradleyTerryLoss`, and KTO's
  :class:`KTOLoss` on unpaired rated completions (:class:`UnpairedLogps`).
- :mod:`~tunesmith.modules.losses.kd`: knowledge distillation (:class:`KDLoss`,
  :func:`divergence`, :data:`KD_KINDS`).
- :mod:`~tunesmith.modules.losses.rl`: RL objectives on per-token log-probs
  (:class:`PolicyLoss`: PPO-clip, DAPO clip-higher, dual clip, GSPO; :class:`KLPenalty` /
  :func:`kl_penalty`; :func:`value_loss`) and their :func:`aggregate` / :func:`units`;
  rollouts, rewards and advantages themselves belong to ``tunesmith.rl``.

Conventions every loss here keeps: it is a plain ``nn.Module`` (or function) on tensors that
knows nothing of models or training; it returns *sums* (or one value per sequence/pair), and
the recipe divides by the global count of trained tokens or pairs, so gradient accumulation
and data parallelism give the same update as one big batch; arithmetic is float32 at least.

Configs name a loss by its path here, e.g. ``_component_: tunesmith.modules.losses.DPOLoss``.
The paths of the modules these files were before (``tunesmith.modules.preference_losses.*``,
``tunesmith.modules.kd_losses.*``) still resolve to the same classes, so configs written
before (and the config stored in each checkpoint) keep building.

Example::

    >>> from tunesmith.modules.losses import CrossEntropyLoss, DPOLoss, KDLoss, IGNORE_INDEX
    >>> IGNORE_INDEX
    -100
"""

from tunesmith.modules.losses.kd import KD_KINDS, KDLoss, divergence
from tunesmith.modules.losses.preference import (
    CPO_LOSS_TYPES,
    BradleyTerryLoss,
    CPOLoss,
    DPOLoss,
    HingeLoss,
    IPOLoss,
    KTOLoss,
    KTOLossOutput,
    ORPOLoss,
    PairLogps,
    PreferenceLossOutput,
    SimPOLoss,
    UnpairedLogps,
)
from tunesmith.modules.losses.rl import (
    AGGREGATIONS,
    KL_KINDS,
    KLPenalty,
    PolicyLoss,
    PolicyLossOutput,
    ValueLoss,
    ValueLossOutput,
    aggregate,
    kl_penalty,
    units,
    value_loss,
)
from tunesmith.modules.losses.token import (
    IGNORE_INDEX,
    CrossEntropyLoss,
    LinearCrossEntropyLoss,
    token_entropy,
    token_logprobs,
)

__all__ = [
    "AGGREGATIONS",
    "CPO_LOSS_TYPES",
    "IGNORE_INDEX",
    "KD_KINDS",
    "KL_KINDS",
    "BradleyTerryLoss",
    "CPOLoss",
    "CrossEntropyLoss",
    "DPOLoss",
    "HingeLoss",
    "IPOLoss",
    "KDLoss",
    "KLPenalty",
    "KTOLoss",
    "KTOLossOutput",
    "LinearCrossEntropyLoss",
    "ORPOLoss",
    "PairLogps",
    "PolicyLoss",
    "PolicyLossOutput",
    "PreferenceLossOutput",
    "SimPOLoss",
    "UnpairedLogps",
    "ValueLoss",
    "ValueLossOutput",
    "aggregate",
    "divergence",
    "kl_penalty",
    "token_entropy",
    "token_logprobs",
    "units",
    "value_loss",
]
