"""Token losses whose reduction the training loop controls.

Labels are already shifted (``labels[i]`` is the target of position ``i``; ``-100`` = not
trained), so no loss here shifts again. Losses return the *sum* over trained tokens: the
recipe divides by the number of trained tokens across all micro-batches and ranks, which makes
gradient accumulation and data parallelism give the same update as one big batch.

Example::

    >>> loss_fn = CrossEntropyLoss()
    >>> logits, labels = torch.randn(2, 5, 11), torch.tensor([[1, 2, -100, 4, -100]] * 2)
    >>> loss_fn(logits, labels).shape
    torch.Size([])
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["IGNORE_INDEX", "CrossEntropyLoss", "LinearCrossEntropyLoss"]

IGNORE_INDEX = -100


class CrossEntropyLoss(nn.Module):
    """Summed cross-entropy over positions whose label is not ``ignore_index`` (in float32)."""

    def __init__(self, ignore_index: int = IGNORE_INDEX) -> None:
        super().__init__()
        self.ignore_index = ignore_index

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(
            logits.flatten(0, -2).float(),
            labels.flatten(),
            ignore_index=self.ignore_index,
            reduction="sum",
        )


# -- linear cross-entropy ----------------------------------------------------------------------


def _chunk_loss(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed CE of one chunk of rows, and each row's log-sum-exp (float32 at least)."""
    logits = (hidden @ weight.t()).to(_accumulation_dtype(hidden.dtype))
    lse = torch.logsumexp(logits, dim=-1)
    target_logits = logits.gather(1, targets[:, None]).squeeze(1)
    return (lse - target_logits).sum(), lse


