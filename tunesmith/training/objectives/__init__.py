"""The objectives of the dataset recipes, beside the losses they sum: what one micro-batch's
loss is, as a :class:`~tunesmith.training.trainer.Objective` (a *sum* over its ``unit``; the
:class:`~tunesmith.training.trainer.Trainer` divides by the step's count).

* :mod:`~tunesmith.training.objectives.token`: SFT's token cross-entropy;
* :mod:`~tunesmith.training.objectives.preference`: DPO and its family, with the reference's
  log-probabilities (on the fly or precomputed);
* :mod:`~tunesmith.training.objectives.unpaired`: KTO on rated completions, with the step's KL
  estimate;
* :mod:`~tunesmith.training.objectives.distillation`: knowledge distillation;
* :mod:`~tunesmith.training.objectives.ranking`: the reward model's pairwise ranking.

The RL objectives live with the rest of RL (:mod:`tunesmith.rl.objective`).

Example::

    >>> import torch
    >>> from tunesmith.modules.losses import CrossEntropyLoss
    >>> objective = TokenCrossEntropy(CrossEntropyLoss())
    >>> objective.units({"labels": torch.tensor([[-100, 5, 6, -100]])})
    2
"""

from tunesmith.training.objectives.distillation import Distillation, shared_vocab
from tunesmith.training.objectives.preference import PreferenceObjective, pair_logps
from tunesmith.training.objectives.ranking import PairwiseRanking
from tunesmith.training.objectives.token import TokenCrossEntropy, token_loss
from tunesmith.training.objectives.unpaired import KTOObjective

__all__ = [
    "Distillation",
    "KTOObjective",
    "PairwiseRanking",
    "PreferenceObjective",
    "TokenCrossEntropy",
    "pair_logps",
    "shared_vocab",
    "token_loss",
]
