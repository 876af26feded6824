"""Context parallel (CP): every row of a batch split over the ``cp`` ranks of a group, attention
by :func:`~tunesmith.modules.ring_attention.ring_attention`.

Three pieces, used by :class:`~tunesmith.training.trainer.Trainer` and
:func:`~tunesmith.training.parallelize.parallelize`:

- :func:`shard_batch` cuts each ``[b, s]`` tensor of a collated batch (``input_ids``,
  ``labels``, ``position_ids``, ``document_ids``, ``attention_mask``, ...) *zigzag*: the row,
  padded to a multiple of ``2 * cp`` (labels ``-100``, document ids ``-1``, mask ``0``: nothing
  padded is trained or attended), is cut into ``2 * cp`` chunks and rank ``r`` keeps chunks
  ``r`` and ``2 * cp - 1 - r``, so every rank has the same causal work. The kept positions'
  indices in the full row travel as ``cp_index``, which the model's forward takes
  (``TransformerLM.forward(cp_index=...)``). Labels are already shifted, so the loss needs
  nothing from the other ranks: token sums, counts and metrics are summed over
  ``ctx.dp_cp_group`` as they always were.
- :func:`install_context_parallel` tells each decoder its ring's process group.
- :func:`cp_sum` adds per-row partial sums (DPO's sequence log-probabilities) over the group,
  its backward also a sum, so a loss computed from the total on every rank trains exactly as
  one process would (each rank's share of the sequence gets the loss's gradient).

A forward without ``cp_index`` (generation, DPO's precomputed reference) attends over the
whole row it is given, redundantly on each rank: correct, only not split. Objectives declare
whether they may be split (:func:`check_objective`): ``context_parallel = "tokens"`` (a sum
over tokens, each rank summing its share: SFT, KD) or ``"rows"`` (a loss of whole-row sums
gathered by :func:`cp_sum`, the same on every cp rank, which therefore all count each unit:
DPO; the Trainer logs the unit count divided by ``cp``); the Trainer refuses the others.

Example::

    local = shard_batch(batch, cp_rank=ctx.cp_rank, cp_size=ctx.cp_size)
    model(local["input_ids"], position_ids=local["position_ids"],
          cp_index=local["cp_index"])
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from tunesmith.config import ConfigError, ConfigIssue
from tunesmith.modules.decoder import DecoderModel
from tunesmith.modules.losses import IGNORE_INDEX

__all__ = [
    "CP_INDEX",
    "check_objective",
    "context_parallel_group",
    "cp_sum",
    "install_context_parallel",
    "shard_batch",
    "zigzag_index",
]

CP_INDEX = "cp_index"
"""The batch key of the kept positions' indices in the full rows."""

_PAD = {"labels": IGNORE_INDEX, "document_ids": -1, "attention_mask": 0}


def zigzag_index(seq_len: int, cp_rank: int, cp_size: int) -> torch.Tensor:
    """The positions rank ``cp_rank`` of ``cp_size`` keeps of a row of ``seq_len`` (a multiple
    of ``2 * cp_size``): chunks ``cp_rank`` and ``2 * cp_size - 1 - cp_rank`` of ``2 * cp_size``.

    >>> zigzag_index(8, 0, 2).tolist(), zigzag_index(8, 1, 2).tolist()
    ([0, 1, 6, 7], [2, 3, 4, 5])
    """
    if seq_len % (2 * cp_size):
        raise ValueError(f"seq_len {seq_len} is not a multiple of 2 * cp = {2 * cp_size}")
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank {cp_rank} is not in [0, {cp_size})")
    chunk = seq_len // (2 * cp_size)
    first, second = cp_rank * chunk, (2 * cp_size - 1 - cp_rank) * chunk
    return torch.cat([torch.arange(first, first + chunk), torch.arange(second, second + chunk)])


