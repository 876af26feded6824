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
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from tunesmith.config.registry import component
from tunesmith.modules.logits import LogitTransform
from tunesmith.modules.losses import vocab_parallel as vp

__all__ = [
    "IGNORE_INDEX",
    "CrossEntropyLoss",
    "LinearCrossEntropyLoss",
    "token_entropy",
    "token_logprobs",
]

IGNORE_INDEX = -100
"""Label of positions that are not trained (the ``ignore_index`` of every loss); the one
definition, re-exported by :mod:`tunesmith.data.labels`."""


@component
class CrossEntropyLoss(nn.Module):
    """Summed cross-entropy over positions whose label is not ``ignore_index`` (in float32).

    ``count_correct=True`` also returns how many of those positions the model gets right (its
    label's logit is the largest: argmax equals the label, a tie counting as right), an int64
    count with no gradient: the SFT objective's ``token_accuracy``.

    Example::

        >>> logits = torch.tensor([[[0.0, 2.0, 1.0], [3.0, 0.0, 1.0], [0.0, 0.0, 5.0]]])
        >>> loss, correct = CrossEntropyLoss()(logits, torch.tensor([[1, 2, -100]]),
        ...                                    count_correct=True)
        >>> int(correct)
        1
    """

    def __init__(self, ignore_index: int = IGNORE_INDEX) -> None:
        super().__init__()
        self.ignore_index = ignore_index

    def forward(
        self, logits: torch.Tensor, labels: torch.Tensor, *, count_correct: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        flat, targets = logits.flatten(0, -2), labels.flatten()
        loss = F.cross_entropy(
            flat.float(), targets, ignore_index=self.ignore_index, reduction="sum"
        )
        if not count_correct:
            return loss
        with torch.no_grad():
            trained = (targets != self.ignore_index).nonzero().squeeze(1)
            rows = flat.detach().index_select(0, trained)
            picked = rows.gather(1, targets.index_select(0, trained)[:, None]).squeeze(1)
            correct = (picked >= rows.amax(dim=1)).sum()
        return loss, correct


# -- linear cross-entropy ----------------------------------------------------------------------


# The default chunking: up to 8 chunks, none under 512 rows once the weight is too big to stay
# in a CPU's caches (8 MiB or more). Each chunk's matmuls then re-read (and repack) the whole
# [vocab, hidden] weight and its float32 gradient sum from memory, a cost that does not shrink
# with the chunk, so small chunks run slower. Measured on a 2-core CPU: ~500 trained rows in 8
# chunks made a whole SFT step ~20% slower than in 256-row ones (benchmarks/sft_mfu.py); at vocab
# 128256 x hidden 2048 on 2 threads, 256-row chunks took 1.37x the full-logits matmul time,
# 512-row chunks 1.08x, 1024-row chunks 1.02x (benchmarks/linear_ce.py).
_DEFAULT_NUM_CHUNKS = 8
_DEFAULT_MIN_CHUNK_ROWS = 512
_CACHED_WEIGHT_BYTES = 8 * 2**20


def rows_per_chunk(
    rows: int,
    weight_bytes: int,
    num_chunks: int | None = None,
    chunk_size: int | None = None,
    min_chunk_rows: int | None = None,
) -> int:
    """Rows per chunk of a chunked head projection of ``rows`` trained rows by a
    ``weight_bytes`` weight: ``chunk_size`` when given, else ``num_chunks`` even chunks, fewer
    when a weight of 8 MiB or more would get chunks under ``min_chunk_rows`` (smaller chunks
    re-read a weight that no longer fits in cache more often per FLOP). ``num_chunks=None``:
    up to 8 chunks of at least 512 rows.

    Example::

        >>> rows_per_chunk(2048, 128256 * 2048 * 4)  # 4 chunks of 512
        512
        >>> rows_per_chunk(100, 128256 * 2048 * 4, num_chunks=4, min_chunk_rows=1)
        25
    """
    if chunk_size is not None:
        return chunk_size
    if num_chunks is None:
        num_chunks, min_chunk_rows = _DEFAULT_NUM_CHUNKS, _DEFAULT_MIN_CHUNK_ROWS
    min_rows = (min_chunk_rows or 1) if weight_bytes >= _CACHED_WEIGHT_BYTES else 1
    chunks = max(1, min(num_chunks, rows // min_rows))
    return -(-rows // chunks)


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32, or float64 for float64 inputs."""
    return torch.promote_types(dtype, torch.float32)


def _chunk_logits(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    buffer: torch.Tensor | None,
    transform: LogitTransform | None = None,
) -> torch.Tensor:
    """``transform(hidden @ weight.T)`` (no autograd) in the accumulation dtype: written into
    ``buffer`` (one ``[rows, vocab]`` block reused by every chunk, so no chunk pays for fresh
    pages) when the matmul already runs in that dtype, else a 16-bit matmul cast to float32;
    then transformed in place."""
    if buffer is None:
        logits = (hidden @ weight.t()).to(_accumulation_dtype(hidden.dtype))
    else:
        logits = torch.mm(hidden, weight.t(), out=buffer[: hidden.shape[0]])
    return logits if transform is None else transform.apply_(logits)


def _raw_grad_fn(
    transformed: torch.Tensor, transform: LogitTransform | None, buffer: torch.Tensor | None
) -> Callable[[torch.Tensor], torch.Tensor]:
    """For one chunk whose logits ``transformed`` are ``y = transform(z)``: a function that
    turns a gradient wrt ``y`` in place into the gradient wrt the raw logits ``z``
    (``dL/dz = dL/dy · dy/dz``). Without a cap ``dy/dz`` is the constant ``scale``; with one it
    is taken from ``y`` now, before ``y`` is overwritten, into ``buffer`` (a second
    ``[rows, vocab]`` block reused by every chunk; None: a fresh one)."""
    if transform is None:
        return lambda grad: grad
    if transform.softcap is None:
        return lambda grad: grad.mul_(transform.scale)
    slope = buffer[: transformed.shape[0]] if buffer is not None else torch.empty_like(transformed)
    slope = transform.derivative_(slope.copy_(transformed))
    return lambda grad: grad.mul_(slope)


def _slope_buffer(
    transform: LogitTransform | None, rows: int, vocab: int, dtype: torch.dtype, device: Any
) -> torch.Tensor | None:
    """The second chunk of logits a capped transform's gradient needs (None otherwise)."""
    if transform is None or transform.softcap is None:
        return None
    return torch.empty(rows, vocab, dtype=dtype, device=device)


def _softmax_cross_entropy_(
    logits: torch.Tensor, targets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed cross-entropy of ``logits`` ``[rows, vocab]`` against ``targets`` ``[rows]``,
    and how many rows are right (the target's logit is the row's largest: no extra pass, both
    are needed for the loss); ``logits`` is turned in place into the gradient of that sum,
    ``softmax(logits) - one_hot(targets)``.

    The log-sum-exp comes out of the softmax: the largest probability is
    ``1 / sum(exp(logits - max))`` (at least ``1 / vocab``, so it never underflows), hence
    ``lse = max - log(p_max)``. Two ``amax`` passes cost a CPU far less than one
    ``logsumexp`` or one ``max`` with indices.
    """
    best = logits.amax(dim=1)
    target_logits = logits.gather(1, targets[:, None]).squeeze(1)
    torch.softmax(logits, dim=1, out=logits)  # row by row: each element read, then written
    lse = best - logits.amax(dim=1).log()
    logits.scatter_add_(1, targets[:, None], torch.full_like(target_logits[:, None], -1.0))
    return (lse - target_logits).sum(), (target_logits >= best).sum()


def _sharded_softmax_cross_entropy_(
    logits: torch.Tensor, targets: torch.Tensor, shard: vp.VocabShard
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_softmax_cross_entropy_` on this rank's vocabulary rows (loss parallel):
    ``logits`` ``[rows, shard.size]``, ``targets`` global token ids. The global max comes
    from an all-reduce ``MAX``, the sum of ``exp(logit - max)`` and the target logit from one
    all-reduce ``SUM`` (a target on another rank adds 0). Returns the summed CE (the same on
    every rank) and the rows whose target logit is the global max (also the same on every
    rank); ``logits`` becomes this rank's columns of ``softmax - one_hot``."""
    best = vp.max_over_ranks(logits.amax(dim=1), shard)
    index, inside = shard.local_targets(targets)
    target_logits = torch.where(inside, logits.gather(1, index[:, None]).squeeze(1), 0.0)
    logits.sub_(best[:, None]).exp_()
    sum_exp, target_logits = vp.sum_over_ranks(
        torch.stack([logits.sum(dim=1), target_logits]), shard
    )
    logits.div_(sum_exp[:, None])
    logits.scatter_add_(1, index[:, None], -inside[:, None].to(logits.dtype))
    return (best + sum_exp.log() - target_logits).sum(), (target_logits >= best).sum()


def _add_chunk_grads(
    grad_logits: torch.Tensor,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    grad_hidden: torch.Tensor | None,
    grad_weight: torch.Tensor | None,
    first: bool,
) -> None:
    """From one chunk's ``d loss / d logits``: write its rows' gradient into ``grad_hidden``
    (a slice of the full gradient) and add its weight gradient to ``grad_weight`` (float32
    at least; ``first`` overwrites it). The matmuls run in ``hidden``'s dtype; a float32
    (or float64) matmul accumulates straight into ``grad_weight``."""
    grad_logits = grad_logits.to(hidden.dtype)
    if grad_hidden is not None:
        torch.mm(grad_logits, weight, out=grad_hidden)
    if grad_weight is None:
        return
    if grad_weight.dtype != hidden.dtype:  # 16-bit matmul, float32 sum
        chunk_grad = grad_logits.t() @ hidden
        if first:
            grad_weight.copy_(chunk_grad)
        else:
            grad_weight.add_(chunk_grad)
    elif first:
        torch.mm(grad_logits.t(), hidden, out=grad_weight)
    else:
        grad_weight.addmm_(grad_logits.t(), hidden)


def _chunked_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    chunk_size: int,
    ce_fn: _CEFn,
    need_hidden: bool = False,
    need_weight: bool = False,
    transform: LogitTransform | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Summed CE of ``transform(hidden @ weight.T)`` against ``targets``, ``chunk_size`` rows
    at a time, the count of rows whose target logit is the largest (int64), and (where asked)
    the *unscaled* gradients of that sum wrt ``hidden`` (its dtype) and ``weight`` (float32 at
    least). At most one chunk of logits exists at any time (two for a gradient through a soft
    cap: ``dy/dz`` is kept beside ``softmax - one_hot``)."""
    rows, acc_dtype, device = hidden.shape[0], _accumulation_dtype(hidden.dtype), hidden.device
    block = (min(chunk_size, rows), weight.shape[0])
    buffer = None
    if hidden.dtype == acc_dtype:
        buffer = torch.empty(block, dtype=acc_dtype, device=device)
    need_grad = need_hidden or need_weight
    slopes = _slope_buffer(transform, *block, acc_dtype, device) if need_grad else None
    grad_hidden = torch.empty_like(hidden) if need_hidden else None
    grad_weight = torch.empty(weight.shape, dtype=acc_dtype, device=device) if need_weight else None
    total = torch.zeros((), dtype=acc_dtype, device=device)
    correct = torch.zeros((), dtype=torch.int64, device=device)
    for start in range(0, rows, chunk_size):
        part = slice(start, start + chunk_size)
        logits = _chunk_logits(hidden[part], weight, buffer, transform)
        to_raw = _raw_grad_fn(logits, transform, slopes) if need_grad else None
        chunk_loss, chunk_correct = ce_fn(logits, targets[part])  # logits: d CE / d logits
        total += chunk_loss
        correct += chunk_correct
        if to_raw is not None:
            chunk_grad_hidden = grad_hidden[part] if grad_hidden is not None else None
            _add_chunk_grads(
                to_raw(logits), hidden[part], weight, chunk_grad_hidden, grad_weight, start == 0
            )
        del logits
    return total, correct, grad_hidden, grad_weight


_CEFn = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
"""One chunk's ``(summed CE, rows right)`` from its logits and targets, turning the logits into
their gradient in place (:func:`_softmax_cross_entropy_` and its loss-parallel form)."""


class _LinearCrossEntropy(torch.autograd.Function):
    """Summed CE of ``hidden @ weight.T``, chunk by chunk, and the count of rows right (an
    output without gradient).

    With ``grad_in_forward`` each chunk also computes its gradients in forward (its logits
    become ``softmax - one_hot`` in place and feed the two gradient matmuls at once), and
    backward only scales them by the incoming scalar: three matmuls in all, as with full
    logits. Without it (or on a second backward through a retained graph, the stored
    gradients being handed over by the first) backward recomputes each chunk's logits.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        chunk_size: int,
        ce_fn: _CEFn,
        grad_in_forward: bool,
        transform: LogitTransform | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        need = ctx.needs_input_grad[:2] if grad_in_forward else (False, False)
        total, correct, grad_hidden, grad_weight = _chunked_cross_entropy(
            hidden, weight, targets, chunk_size, ce_fn, *need, transform
        )
        ctx.mark_non_differentiable(correct)
        ctx.save_for_backward(hidden, weight, targets)  # for a recompute only
        ctx.chunk_size, ctx.ce_fn, ctx.weight_dtype = chunk_size, ce_fn, weight.dtype
        ctx.transform = transform
        ctx.grads = (grad_hidden, grad_weight) if grad_in_forward else None
        return total, correct

    @staticmethod
    @once_differentiable
    def backward(  # type: ignore[override]
        ctx: Any, grad_output: torch.Tensor, _grad_correct: Any
    ) -> tuple[Any, ...]:
        if ctx.grads is not None:  # computed in forward: handed over, so autograd may keep
            grad_hidden, grad_weight = ctx.grads  # the weight gradient without a copy
            ctx.grads = None
        else:
            hidden, weight, targets = ctx.saved_tensors
            _, _, grad_hidden, grad_weight = _chunked_cross_entropy(
                hidden,
                weight,
                targets,
                ctx.chunk_size,
                ctx.ce_fn,
                *ctx.needs_input_grad[:2],
                ctx.transform,
            )
        if grad_hidden is not None:
            grad_hidden.mul_(grad_output)
        if grad_weight is not None:
            grad_weight = grad_weight.mul_(grad_output).to(ctx.weight_dtype)
        return grad_hidden, grad_weight, None, None, None, None, None


@component
class LinearCrossEntropyLoss(nn.Module):
    """Cross-entropy that owns the output projection: ``CE(hidden @ weight.T, labels)``
    without ever materialising the ``[batch, seq, vocab]`` logits.

    Positions labelled ``ignore_index`` are dropped first (only trained rows are projected);
    the trained rows are then processed ``chunk_size`` rows at a time (or split into
    ``num_chunks`` chunks; by default up to 8 chunks, of at least 512 rows each for a
    weight of 8 MiB or more), so at most
    one chunk of logits is alive at any time.

    With ``grad_in_forward`` (the default), when a gradient is wanted, each chunk computes
    its loss *and* its gradients during forward: its logits become ``softmax - one_hot`` in
    place and feed the ``d hidden`` and ``d weight`` matmuls at once, so a step costs the
    same three big matmuls as full logits; backward only scales the stored gradients by the
    incoming scalar, and the float32 weight gradient becomes ``.grad`` without a copy.
    Between forward and backward this holds the weight gradient (which autograd would hold
    from the start of backward anyway) and a ``[trained rows, hidden]`` hidden gradient.
    ``grad_in_forward=False`` holds nothing weight-sized between the two passes and
    recomputes each chunk's logits in backward instead (a fourth matmul): for callers that
    run several forwards before one backward. A second backward through a retained graph
    recomputes too. Under ``torch.no_grad`` (evaluation) only the loss is computed.

    Logits, log-sum-exp and the weight-gradient sum are float32 for 16-bit inputs (float64
    for float64 inputs). A weight that needs no gradient (a frozen head under LoRA) costs no
    weight-gradient matmul. The loss is differentiable once (no double backward).

    ``transform`` (a :class:`~tunesmith.modules.logits.LogitTransform`, the model's
    ``logit_transform``: Granite's scale, Gemma 2's soft cap) is applied to every chunk's
    logits before the softmax, and its derivative goes into the gradients. A scale costs one
    pass over each chunk; a soft cap also keeps ``dy/dz`` beside the chunk's gradient, so a
    capped model holds two chunks of logits at a time when a gradient is computed.

    The result is the same *sum* over trained tokens as :class:`CrossEntropyLoss` (the
    recipe divides by the global trained-token count, so gradient accumulation and data
    parallelism stay exact). ``weight`` is the ``lm_head`` weight ``[vocab, hidden]``, which
    may be the tied embedding matrix: its gradient flows to whichever parameter it is.

    Loss parallel: when ``weight`` is a ``DTensor`` sharded over the vocabulary (``Shard(0)``
    on a 1-D mesh, as tensor parallel leaves ``lm_head``; uneven shards allowed), each rank
    projects every chunk on its own vocabulary rows only and combines the max, the sum of
    exponentials and the target logit over the ranks (two small all-reduces per chunk; see
    :mod:`~tunesmith.modules.losses.vocab_parallel`), so neither the full logits nor a
    gathered weight exist. ``hidden`` (a plain tensor, or a ``Replicate()`` ``DTensor``) and
    ``labels`` are the same on every rank. The loss is then the same on every rank and equals
    the unsharded one; the weight gets its shard's gradient (a ``Shard(0)`` gradient) and
    ``hidden`` the full gradient on every rank (its partial sums are all-reduced in
    backward). ``compile`` only applies to unsharded weights. Any other ``DTensor`` weight
    (replicated, sharded on the hidden dimension) is gathered whole first.

    Recipes tell the two interfaces apart by the class attribute ``needs_hidden_states``:
    ``True`` here (call ``loss(hidden, weight, labels)``), absent/``False`` on losses that
    take logits (``loss(logits, labels)``).

    ``count_correct=True`` also returns how many trained positions the model gets right (the
    label's logit is the largest of its row: argmax equals the label, a tie counting as
    right), an int64 count with no gradient, as :class:`CrossEntropyLoss` does. Each chunk
    reads it off the row maxima and target logits its loss computes anyway: no extra pass,
    no full logits (loss parallel: the global maxima and target logits, no extra
    all-reduce).

    Args:
        num_chunks: number of chunks the trained rows are split into (ignored when
            ``chunk_size`` is given). Default (None): up to 8 chunks, none under 512 rows
            when the weight takes 8 MiB or more (smaller chunks re-read a weight that no
            longer fits in cache more often per FLOP, and run slower); ``self.num_chunks``
            is then 8 and ``self.min_chunk_rows`` 512.
        chunk_size: rows per chunk; fixes the peak logits memory at
            ``chunk_size * vocab * 4`` bytes whatever the batch.
        ignore_index: label of positions that are not trained.
        compile: run each chunk's softmax/one-hot arithmetic through ``torch.compile``
            (worth it on GPU, where it fuses those passes; compilation is slow on CPU).
        grad_in_forward: compute the gradients in forward (see above).

    Example::

        >>> loss_fn = LinearCrossEntropyLoss(num_chunks=4)
        >>> hidden, weight = torch.randn(2, 5, 8), torch.randn(11, 8)
        >>> labels = torch.tensor([[1, 2, -100, 4, -100]] * 2)
        >>> loss = loss_fn(hidden, weight, labels)
        >>> torch.allclose(loss, CrossEntropyLoss()(hidden @ weight.T, labels))
        True
        >>> _, correct = loss_fn(hidden, weight, labels, count_correct=True)
        >>> logits = hidden @ weight.T
        >>> int(correct) == int((logits.argmax(-1) == labels).sum())
        True
    """

    needs_hidden_states = True

    def __init__(
        self,
        num_chunks: int | None = None,
        *,
        chunk_size: int | None = None,
        ignore_index: int = IGNORE_INDEX,
        compile: bool = False,
        grad_in_forward: bool = True,
    ) -> None:
        super().__init__()
        if num_chunks is not None and (
            isinstance(num_chunks, bool) or not isinstance(num_chunks, int) or num_chunks < 1
        ):
            raise ValueError(f"num_chunks must be an int >= 1 or None, got {num_chunks!r}")
        if chunk_size is not None and (
            isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1
        ):
            raise ValueError(f"chunk_size must be an int >= 1 or None, got {chunk_size!r}")
        if not isinstance(grad_in_forward, bool):
            raise ValueError(f"grad_in_forward must be true or false, got {grad_in_forward!r}")
        self.num_chunks = _DEFAULT_NUM_CHUNKS if num_chunks is None else num_chunks
        self.min_chunk_rows = _DEFAULT_MIN_CHUNK_ROWS if num_chunks is None else 1
        self.chunk_size = chunk_size
        self.ignore_index = ignore_index
        self.compile = compile
        self.grad_in_forward = grad_in_forward
        self._ce_fn: _CEFn = (
            torch.compile(_softmax_cross_entropy_, dynamic=True)
            if compile
            else _softmax_cross_entropy_
        )

    def rows_per_chunk(self, rows: int, weight_bytes: int) -> int:
        """Rows per chunk for ``rows`` trained rows and a ``weight_bytes`` weight (in the
        compute dtype): see :func:`rows_per_chunk`.

        Example::

            >>> llama3_head = 128256 * 2048 * 4
            >>> LinearCrossEntropyLoss().rows_per_chunk(2048, llama3_head)  # 4 chunks
            512
            >>> LinearCrossEntropyLoss(num_chunks=4).rows_per_chunk(100, llama3_head)
            25
        """
        return rows_per_chunk(
            rows, weight_bytes, self.num_chunks, self.chunk_size, self.min_chunk_rows
        )

    def forward(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        *,
        transform: LogitTransform | None = None,
        count_correct: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Summed CE (float32; float64 for float64 inputs) of ``hidden`` ``[..., h]``
        projected by ``weight`` ``[V, h]`` (then ``transform`` ed), against ``labels``
        ``[...]`` (already shifted); with ``count_correct``, also the count of positions
        right (see the class docs)."""
        if hidden.shape[:-1] != labels.shape:
            raise ValueError(
                f"hidden {list(hidden.shape)} and labels {list(labels.shape)} must agree on "
                "every dimension but the last"
            )
        if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
            raise ValueError(
                f"weight must be [vocab, hidden={hidden.shape[-1]}], got {list(weight.shape)}"
            )
        vocab, transform = weight.shape[0], LogitTransform.of(transform)
        weight, shard = vp.local_head(weight)  # a vocabulary shard: loss parallel
        hidden = vp.local_hidden(hidden)
        flat_labels = labels.reshape(-1)
        keep = (flat_labels != self.ignore_index).nonzero().squeeze(1)
        rows = hidden.reshape(-1, hidden.shape[-1]).index_select(0, keep)
        targets = flat_labels.index_select(0, keep)
        if rows.shape[0] == 0:  # nothing trained: a zero that still reaches both inputs
            zero = (rows.sum() + weight.sum() * 0).to(_accumulation_dtype(rows.dtype))
            none_right = torch.zeros((), dtype=torch.int64, device=rows.device)
            return (zero, none_right) if count_correct else zero
        if ((targets < 0) | (targets >= vocab)).any():
            raise ValueError(
                f"labels must be in [0, {vocab}) or {self.ignore_index}, got values "
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
        weight_bytes = weight.numel() * weight.element_size()
        ce_fn = self._ce_fn
        if shard is not None:  # the largest shard's size: every rank picks the same chunks
            weight_bytes = shard.max_size * weight.shape[1] * weight.element_size()
            ce_fn = partial(_sharded_softmax_cross_entropy_, shard=shard)
            rows = vp.copy_to_ranks(rows, shard)  # each rank's d hidden is a partial sum
        chunk = self.rows_per_chunk(rows.shape[0], weight_bytes)
        rows, weight = rows.to(dtype), weight.to(dtype)
        with torch.autocast(device_type, enabled=False):
            if torch.is_grad_enabled() and (rows.requires_grad or weight.requires_grad):
                total, correct = _LinearCrossEntropy.apply(
                    rows, weight, targets, chunk, ce_fn, self.grad_in_forward, transform
                )
            else:
                total, correct, _, _ = _chunked_cross_entropy(
                    rows, weight, targets, chunk, ce_fn, transform=transform
                )
        return (total, correct) if count_correct else total


# -- per-token log-probabilities -------------------------------------------------------------


def _projected(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    dtype: torch.dtype,
    transform: LogitTransform | None,
) -> torch.Tensor:
    """``transform(hidden @ weight.T)`` of one chunk through autograd: the matmul in ``dtype``,
    the logits float32 at least. The casts to ``dtype`` happen here, so a float32 weight's
    gradient is summed over chunks in float32 even when the matmul runs in bf16."""
    logits = (hidden.to(dtype) @ weight.to(dtype).t()).to(_accumulation_dtype(dtype))
    return logits if transform is None else transform(logits)


def _chunk_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    dtype: torch.dtype,
    transform: LogitTransform | None = None,
) -> torch.Tensor:
    """``log softmax(transform(hidden @ weight.T))[targets]`` of one chunk of rows (float32
    at least)."""
    logits = _projected(hidden, weight, dtype, transform)
    target_logits = logits.gather(1, targets[:, None]).squeeze(1)
    return target_logits - torch.logsumexp(logits, dim=-1)


class _TokenLogprobs(torch.autograd.Function):
    """``log softmax(transform(hidden @ weight.T))[targets]`` of ``[rows, h]`` rows,
    ``chunk_size`` rows at a time, with a hand-written backward.

    Forward keeps each chunk's float32 (transformed) logits for backward, or (``recompute``)
    nothing but the log-sum-exps, and backward then recomputes them. Backward turns the logits
    in place into ``d logp / d logits = g · (one_hot - softmax)`` (times ``dy/dz`` with a
    transform) and feeds the two gradient matmuls: no ``[rows, V]`` tensor is allocated
    besides the logits themselves (and, with a soft cap, one chunk of ``dy/dz``). The matmuls
    run in ``dtype``; the weight gradient is summed over chunks in float32 (at least) and
    returned in the weight's dtype, the hidden gradient in the hidden states' dtype.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        chunk_size: int,
        dtype: torch.dtype,
        recompute: bool,
        transform: LogitTransform | None,
    ) -> torch.Tensor:
        rows_c, weight_c = hidden.to(dtype), weight.to(dtype)
        logps, lses, kept = [], [], []
        for start in range(0, rows_c.shape[0], chunk_size):
            part = slice(start, start + chunk_size)
            logits = _chunk_logits(rows_c[part], weight_c, None, transform)
            lse = torch.logsumexp(logits, dim=-1)
            logps.append(logits.gather(1, targets[part, None]).squeeze(1) - lse)
            lses.append(lse)
            kept.append(None if recompute else logits)
        ctx.save_for_backward(hidden, weight, targets)
        ctx.lses, ctx.logits = lses, kept
        ctx.chunk_size, ctx.dtype, ctx.transform = chunk_size, dtype, transform
        return torch.cat(logps)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        hidden, weight, targets = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        rows_c, weight_c = hidden.to(ctx.dtype), weight.to(ctx.dtype)
        acc = _accumulation_dtype(ctx.dtype)
        grad_hidden = torch.empty_like(rows_c) if need_hidden else None
        grad_weight = (
            torch.empty(weight.shape, dtype=acc, device=weight.device) if need_weight else None
        )
        kept, ctx.logits = ctx.logits, [None] * len(ctx.logits)  # a second backward recomputes
        rows = min(ctx.chunk_size, rows_c.shape[0])
        slopes = _slope_buffer(ctx.transform, rows, weight.shape[0], acc, weight.device)
        for index, start in enumerate(range(0, rows_c.shape[0], ctx.chunk_size)):
            part = slice(start, start + ctx.chunk_size)
            logits = kept[index]
            if logits is None:
                logits = _chunk_logits(rows_c[part], weight_c, None, ctx.transform)
            to_raw = _raw_grad_fn(logits, ctx.transform, slopes)
            grad = grad_output[part].to(acc)[:, None]
            probs = logits.sub_(ctx.lses[index][:, None]).exp_()
            grad_logits = probs.mul_(-grad).scatter_add_(1, targets[part, None], grad)
            chunk_hidden = grad_hidden[part] if grad_hidden is not None else None
            _add_chunk_grads(
                to_raw(grad_logits), rows_c[part], weight_c, chunk_hidden, grad_weight, start == 0
            )
            del logits, probs, grad_logits
        if grad_hidden is not None:
            grad_hidden = grad_hidden.to(hidden.dtype)
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None


def _sharded_chunk_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    dtype: torch.dtype,
    shard: vp.VocabShard,
    transform: LogitTransform | None = None,
) -> torch.Tensor:
    """:func:`_chunk_token_logprobs` on this rank's vocabulary rows (loss parallel): the
    log-sum-exp and the target logit are combined over the ranks (the transform is
    elementwise, so each rank applies it to its own columns)."""
    logits = _projected(hidden, weight, dtype, transform)
    (lse,), (target_logits,) = vp.logsumexp_over_ranks(
        [logits], shard, [shard.target_logits(logits, targets)]
    )
    return target_logits - lse


def _head_dtype(
    name: str,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    positions: torch.Tensor,
    positions_name: str,
    chunk_size: int,
) -> torch.dtype:
    """Check the arguments of a chunked head projection; return its compute dtype (autocast's,
    else the promoted dtype of ``hidden`` and ``weight``)."""
    if hidden.shape[:-1] != positions.shape:
        raise ValueError(
            f"{name}: hidden {list(hidden.shape)} and {positions_name} "
            f"{list(positions.shape)} must agree on every dimension but the last"
        )
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"{name}: weight must be [vocab, hidden={hidden.shape[-1]}], got {list(weight.shape)}"
        )
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"{name}: chunk_size must be an int >= 1, got {chunk_size!r}")
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return torch.promote_types(hidden.dtype, weight.dtype)


def token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    chunk_size: int = 1024,
    ignore_index: int = IGNORE_INDEX,
    recompute: bool | None = None,
    transform: LogitTransform | None = None,
) -> torch.Tensor:
    """Log-probability of each label under ``softmax(transform(hidden @ weight.T))``, without
    ever materialising the ``[batch, seq, vocab]`` logits. ``transform`` (the model's
    :class:`~tunesmith.modules.logits.LogitTransform`, or None) is applied to every chunk, and
    its derivative goes into the gradients (a soft cap needs a second chunk of ``dy/dz`` in
    backward).

    ``hidden`` is ``[..., h]``, ``weight`` the ``lm_head`` weight ``[V, h]`` (possibly the tied
    embedding, possibly frozen), ``labels`` ``[...]`` (already shifted). Returns a tensor shaped
    like ``labels``: float32 (float64 for float64 inputs), ``0.0`` where the label is
    ``ignore_index``. Summing it over a response's positions gives the sequence log-probability
    that DPO-family losses compare.

    Only rows with a trained label are projected, ``chunk_size`` rows at a time. With more
    than one chunk, backward recomputes each chunk's logits, so at most one chunk of
    ``[rows, V]`` logits is alive in forward or backward; a single chunk keeps its logits from
    forward to backward (recomputing it would save no peak memory: backward would rebuild it
    while every other activation is still alive). ``recompute`` (true / false) overrides that
    choice. Backward is written by hand: each chunk's logits turn in place into
    ``g · (one_hot - softmax)`` and feed the two gradient matmuls. Under autocast the
    projection runs in the autocast dtype (as the ``lm_head`` matmul would), otherwise in the
    promoted dtype of ``hidden`` and ``weight``; log-softmax is float32 at least, and so is
    the weight gradient's sum over chunks. Under ``torch.no_grad`` (a reference model)
    nothing is kept.

    A ``weight`` sharded over the vocabulary (a ``Shard(0)`` ``DTensor`` on a 1-D mesh: tensor
    parallel's ``lm_head``) is used shard by shard as in :class:`LinearCrossEntropyLoss`
    (loss parallel): each chunk's log-sum-exp and target logits are combined over the ranks,
    the result is the same on every rank, the weight gets its shard's gradient and ``hidden``
    (the same on every rank) its full gradient.

    Example::

        >>> hidden, weight = torch.randn(2, 5, 8), torch.randn(11, 8)
        >>> labels = torch.tensor([[1, 2, -100, 4, -100]] * 2)
        >>> logps = token_logprobs(hidden, weight, labels, chunk_size=3)
        >>> full = torch.log_softmax(hidden @ weight.T, -1)
        >>> full = full.gather(-1, labels.clamp(min=0)[..., None]).squeeze(-1)
        >>> torch.allclose(logps, full * (labels != -100), atol=1e-6)
        True
    """
    vocab, transform = weight.shape[0], LogitTransform.of(transform)
    weight, shard = vp.local_head(weight)  # a vocabulary shard: loss parallel
    hidden = vp.local_hidden(hidden)
    dtype = _head_dtype("token_logprobs", hidden, weight, labels, "labels", chunk_size)
    device_type, out_dtype = hidden.device.type, _accumulation_dtype(dtype)

    flat_labels = labels.reshape(-1)
    keep = (flat_labels != ignore_index).nonzero().squeeze(1)
    rows = hidden.reshape(-1, hidden.shape[-1]).index_select(0, keep)
    targets = flat_labels.index_select(0, keep)
    if rows.shape[0] == 0:  # nothing trained: zeros that still reach both inputs
        anchor = (hidden.sum() + weight.sum()).to(out_dtype) * 0
        return torch.zeros(labels.shape, dtype=out_dtype, device=hidden.device) + anchor
    if ((targets < 0) | (targets >= vocab)).any():
        raise ValueError(
            f"token_logprobs: labels must be in [0, {vocab}) or {ignore_index}, got "
            f"values in [{int(targets.min())}, {int(targets.max())}]"
        )
    grad = torch.is_grad_enabled() and (rows.requires_grad or weight.requires_grad)
    if recompute is None:  # one chunk: kept from forward to backward
        recompute = rows.shape[0] > chunk_size
    if shard is None and grad:
        with torch.autocast(device_type, enabled=False):
            picked = _TokenLogprobs.apply(
                rows, weight, targets, chunk_size, dtype, recompute, transform
            )
    else:
        picked = _checkpointed_chunks(
            rows, weight, targets, chunk_size, dtype, shard, grad and recompute, transform
        )
    flat = torch.zeros(flat_labels.shape[0], dtype=out_dtype, device=hidden.device)
    return flat.index_copy(0, keep, picked).reshape(labels.shape)


def _checkpointed_chunks(
    rows: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    chunk_size: int,
    dtype: torch.dtype,
    shard: vp.VocabShard | None,
    checkpointed: bool,
    transform: LogitTransform | None = None,
) -> torch.Tensor:
    """:func:`token_logprobs` of the trained rows through autograd (no gradient, or a weight
    sharded over the vocabulary), each chunk under ``torch.utils.checkpoint`` when
    ``checkpointed``."""
    from torch.utils.checkpoint import checkpoint

    chunk_fn: Callable[..., torch.Tensor] = partial(_chunk_token_logprobs, transform=transform)
    if shard is not None:
        chunk_fn = partial(_sharded_chunk_token_logprobs, shard=shard, transform=transform)
        rows = vp.copy_to_ranks(rows, shard)  # each rank's d hidden is a partial sum
    pieces = []
    with torch.autocast(rows.device.type, enabled=False):
        for start in range(0, rows.shape[0], chunk_size):
            chunk = (rows[start : start + chunk_size], weight, targets[start : start + chunk_size])
            if checkpointed:
                pieces.append(
                    checkpoint(
                        chunk_fn, *chunk, dtype, use_reentrant=False, preserve_rng_state=False
                    )
                )
            else:
                pieces.append(chunk_fn(*chunk, dtype))
    return torch.cat(pieces)


# -- per-token entropy -------------------------------------------------------------------------


@torch.no_grad()
def token_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    mask: torch.Tensor,
    chunk_size: int = 1024,
    *,
    transform: LogitTransform | None = None,
) -> torch.Tensor:
    """Entropy of ``softmax(transform(hidden @ weight.T))`` at each position where ``mask``
    is true, a metric (computed under ``torch.no_grad``, no gradient), without ever
    materialising the ``[batch, seq, vocab]`` logits (``transform``: the model's
    :class:`~tunesmith.modules.logits.LogitTransform`, or None).

    ``hidden`` is ``[..., h]``, ``weight`` the ``lm_head`` weight ``[V, h]``, ``mask``
    ``[...]`` (bool or 0/1). Returns a tensor shaped like ``mask``: float32 (float64 for
    float64 inputs), ``0.0`` where ``mask`` is false. Only masked-in rows are projected,
    ``chunk_size`` rows at a time, in the same compute dtype as :func:`token_logprobs`
    (autocast's, else the promoted dtype of ``hidden`` and ``weight``); the softmax is float32
    at least: ``H = -sum(p · log p)`` with ``log p = log_softmax(z)``.

    A ``weight`` sharded over the vocabulary (a ``Shard(0)`` ``DTensor`` on a 1-D mesh: tensor
    parallel's ``lm_head``) is used shard by shard (loss parallel): with the global max ``m``,
    ``S = Σ exp(z - m)`` and ``E = Σ exp(z - m)·(z - m)`` summed over the ranks,
    ``H = log S - E / S``, the same on every rank.

    Example::

        >>> hidden, weight = torch.randn(2, 5, 8), torch.randn(11, 8)
        >>> mask = torch.tensor([[1, 1, 0, 1, 0]] * 2)
        >>> entropy = token_entropy(hidden, weight, mask, chunk_size=3)
        >>> p = torch.softmax(hidden @ weight.T, -1)
        >>> full = -(p * p.log()).sum(-1) * mask
        >>> torch.allclose(entropy, full, atol=1e-5)
        True
    """
    transform = LogitTransform.of(transform)
    weight, shard = vp.local_head(weight)  # a vocabulary shard: loss parallel
    hidden = vp.local_hidden(hidden)
    dtype = _head_dtype("token_entropy", hidden, weight, mask, "mask", chunk_size)
    device_type, out_dtype = hidden.device.type, _accumulation_dtype(dtype)
    keep = mask.reshape(-1).bool().nonzero().squeeze(1)
    rows = hidden.reshape(-1, hidden.shape[-1]).index_select(0, keep)
    flat = torch.zeros(mask.numel(), dtype=out_dtype, device=hidden.device)
    pieces = []
    with torch.autocast(device_type, enabled=False):
        for start in range(0, rows.shape[0], chunk_size):
            chunk = rows[start : start + chunk_size].to(dtype)
            logits = (chunk @ weight.to(dtype).t()).to(out_dtype)
            if transform is not None:
                transform.apply_(logits)
            if shard is not None:
                pieces.append(_sharded_entropy(logits, shard))
                continue
            log_p = torch.log_softmax(logits, dim=-1)
            pieces.append(-(log_p.exp() * log_p).sum(-1))
            del logits, log_p
    if pieces:
        flat.index_copy_(0, keep, torch.cat(pieces))
    return flat.reshape(mask.shape)


def _sharded_entropy(logits: torch.Tensor, shard: vp.VocabShard) -> torch.Tensor:
    """Entropy of each row of the softmax over the whole vocabulary, from this rank's
    columns ``logits`` ``[rows, shard.size]`` (loss parallel): with ``m`` the global max,
    ``S = Σ exp(z - m)`` and ``E = Σ exp(z - m)·(z - m)`` (both summed over the ranks),
    ``H = log S - E / S``."""
    shifted = logits - vp.max_over_ranks(logits.amax(dim=-1), shard)[:, None]
    weights = shifted.exp()
    sum_exp, weighted = vp.sum_over_ranks(
        torch.stack([weights.sum(-1), (weights * shifted).sum(-1)]), shard
    )
    return sum_exp.log() - weighted / sum_exp
