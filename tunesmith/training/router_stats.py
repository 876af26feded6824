"""The expert load of mixture-of-experts models, counted once and summarised per optimizer step.

Every :class:`~tunesmith.modules.moe.MoE` layer of a model under :func:`track_routing` counts,
in train mode, the real tokens each expert got as routed (the routing decision itself,
whichever router made it: softmax top-k, sigmoid with a bias, top-k then softmax) and the
assignments that reached no expert. Real tokens leave out rows' padding, packed rows' gaps
(negative ``document_ids``) and the positions tensor parallel pads the sequence with; a
forward that activation checkpointing recomputes in backward is not counted again. The
trainer resets the counts before a step and reads them after it (:func:`read_expert_loads`,
summed over ``ctx.dp_cp_group``, the ranks whose tokens make the global batch: each routes
its own tokens (under expert parallel too, before dispatching them), ``cp`` ranks their
shards of the rows, while ``tp`` ranks route the same tokens and are not added up). The
summed loads serve both the logged statistics (:func:`summarise_expert_loads`) and
DeepSeek-V3's bias balancing (:mod:`tunesmith.training.moe_balancing`). The statistics, four
numbers however many layers the model has:

- ``moe_load_max``: the busiest expert's share of its layer's tokens over an even split's
  (1.0 = perfectly balanced, ``num_experts`` = one expert took everything), worst layer;
- ``moe_load_min``: the idlest expert's share over an even split (0.0 = an expert got no
  token), worst layer;
- ``moe_load_cv``: the coefficient of variation (std / mean) of the tokens per expert,
  averaged over layers (0.0 = balanced);
- ``moe_dropped_tokens``: assignments that reached no expert, all layers (token-choice
  routing without a capacity limit drops none: 0).

Example::

    >>> from tunesmith.models import mixtral
    >>> model = mixtral.mixtral_tiny().train()
    >>> track_routing(model)  # its two MoE layers
    2
    >>> _ = model(torch.zeros(1, 6, dtype=torch.long), attention_mask=torch.tensor([[0] + [1] * 5]))
    >>> loads = read_expert_loads(model)
    >>> [int(load[:-1].sum()) for load in loads.values()]  # 5 real tokens, top-3
    [15, 15]
    >>> sorted(summarise_expert_loads(loads))
    ['moe_dropped_tokens', 'moe_load_cv', 'moe_load_max', 'moe_load_min']
    >>> read_expert_loads(model)  # read and reset: nothing since
    {}
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup

from tunesmith.modules.decoder import DecoderModel
from tunesmith.modules.moe import MoE
from tunesmith.training.parallel.distributed import all_reduce_sum

__all__ = [
    "read_expert_loads", "reset_router_statistics", "summarise_expert_loads", "track_routing",
]  # fmt: skip


def _routers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def track_routing(model: nn.Module) -> int:
    """Make the MoE layers of every decoder body of ``model`` count their real tokens'
    routing (a forward pre-hook of the body marks them, once per body however often it is
    called); returns how many MoE layers count. Register it after tensor parallel's hooks
    (:func:`~tunesmith.training.parallel.tensor_parallel.apply_tensor_parallel`), which pad
    the sequence first; the :class:`~tunesmith.training.trainer.Trainer` calls it.

    Example::

        >>> from tunesmith.models import deepseek_v3
        >>> track_routing(deepseek_v3.deepseek_v3_tiny())  # both of its layers
        2
    """
    layers = 0
    for body in model.modules():
        moes = _routers(body) if isinstance(body, DecoderModel) else []
        if moes and not getattr(body, "_marks_real_tokens", False):
            body.register_forward_pre_hook(partial(_mark_real_tokens, moes), with_kwargs=True)
            body._marks_real_tokens = True
        layers += len(moes)
    return layers


def _mark_real_tokens(
    layers: list[MoE], body: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    """Forward pre-hook of a decoder body: tell its MoE layers which of the forward's
    ``[b * s]`` positions are real tokens (not rows' padding, packed rows' gaps or the
    positions tensor parallel pads the sequence with: ``_tp_cut``), as the body sees them."""
    ids = args[0] if args else kwargs["input_ids"]
    real = torch.ones(ids.shape, dtype=torch.bool, device=ids.device)
    mask, docs = kwargs.get("attention_mask"), kwargs.get("document_ids")
    if mask is not None and mask.dim() == 2:
        real &= mask[:, -ids.shape[1] :].bool()
    if docs is not None and docs.shape == ids.shape:
        real &= docs >= 0
    cut = getattr(body, "_tp_cut", None)
    if cut is not None:
        real[:, cut:] = False
    for moe in layers:
        moe.real_tokens = real.reshape(-1)


def reset_router_statistics(model: nn.Module) -> None:
    """Forget what every MoE layer of ``model`` has counted so far."""
    for moe in _routers(model):
        moe.routed_counts = None


def summarise_expert_loads(loads: Mapping[Any, torch.Tensor]) -> dict[str, float]:
    """The four statistics of the module docstring from each layer's load ``[E + 1]`` (the
    tokens per expert, then the assignments no expert got), as :func:`read_expert_loads`
    gives them; ``{}`` without a layer (one copy to the host otherwise).

    Example::

        >>> stats = summarise_expert_loads({0: torch.tensor([3.0, 1.0, 0]), 1: torch.tensor([2.0, 2.0, 0])})
        >>> stats["moe_load_max"], stats["moe_load_min"], stats["moe_load_cv"]
        (1.5, 0.5, 0.25)
    """
    if not loads:
        return {}
    host = torch.cat(list(loads.values())).double().cpu()
    per_layer = host.split([len(load) for load in loads.values()])
    dropped = sum(float(load[-1]) for load in per_layer)
    shares = [c / c.mean() for c in (load[:-1] for load in per_layer) if c.sum() > 0]
    if not shares:
        return {"moe_dropped_tokens": dropped}
    return {
        "moe_load_max": max(float(s.max()) for s in shares),
        "moe_load_min": min(float(s.min()) for s in shares),
        "moe_load_cv": sum(float(s.std(correction=0)) for s in shares) / len(shares),
        "moe_dropped_tokens": dropped,
    }


def read_expert_loads(
    model: nn.Module,
    device: torch.device | None = None,
    group: ProcessGroup | None = None,
) -> dict[MoE, torch.Tensor]:
    """Read (and reset) what the MoE layers of ``model`` counted since the last reset, summed
    over the ranks of ``group`` (one all-reduce when it has several; the trainer's is
    ``ctx.dp_cp_group``, see the module docstring): ``{layer: [E + 1]}``, the tokens each
    expert got then the assignments no expert got (float64, on ``device``); ``{}`` when no layer
    counted anything (a dense model, or no forward in train mode). No host sync.

    Every rank of ``group`` must call it at the same point (a collective).
    """
    layers = [m for m in _routers(model) if m.routed_counts is not None]
    if not layers:
        return {}
    per_layer = [m.routed_counts for m in layers]
    reset_router_statistics(model)
    local = torch.cat(per_layer)
    total = all_reduce_sum(local, device or local.device, group)
    return dict(zip(layers, total.split([len(c) for c in per_layer]), strict=True))
