"""Router statistics of mixture-of-experts models, summarised per optimizer step.

Every :class:`~tunesmith.modules.moe.MoE` layer counts, in train mode, the tokens each expert
got as routed (the routing decision itself, whichever router made it: softmax top-k, sigmoid
with a bias, top-k then softmax) and the assignments that reached no expert. The trainer
resets the counts before a step and summarises them after it, summed over the data-parallel
ranks, into four numbers however many layers the model has:

- ``moe_load_max``: the busiest expert's share of its layer's tokens over an even split's
  (1.0 = perfectly balanced, ``num_experts`` = one expert took everything), worst layer;
- ``moe_load_min``: the idlest expert's share over an even split (0.0 = an expert got no
  token), worst layer;
- ``moe_load_cv``: the coefficient of variation (std / mean) of the tokens per expert,
  averaged over layers (0.0 = balanced);
- ``moe_dropped_tokens``: assignments that reached no expert, all layers (token-choice
  routing without a capacity limit drops none: 0).

The shares do not change when the same forward is counted twice (activation checkpointing
recomputes it) or on every rank of a tensor-parallel group.

Example::

    >>> from tunesmith.modules.moe import MoE
    >>> moe = MoE(8, 4, num_experts=2, top_k=1).train()
    >>> _ = moe(torch.randn(1, 6, 8))
    >>> stats = router_statistics(moe)
    >>> sorted(stats), stats["moe_dropped_tokens"]
    (['moe_dropped_tokens', 'moe_load_cv', 'moe_load_max', 'moe_load_min'], 0.0)
    >>> router_statistics(moe)  # read and reset: nothing since
    {}
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed import ProcessGroup

from tunesmith.modules.moe import MoE
from tunesmith.training.parallel.distributed import all_reduce_sum

__all__ = ["reset_router_statistics", "router_statistics", "summarise_expert_loads"]


def _routers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def reset_router_statistics(model: nn.Module) -> None:
    """Forget what every MoE layer of ``model`` has counted so far."""
    for moe in _routers(model):
        moe.routed_counts = None


def summarise_expert_loads(counts: list[torch.Tensor], dropped: float) -> dict[str, float]:
    """The four statistics of the module docstring from each layer's tokens per expert.

    Example::

        >>> stats = summarise_expert_loads([torch.tensor([3.0, 1.0]), torch.tensor([2.0, 2.0])], 0)
        >>> stats["moe_load_max"], stats["moe_load_min"], stats["moe_load_cv"]
        (1.5, 0.5, 0.25)
    """
    shares = [c.double() / c.double().mean() for c in counts if c.sum() > 0]
    if not shares:
        return {"moe_dropped_tokens": float(dropped)}
    return {
        "moe_load_max": max(float(s.max()) for s in shares),
        "moe_load_min": min(float(s.min()) for s in shares),
        "moe_load_cv": sum(float(s.std(correction=0)) for s in shares) / len(shares),
        "moe_dropped_tokens": float(dropped),
    }


def router_statistics(
    model: nn.Module,
    device: torch.device | None = None,
    group: ProcessGroup | None = None,
) -> dict[str, float]:
    """Summarise (and reset) what the MoE layers of ``model`` counted since the last reset,
    summed over the ranks of ``group`` (one all-reduce when it has several); ``{}`` when no
    layer counted anything (a dense model, or no forward in train mode).

    Every rank of ``group`` must call it at the same point (a collective).
    """
    layers = [m for m in _routers(model) if m.routed_counts is not None]
    if not layers:
        return {}
    per_layer = [m.routed_counts.to(torch.float64) for m in layers]  # [E + 1] each
    reset_router_statistics(model)
    local = torch.cat(per_layer)
    total = all_reduce_sum(local, device or local.device, group).cpu()
    layer_totals = total.split([len(c) for c in per_layer])
    dropped = sum(float(t[-1]) for t in layer_totals)
    return summarise_expert_loads([t[:-1] for t in layer_totals], dropped)
