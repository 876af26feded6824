"""Loss parallel: the chunked losses on a vocabulary-sharded ``lm_head`` weight.

Under tensor parallel the ``lm_head`` weight is a ``DTensor`` sharded over the vocabulary
(``Shard(0)`` on a 1-D mesh, uneven shards allowed). The chunked losses of this package then
project each chunk of rows on *this rank's* vocabulary rows only and combine the per-row
statistics over the ranks: the global max (an all-reduce ``MAX``), then the sum of
``exp(logit - max)`` and the target logit (an all-reduce ``SUM``; a target outside the local
rows adds 0). Neither the full logits nor a gathered weight ever exist.

Gradients stay exact with two autograd functions (the conjugate pair of Megatron-LM's tensor
parallel):

* :func:`copy_to_ranks`: identity forward, all-reduce backward. A replicated tensor (the hidden
  rows, a global log-sum-exp) that feeds rank-local work gets only this rank's part of its
  gradient from that work; the all-reduce makes it the full gradient on every rank.
* :func:`sum_over_ranks`: all-reduce forward, identity backward. It sums rank-local partials
  into a value that is the same on every rank; the gradient each rank receives for that value
  is already the full one, and is the gradient of each rank's own term.

The weight's gradient is the local shard's: it reaches the ``DTensor`` parameter as a
``Shard(0)`` gradient. Every decision that changes which collectives run (chunk sizes, empty
batches, errors) depends only on values every rank shares, so the ranks stay in step.

``torch.distributed.tensor`` is not imported here: a ``DTensor`` can only exist once someone
imported it, so single-device runs pay nothing.

Example::

    >>> weight = torch.randn(11, 8)  # a plain tensor: no shard, the weight as it is
    >>> local_head(weight)[0] is weight, local_head(weight)[1]
    (True, None)
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "VocabShard",
    "copy_to_ranks",
    "local_head",
    "local_hidden",
    "logsumexp_over_ranks",
    "max_over_ranks",
    "sum_over_ranks",
]


@dataclass(frozen=True)
class VocabShard:
    """This rank's rows ``[offset, offset + size)`` of a ``vocab``-row head sharded over
    ``group``; ``max_size`` is the largest shard (the same on every rank, for decisions that
    must agree across ranks, such as chunk sizes).

    Example::

        >>> shard = VocabShard(offset=19, size=18, vocab=37, max_size=19, group=None)
        >>> shard.local_targets(torch.tensor([3, 19, 36]))
        (tensor([ 0,  0, 17]), tensor([False,  True,  True]))
    """

    offset: int
    size: int
    vocab: int
    max_size: int
    group: Any  # a torch.distributed ProcessGroup

    def local_targets(self, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(index into the local rows, inside)`` of global token ids ``targets``; the index
        is 0 where the id lies outside this rank's rows (``inside`` false)."""
        local = targets - self.offset
        inside = (local >= 0) & (local < self.size)
        return torch.where(inside, local, 0), inside

    def target_logits(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Each row's logit of its target from local ``logits`` ``[rows, size]``; 0 where the
        target is on another rank (summed over the ranks, it is the target logit)."""
        index, inside = self.local_targets(targets)
        picked = logits.gather(1, index[:, None]).squeeze(1)
        return torch.where(inside, picked, 0.0)


def _dtensor_type() -> type | None:
    module = sys.modules.get("torch.distributed.tensor")
    return None if module is None else module.DTensor


def local_head(weight: torch.Tensor) -> tuple[torch.Tensor, VocabShard | None]:
    """A head weight ``[V, h]`` as a plain tensor, and its :class:`VocabShard` when it is a
    ``DTensor`` sharded over the vocabulary (``Shard(0)`` on a 1-D mesh): then the tensor is
    this rank's rows (differentiable: its gradient flows to the ``DTensor`` as ``Shard(0)``).

    Any other ``DTensor`` (replicated, sharded on the hidden dimension, on a 2-D mesh) is
    gathered whole (``full_tensor()``: a replicated one is just its local tensor) and
    returned with no shard; a plain tensor is returned as is. A vocabulary so small that a
    rank holds no row is refused (on every rank alike).

    Example::

        >>> weight = torch.randn(11, 8)
        >>> local_head(weight)[0] is weight
        True
    """
    dtensor = _dtensor_type()
    if dtensor is None or not isinstance(weight, dtensor):
        return weight, None
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh, placements = weight.device_mesh, tuple(weight.placements)
    if mesh.ndim != 1 or placements != (Shard(0),):
        return weight.full_tensor(), None
    vocab, ranks = weight.shape[0], mesh.size()
    last_size, _ = Shard.local_shard_size_and_offset(vocab, ranks, ranks - 1)
    if last_size == 0:
        raise ValueError(
            f"loss parallel: a vocabulary of {vocab} rows sharded over {ranks} ranks leaves a "
            "rank without rows; use fewer tensor-parallel ranks or pad the vocabulary"
        )
    shape, offset = compute_local_shape_and_global_offset(weight.shape, mesh, placements)
    max_size, _ = Shard.local_shard_size_and_offset(vocab, ranks, 0)
    shard = VocabShard(
        offset=int(offset[0]),
        size=int(shape[0]),
        vocab=int(vocab),
        max_size=int(max_size),
        group=mesh.get_group(),
    )
    return weight.to_local(), shard


def local_hidden(hidden: torch.Tensor) -> torch.Tensor:
    """``hidden`` as a plain tensor: a ``DTensor`` (e.g. ``Replicate()`` on the tensor-parallel
    mesh) becomes its full value, differentiably; a plain tensor is returned as is.

    Example::

        >>> hidden = torch.randn(2, 5, 8)
        >>> local_hidden(hidden) is hidden
        True
    """
    dtensor = _dtensor_type()
    if dtensor is None or not isinstance(hidden, dtensor):
        return hidden
    return hidden.full_tensor()


class _CopyToRanks(torch.autograd.Function):
    """Identity forward; backward sums the gradient over the group."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        grad = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _SumOverRanks(torch.autograd.Function):
    """Forward sums over the group; identity backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:  # type: ignore[override]
        total = x.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return grad, None


def copy_to_ranks(x: torch.Tensor, shard: VocabShard) -> torch.Tensor:
    """``x`` (the same on every rank) unchanged; its gradient is summed over the ranks in
    backward. Wrap a replicated tensor with it before rank-local work consumes it.

    Example::

        rows = copy_to_ranks(hidden_rows, shard)
        local_logits = rows @ local_weight.T
    """
    return _CopyToRanks.apply(x, shard.group)


def sum_over_ranks(x: torch.Tensor, shard: VocabShard) -> torch.Tensor:
    """The sum of every rank's ``x`` (the same on every rank); each rank's ``x`` gets the
    incoming gradient unchanged.

    Example::

        sum_exp = sum_over_ranks(local_exp.sum(1), shard)
    """
    return _SumOverRanks.apply(x, shard.group)


def max_over_ranks(x: torch.Tensor, shard: VocabShard) -> torch.Tensor:
    """The elementwise max of every rank's ``x``, detached (a shift that cancels out of every
    log-softmax, so it needs no gradient).

    Example::

        best = max_over_ranks(local_logits.amax(1), shard)
    """
    best = x.detach().clone(memory_format=torch.contiguous_format)
    dist.all_reduce(best, op=dist.ReduceOp.MAX, group=shard.group)
    return best


def logsumexp_over_ranks(
    logits: list[torch.Tensor], shard: VocabShard, extra: list[torch.Tensor] | None = None
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The log-sum-exp over the whole vocabulary of each local ``[rows, size]`` logits tensor
    (differentiable; one ``MAX`` and one ``SUM`` all-reduce for all of them), and the sums
    over the ranks of the ``extra`` ``[rows]`` tensors (carried by the same ``SUM``).

    The results are the same on every rank; a result that rank-local work consumes (a
    log-softmax over the local rows) goes through :func:`copy_to_ranks` first.

    Example::

        (lse,), (target,) = logsumexp_over_ranks(
            [local_logits], shard, [shard.target_logits(local_logits, targets)])
    """
    extra = extra or []
    best = max_over_ranks(torch.stack([z.detach().amax(1) for z in logits]), shard)
    sum_exps = [(z - m[:, None]).exp().sum(1) for z, m in zip(logits, best, strict=True)]
    sums = sum_over_ranks(torch.stack([*sum_exps, *extra]), shard)
    lses = [m + s.log() for m, s in zip(best, sums[: len(logits)], strict=True)]
    return lses, list(sums[len(logits) :])
