"""DeepSeek-V3's bias-based load balancing as a trainer hook: the config's
``moe_bias_balancing: {update_rate: 0.001}`` (off when absent or null) moves, after each
optimizer step, every expert's ``e_score_correction_bias`` by ``update_rate`` towards balance,
outside the gradient (:func:`~tunesmith.modules.routers.update_correction_bias`). The loads are
the step's that the trainer read for its router statistics (``trainer.expert_loads``: real
tokens only, summed over the data-parallel and context-parallel ranks, see
:mod:`tunesmith.training.router_stats`), so every rank, ``tp`` ranks included, makes the same
update. The bias is a buffer of the model: checkpoints save it (``config.json``-compatible,
transformers reads it) and a resume continues from it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

from tunesmith.config.errors import ConfigError, ConfigIssue
from tunesmith.modules.routers import balanced_layers, update_correction_bias

__all__ = ["BiasBalancing"]


@dataclass(frozen=True)
class BiasBalancing:
    """The ``moe_bias_balancing`` section of a config, read once (:meth:`from_config`).

    ``update_rate``: the bias step per optimizer step (the V3 paper's gamma, 0.001).

    >>> BiasBalancing.from_config({"moe_bias_balancing": {"update_rate": 0.01}}).update_rate
    0.01
    >>> BiasBalancing.from_config({}) is None
    True
    """

    update_rate: float = 0.001

    def __post_init__(self) -> None:
        rate = self.update_rate
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not rate > 0:
            raise ConfigError.from_issues(
                [
                    ConfigIssue(
                        "moe_bias_balancing.update_rate", f"must be a number > 0, got {rate!r}"
                    )
                ]
            )

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> BiasBalancing | None:
        section = cfg.get("moe_bias_balancing")
        if section is None:
            return None
        section = dict(section)
        unknown = sorted(set(section) - set(cls.__dataclass_fields__))
        if unknown:
            raise ConfigError.from_issues(
                [ConfigIssue(f"moe_bias_balancing.{k}", "is not a known key (update_rate)")
                 for k in unknown]
            )  # fmt: skip
        return cls(**section)

    def step_hook(self, model: nn.Module) -> Any:
        """A trainer hook (``on_step_end``) that updates ``model``'s correction biases from
        the step's ``trainer.expert_loads``; the model must have DeepSeek MoE layers with one
        (refused by name otherwise)."""
        if next(balanced_layers(model), None) is None:
            raise ConfigError.from_issues(
                [ConfigIssue("moe_bias_balancing", "needs a model with DeepSeek-V3 MoE layers "
                             "(an e_score_correction_bias); this model has none")]
            )  # fmt: skip

        def hook(trainer: Any, step: int, metrics: Mapping[str, float]) -> None:
            update_correction_bias(trainer.expert_loads, self.update_rate)

        return hook