def _chunk_grads(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    lse: torch.Tensor,
    grad_output: torch.Tensor,
    need_hidden: bool,
    need_weight: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Gradients of ``grad_output * chunk loss`` wrt the chunk's hidden rows and the weight
    (None where not needed, e.g. a frozen ``lm_head`` under LoRA).

    The logits are recomputed; ``d loss / d logits = softmax(logits) - one_hot(targets)``.
    The weight gradient is returned in float32 so chunks accumulate without rounding.
    """
    # the logits, turned in place into their gradient
    grad_logits = (hidden @ weight.t()).to(_accumulation_dtype(hidden.dtype))
    grad_logits.sub_(lse[:, None]).exp_()
    grad_logits[torch.arange(len(targets), device=targets.device), targets] -= 1.0
    grad_logits = grad_logits.mul_(grad_output).to(hidden.dtype)
    grad_hidden = grad_logits @ weight if need_hidden else None
    grad_weight = None
    if need_weight:
        grad_weight = (grad_logits.t() @ hidden).to(_accumulation_dtype(hidden.dtype))
    return grad_hidden, grad_weight


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32, or float64 for float64 inputs."""
    return torch.promote_types(dtype, torch.float32)


class _LinearCrossEntropy(torch.autograd.Function):
    """Summed CE of ``hidden @ weight.T`` computed chunk by chunk; backward recomputes each
    chunk's logits, so at most one chunk of ``[rows, vocab]`` logits is alive at any time."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        chunk_size: int,
        loss_fn: Callable[..., tuple[torch.Tensor, torch.Tensor]],
        grads_fn: Callable[..., tuple[torch.Tensor | None, torch.Tensor | None]],
    ) -> torch.Tensor:
        acc_dtype = _accumulation_dtype(hidden.dtype)
        total = torch.zeros((), dtype=acc_dtype, device=hidden.device)
        lses = []
        for start in range(0, hidden.shape[0], chunk_size):
            rows = slice(start, start + chunk_size)
            chunk_total, lse = loss_fn(hidden[rows], weight, targets[rows])
            total += chunk_total
            lses.append(lse)
        lse_all = torch.cat(lses)
        ctx.save_for_backward(hidden, weight, targets, lse_all)
        ctx.chunk_size = chunk_size
        ctx.grads_fn = grads_fn
        return total

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        hidden, weight, targets, lse = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = (
            torch.zeros(weight.shape, dtype=_accumulation_dtype(weight.dtype), device=weight.device)
            if need_weight
            else None
        )
        for start in range(0, hidden.shape[0], ctx.chunk_size):
            rows = slice(start, start + ctx.chunk_size)
            chunk_grad_hidden, chunk_grad_weight = ctx.grads_fn(
                hidden[rows], weight, targets[rows], lse[rows], grad_output,
                need_hidden, need_weight,
            )  # fmt: skip
            if grad_hidden is not None:
                grad_hidden[rows] = chunk_grad_hidden
            if grad_weight is not None:
                grad_weight += chunk_grad_weight
            del chunk_grad_hidden, chunk_grad_weight
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None


class LinearCrossEntropyLoss(nn.Module):
    """Cross-entropy that owns the output projection: ``CE(hidden @ weight.T, labels)``
    without ever materialising the ``[batch, seq, vocab]`` logits.

    Positions labelled ``ignore_index`` are dropped first (only trained rows are projected);
    the trained rows are then processed ``chunk_size`` rows at a time (or split into
    ``num_chunks`` chunks), and the backward pass recomputes each chunk's logits instead of
    keeping them, so at most one chunk of logits is alive in forward *and* backward. The
    price is one extra ``hidden @ weight.T`` matmul in backward. Logits, log-sum-exp and the
    weight-gradient accumulator are float32 for 16-bit inputs (float64 for float64 inputs);
    with a 16-bit weight that accumulator is one float32 ``[vocab, hidden]`` buffer during
    backward. A weight that needs no gradient (a frozen head under LoRA) costs no weight
    gradient matmul.

    The result is the same *sum* over trained tokens as :class:`CrossEntropyLoss` (the
    recipe divides by the global trained-token count, so gradient accumulation and data
    parallelism stay exact). ``weight`` is the ``lm_head`` weight ``[vocab, hidden]``, which
    may be the tied embedding matrix: its gradient flows to whichever parameter it is.

    Recipes tell the two interfaces apart by the class attribute ``needs_hidden_states``:
    ``True`` here (call ``loss(hidden, weight, labels)``), absent/``False`` on losses that
    take logits (``loss(logits, labels)``).

    Args:
        num_chunks: number of chunks the trained rows are split into (ignored when
            ``chunk_size`` is given).
        chunk_size: rows per chunk; fixes the peak logits memory at
            ``chunk_size * vocab * 4`` bytes whatever the batch.
        ignore_index: label of positions that are not trained.
        compile: run each chunk's computation through ``torch.compile`` (worth it on GPU,
            where it fuses the softmax/one-hot arithmetic; compilation is slow on CPU).

    Example::

        >>> loss_fn = LinearCrossEntropyLoss(num_chunks=4)
        >>> hidden, weight = torch.randn(2, 5, 8), torch.randn(11, 8)
        >>> labels = torch.tensor([[1, 2, -100, 4, -100]] * 2)
        >>> loss = loss_fn(hidden, weight, labels)
        >>> torch.allclose(loss, CrossEntropyLoss()(hidden @ weight.T, labels))
        True
    """

    needs_hidden_states = True

    def __init__(
        self,
        num_chunks: int = 8,
        *,
        chunk_size: int | None = None,
        ignore_index: int = IGNORE_INDEX,
        compile: bool = False,
    ) -> None:
        super().__init__()
        if isinstance(num_chunks, bool) or not isinstance(num_chunks, int) or num_chunks < 1:
            raise ValueError(f"num_chunks must be an int >= 1, got {num_chunks!r}")
        if chunk_size is not None and (
            isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1
        ):
            raise ValueError(f"chunk_size must be an int >= 1 or None, got {chunk_size!r}")
        self.num_chunks = num_chunks
        self.chunk_size = chunk_size
        self.ignore_index = ignore_index
        self.compile = compile
        self._loss_fn: Callable[..., tuple[torch.Tensor, torch.Tensor]] = _chunk_loss
        self._grads_fn: Callable[..., tuple[torch.Tensor | None, torch.Tensor | None]] = (
            _chunk_grads
        )
        if compile:
            self._loss_fn = torch.compile(_chunk_loss, dynamic=True)
            self._grads_fn = torch.compile(_chunk_grads, dynamic=True)

    def forward(
        self, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor
    ) -> torch.Tensor:
        """Summed CE (float32; float64 for float64 inputs) of ``hidden`` ``[..., h]``
        projected by ``weight`` ``[V, h]``, against ``labels`` ``[...]`` (already shifted)."""
        if hidden.shape[:-1] != labels.shape:
            raise ValueError(
                f"hidden {list(hidden.shape)} and labels {list(labels.shape)} must agree on "
                "every dimension but the last"
            )
        if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
            raise ValueError(
                f"weight must be [vocab, hidden={hidden.shape[-1]}], got {list(weight.shape)}"
            )
        flat_labels = labels.reshape(-1)
        keep = (flat_labels != self.ignore_index).nonzero().squeeze(1)
        rows = hidden.reshape(-1, hidden.shape[-1]).index_select(0, keep)
        targets = flat_labels.index_select(0, keep)
        if rows.shape[0] == 0:  # nothing trained: a zero that still reaches both inputs
            return (rows.sum() + weight.sum() * 0).to(_accumulation_dtype(rows.dtype))
        if ((targets < 0) | (targets >= weight.shape[0])).any():
            raise ValueError(
                f"labels must be in [0, {weight.shape[0]}) or {self.ignore_index}, got values "
                f"in [{int(targets.min())}, {int(targets.max())}]"
            )
        # One compute dtype for both operands: autocast's (as the lm_head matmul would run
        # under autocast), else the promoted dtype. The casts are differentiable and outside
        # the Function, whose backward runs without autocast.
        device_type = rows.device.type
        if torch.is_autocast_enabled(device_type):
            dtype = torch.get_autocast_dtype(device_type)
        else:
            dtype = torch.promote_types(rows.dtype, weight.dtype)
        chunk = self.chunk_size or -(-rows.shape[0] // self.num_chunks)
        with torch.autocast(device_type, enabled=False):
            return _LinearCrossEntropy.apply(
                rows.to(dtype), weight.to(dtype), targets, chunk, self._loss_fn, self._grads_fn
            )