def shard_batch(
    batch: Mapping[str, torch.Tensor], *, cp_rank: int, cp_size: int, multiple: int = 1
) -> dict[str, torch.Tensor]:
    """This rank's share of ``batch``: every ``[b, s]`` (or ``[b, s, ...]``) tensor padded to a
    multiple of ``2 * cp_size * multiple`` and cut zigzag (:func:`zigzag_index`), plus
    ``cp_index`` ``[b, s_local]``; other values (``[b]`` reference log-probs) are kept whole.
    Padding: ``labels`` -100, ``document_ids`` -1, ``attention_mask`` 0, ``position_ids``
    counting on, anything else 0. ``multiple`` keeps ``s_local`` divisible by it (the ``tp``
    size under sequence parallel). ``cp_size`` 1 returns the batch as it is.

    >>> batch = {"input_ids": torch.arange(5)[None], "labels": torch.arange(1, 6)[None]}
    >>> local = shard_batch(batch, cp_rank=1, cp_size=2)
    >>> local["input_ids"].tolist(), local["labels"].tolist(), local["cp_index"].tolist()
    ([[2, 3, 4, 0]], [[3, 4, 5, -100]], [[2, 3, 4, 5]])
    """
    if cp_size == 1:
        return dict(batch)
    if "input_ids" not in batch or batch["input_ids"].dim() != 2:
        raise ValueError("context parallel needs the batch's input_ids as [batch, seq]")
    b, s = batch["input_ids"].shape
    step = 2 * cp_size * multiple
    padded = -(-s // step) * step
    keep = zigzag_index(padded, cp_rank, cp_size).to(batch["input_ids"].device)
    out: dict[str, torch.Tensor] = {}
    for key, value in batch.items():
        if not isinstance(value, torch.Tensor) or value.dim() < 2 or value.shape[:2] != (b, s):
            out[key] = value
            continue
        out[key] = _pad(key, value, padded - s).index_select(1, keep)
    out[CP_INDEX] = keep[None].expand(b, -1).contiguous()
    return out


def _pad(key: str, value: torch.Tensor, extra: int) -> torch.Tensor:
    if not extra:
        return value
    shape = (value.shape[0], extra, *value.shape[2:])
    if key == "position_ids":
        tail = value[:, -1:] + torch.arange(1, extra + 1, device=value.device).view(1, -1)
        return torch.cat([value, tail.to(value.dtype)], dim=1)
    fill = torch.full(shape, _PAD.get(key, 0), dtype=value.dtype, device=value.device)
    return torch.cat([value, fill], dim=1)


def install_context_parallel(model: nn.Module, group: ProcessGroup | None) -> nn.Module:
    """Give each :class:`~tunesmith.modules.decoder.DecoderModel` in ``model`` the ring's
    ``group`` (None: the default group): a forward with ``cp_index`` then attends by
    :func:`~tunesmith.modules.ring_attention.ring_attention` over it. Returns ``model``.

    Example::

        install_context_parallel(model, ctx.cp_group)
    """
    for module in model.modules():
        if isinstance(module, DecoderModel):
            module.context_parallel_group = group
    return model


def context_parallel_group(model: nn.Module) -> ProcessGroup | None:
    """The ring's group installed on ``model`` (None: the default group or none installed).

    Example::

        context_parallel_group(model)
    """
    for module in model.modules():
        if isinstance(module, DecoderModel):
            return getattr(module, "context_parallel_group", None)
    return None


class _Sum(torch.autograd.Function):
    """All-reduce sum whose backward is an all-reduce sum of the gradients (its adjoint)."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        out = tensor.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def cp_sum(tensor: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """``tensor`` summed over the ranks of ``group``, differentiably: the gradient each rank
    gets is the sum of every rank's gradient of the total. With the same loss of the total on
    every rank of the group (each counting ``1 / cp`` of it, as the Trainer's unit count over
    ``dp x cp`` makes it), the update is that of one process holding the whole rows.

    Example::

        totals = cp_sum(partial_logps, ctx.cp_group)
    """
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return tensor
    return _Sum.apply(tensor, group)


def check_objective(objective: Any, cp_size: int) -> None:
    """Refuse (:class:`~tunesmith.config.ConfigError` naming the objective) an objective that
    cannot be split over ``cp_size`` > 1 ranks: one whose ``context_parallel`` attribute is
    not ``"tokens"`` or ``"rows"`` (see the module docs; sequence-level losses whose pieces
    need the whole row: reward models' last-token score, the RL recipes' per-sequence
    normalisation and generation).

    >>> class LastTokenScore:  # a loss of whole rows: it declares no context_parallel
    ...     pass
    >>> check_objective(LastTokenScore(), 1)  # one rank: nothing to split
    >>> check_objective(LastTokenScore(), 2)
    Traceback (most recent call last):
    tunesmith.config.errors.ConfigError: parallelism: cp 2: LastTokenScore (...) does not ...
    """
    if cp_size == 1 or getattr(objective, "context_parallel", None) in ("tokens", "rows"):
        return
    where = f"{type(objective).__name__} ({type(objective).__module__})"
    raise ConfigError.from_issues(
        [
            ConfigIssue(
                "parallelism",
                f"cp {cp_size}: {where} does not support context parallel (its loss needs whole "
                "sequences); use cp: 1 (context parallel runs sft, kd and dpo)",
            )
        ]
    )
