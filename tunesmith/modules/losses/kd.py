"""Knowledge-distillation losses: a divergence between the teacher's and the student's
next-token distributions, computed from hidden states without materialising full logits.

:func:`divergence` compares two logits tensors position by position; :class:`KDLoss` owns
both output projections (student and teacher ``lm_head`` weights) and computes, chunk by
chunk, the summed divergence and the summed student cross-entropy over trained positions.
Like the other token losses it returns *sums*: the recipe divides by the global trained-token
count and mixes the two terms (e.g. ``α·kd + (1-α)·ce``).

Example::

    >>> student, teacher = torch.randn(3, 7), torch.randn(3, 7)
    >>> divergence(student, teacher, "forward").shape
    torch.Size([3])
"""

from __future__ import annotations

import math
from functools import partial
from typing import Literal, get_args

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from tunesmith.config.registry import component
from tunesmith.modules.logits import LogitTransform
from tunesmith.modules.losses import vocab_parallel as vp
from tunesmith.modules.losses.token import IGNORE_INDEX, rows_per_chunk

__all__ = ["KD_KINDS", "KDLoss", "divergence"]

KDKind = Literal["forward", "reverse", "symmetric", "js"]
KD_KINDS: tuple[str, ...] = get_args(KDKind)


def _kl(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """``KL(p || q)`` over the last dimension, from log-probabilities."""
    return (log_p.exp() * (log_p - log_q)).sum(-1)


def divergence(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    kind: str,
    temperature: float = 1.0,
    js_beta: float = 0.5,
) -> torch.Tensor:
    """Per-position divergence between ``p_T = softmax(teacher/T)`` and
    ``p_S = softmax(student/T)`` over the last (vocabulary) dimension, shape ``[...]``.

    Kinds: ``"forward"`` ``KL(p_T || p_S)`` (mass-covering, classic KD); ``"reverse"``
    ``KL(p_S || p_T)`` (mode-seeking, MiniLLM); ``"symmetric"`` their mean; ``"js"`` the
    generalised Jensen-Shannon divergence of GKD (Agarwal et al. 2024, eq. 1; TRL's
    ``generalized_jsd_loss`` with ``beta = js_beta``) with mixture ``m = β·p_T + (1-β)·p_S``:
    ``β·KL(p_T || m) + (1-β)·KL(p_S || m)`` for ``β = js_beta`` in ``(0, 1)`` (at ``β = 0.5``
    the plain JSD, at most ``log 2``), and at the ends the KL it tends to (divided by ``β``,
    resp. ``1-β``): ``β = 0`` forward KL, ``β = 1`` reverse KL.

    The result is multiplied by ``T²`` (Hinton et al. 2015): the gradient of a softened
    divergence scales as ``1/T²``, so this keeps its size comparable to the cross-entropy
    term across temperatures. It is float32 (float64 for float64 student logits); the
    teacher logits are cast to that dtype. Logits must be finite.

    Example::

        >>> logits = torch.randn(4, 10)
        >>> divergence(logits, logits, "js").abs().max() < 1e-6
        tensor(True)
    """
    _check_kind(kind, temperature, js_beta)
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(
            f"student logits {list(student_logits.shape)} and teacher logits "
            f"{list(teacher_logits.shape)} must have the same shape"
        )
    dtype = torch.promote_types(student_logits.dtype, torch.float32)
    log_s = torch.log_softmax(_soften(student_logits.to(dtype), temperature), dim=-1)
    log_t = torch.log_softmax(_soften(teacher_logits.to(dtype), temperature), dim=-1)
    return _divergence_sum(log_s, log_t, kind, js_beta) * temperature**2


def _soften(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``logits / temperature`` (no pass over the logits at temperature 1)."""
    return logits if temperature == 1 else logits / temperature


def _divergence_sum(
    log_s: torch.Tensor, log_t: torch.Tensor, kind: str, js_beta: float
) -> torch.Tensor:
    """The divergence ``kind`` from the student's and the teacher's log-probabilities, summed
    over the last dimension (not yet times ``T²``). Every kind is a sum of per-token terms, so
    on vocabulary shards the local sums add up to the whole."""
    if kind == "forward" or (kind == "js" and js_beta == 0):
        return _kl(log_t, log_s)
    if kind == "reverse" or (kind == "js" and js_beta == 1):
        return _kl(log_s, log_t)
    if kind == "symmetric":
        return 0.5 * (_kl(log_t, log_s) + _kl(log_s, log_t))
    log_m = torch.logaddexp(log_t + math.log(js_beta), log_s + math.log(1 - js_beta))
    return js_beta * _kl(log_t, log_m) + (1 - js_beta) * _kl(log_s, log_m)


def _check_kind(kind: str, temperature: float, js_beta: float) -> None:
    if kind not in KD_KINDS:
        raise ValueError(f"kind must be one of {list(KD_KINDS)}, got {kind!r}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")
    if not 0 <= js_beta <= 1:
        raise ValueError(f"js_beta must be in [0, 1], got {js_beta!r}")


def _head_logits(
    rows: torch.Tensor,
    weight: torch.Tensor,
    dtype: torch.dtype,
    out_dtype: torch.dtype,
    transform: LogitTransform | None,
) -> torch.Tensor:
    """``transform(rows @ weight.T)`` of one chunk: the matmul in ``dtype``, the logits in
    ``out_dtype`` (differentiable; the transform is elementwise, so a vocabulary shard's
    columns are transformed alone)."""
    logits = (rows.to(dtype) @ weight.to(dtype).t()).to(out_dtype)
    return logits if transform is None else transform(logits)


def _projection_dtype(rows: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """Autocast's dtype when autocast is on (as the ``lm_head`` matmul would run), else the
    promoted dtype of the two operands."""
    device_type = rows.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return torch.promote_types(rows.dtype, weight.dtype)


@component
class KDLoss(nn.Module):
    """Knowledge distillation from hidden states: ``(Σ divergence, Σ student CE)`` over the
    positions whose label is not ``ignore_index``, both float32 scalars (float64 for float64
    student inputs).

    ``forward(student_hidden [b, s, h_s], student_weight [V, h_s], teacher_hidden [b, s, h_t],
    teacher_weight [V, h_t], labels [b, s], *, student_transform=None,
    teacher_transform=None)``. The divergence (see :func:`divergence`, which documents
    ``kind``, ``temperature`` and ``js_beta``) compares the softened teacher and student
    distributions; the cross-entropy is the student's on the labels at temperature 1. Each
    transform (its model's :class:`~tunesmith.modules.logits.LogitTransform`: Granite's scale,
    Gemma 2's soft cap) is applied to that model's logits in every chunk, before the
    temperature, and the CE uses the transformed student logits. The recipe divides both by
    the global trained-token count and mixes them.

    Ignored rows are dropped first; the trained rows are processed ``chunk_size`` rows at a
    time (or split into ``num_chunks`` chunks; by default up to 8 chunks of at least 512 rows
    each for a weight of 8 MiB or more, as :class:`~tunesmith.modules.losses.token.
    LinearCrossEntropyLoss`). With more than one chunk, each chunk's student and teacher
    logits and both sums run under ``torch.utils.checkpoint``, so backward recomputes them
    and at most one chunk of logits of each model is alive in forward and backward. A single
    chunk is kept from forward to backward instead: recomputing it would save no peak memory
    (backward would rebuild it while every other activation is still alive) and costs two
    more head matmuls. ``recompute`` (true / false) overrides that choice: true for callers
    that run several forwards before one backward, false to keep every chunk (all of them
    alive between the passes). Teacher tensors are
    detached (the teacher never gets gradients) and may be in another dtype than the student
    (e.g. a bf16 teacher for a float32 student): each model's projection runs in its own
    dtype (autocast's when autocast is on), the divergence in float32.

    Loss parallel: when ``student_weight`` is a ``DTensor`` sharded over the vocabulary
    (``Shard(0)`` on a 1-D mesh, tensor parallel's ``lm_head``), ``teacher_weight`` sharded the
    same way (or a whole plain tensor, of which each rank takes the student's rows), each rank
    projects both models on its own vocabulary rows: the log-sum-exps (softened, and the
    student's at temperature 1) and the target logit are combined over the ranks, each rank's
    log-softmax covers its rows, and the divergence summed over them is summed over the ranks
    (see :mod:`~tunesmith.modules.losses.vocab_parallel`). Hidden states and labels are the
    same on every rank; both sums are then the same on every rank and equal the unsharded
    ones, the student weight gets its shard's gradient and ``student_hidden`` its full
    gradient on every rank.

    Example::

        >>> loss_fn = KDLoss(kind="forward", temperature=2.0, num_chunks=2)
        >>> s_hidden, s_weight = torch.randn(2, 5, 8), torch.randn(11, 8)
        >>> t_hidden, t_weight = torch.randn(2, 5, 16), torch.randn(11, 16)
        >>> labels = torch.tensor([[1, 2, -100, 4, -100]] * 2)
        >>> kd, ce = loss_fn(s_hidden, s_weight, t_hidden, t_weight, labels)
        >>> kd.shape, ce.shape
        (torch.Size([]), torch.Size([]))
    """

    needs_hidden_states = True

    def __init__(
        self,
        kind: KDKind = "forward",
        temperature: float = 1.0,
        js_beta: float = 0.5,
        num_chunks: int | None = None,
        *,
        chunk_size: int | None = None,
        ignore_index: int = IGNORE_INDEX,
        recompute: bool | None = None,
    ) -> None:
        super().__init__()
        _check_kind(kind, temperature, js_beta)
        if recompute is not None and not isinstance(recompute, bool):
            raise ValueError(f"recompute must be true, false or null, got {recompute!r}")
        if num_chunks is not None and (
            isinstance(num_chunks, bool) or not isinstance(num_chunks, int) or num_chunks < 1
        ):
            raise ValueError(f"num_chunks must be an int >= 1 or None, got {num_chunks!r}")
        if chunk_size is not None and (
            isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1
        ):
            raise ValueError(f"chunk_size must be an int >= 1 or None, got {chunk_size!r}")
        self.kind = kind
        self.temperature = temperature
        self.js_beta = js_beta
        self.num_chunks = num_chunks
        self.chunk_size = chunk_size
        self.ignore_index = ignore_index
        self.recompute = recompute

    def extra_repr(self) -> str:
        return (
            f"kind={self.kind!r}, temperature={self.temperature}, js_beta={self.js_beta}, "
            f"num_chunks={self.num_chunks}, chunk_size={self.chunk_size}"
        )

    def forward(
        self,
        student_hidden: torch.Tensor,
        student_weight: torch.Tensor,
        teacher_hidden: torch.Tensor,
        teacher_weight: torch.Tensor,
        labels: torch.Tensor,
        *,
        student_transform: LogitTransform | None = None,
        teacher_transform: LogitTransform | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        _check_shapes(student_hidden, student_weight, teacher_hidden, teacher_weight, labels)
        vocab = student_weight.shape[0]
        student_weight, teacher_weight, shard = _local_heads(student_weight, teacher_weight)
        student_hidden = vp.local_hidden(student_hidden)
        teacher_hidden = vp.local_hidden(teacher_hidden)
        out_dtype = torch.promote_types(
            _projection_dtype(student_hidden, student_weight), torch.float32
        )
        flat_labels = labels.reshape(-1)
        keep = (flat_labels != self.ignore_index).nonzero().squeeze(1)
        s_rows = student_hidden.reshape(-1, student_hidden.shape[-1]).index_select(0, keep)
        t_rows = teacher_hidden.detach().reshape(-1, teacher_hidden.shape[-1])[keep]
        targets = flat_labels.index_select(0, keep)
        if s_rows.shape[0] == 0:  # nothing trained: zeros that still reach the student
            zero = (student_hidden.sum() + student_weight.sum()).to(out_dtype) * 0
            return zero, zero.clone()
        if ((targets < 0) | (targets >= vocab)).any():
            raise ValueError(
                f"KDLoss: labels must be in [0, {vocab}) or "
                f"{self.ignore_index}, got values in [{int(targets.min())}, {int(targets.max())}]"
            )
        s_dtype = _projection_dtype(s_rows, student_weight)
        t_dtype = _projection_dtype(t_rows, teacher_weight)
        t_weight = teacher_weight.detach()
        vocab_rows = shard.max_size if shard is not None else student_weight.shape[0]  # same
        weight_bytes = vocab_rows * student_weight.shape[1] * s_dtype.itemsize  # on all ranks
        chunk = rows_per_chunk(
            s_rows.shape[0],
            weight_bytes,
            self.num_chunks,
            self.chunk_size,
            min_chunk_rows=1 if self.num_chunks else None,
        )
        checkpointed = (
            torch.is_grad_enabled()
            and (s_rows.requires_grad or student_weight.requires_grad)
            and (s_rows.shape[0] > chunk if self.recompute is None else self.recompute)
        )  # one chunk is kept by default: see the class docs
        transforms = {
            "s_transform": LogitTransform.of(student_transform),
            "t_transform": LogitTransform.of(teacher_transform),
        }
        chunk_fn = partial(self._chunk, **transforms)
        if shard is not None:
            chunk_fn = partial(self._sharded_chunk, shard=shard, **transforms)
            s_rows = vp.copy_to_ranks(s_rows, shard)  # each rank's d hidden is a partial sum
        kd_total = torch.zeros((), dtype=out_dtype, device=s_rows.device)
        ce_total = torch.zeros((), dtype=out_dtype, device=s_rows.device)
        with torch.autocast(s_rows.device.type, enabled=False):
            for start in range(0, s_rows.shape[0], chunk):
                rows = slice(start, start + chunk)
                args = (s_rows[rows], student_weight, t_rows[rows], t_weight, targets[rows])
                dtypes = (s_dtype, t_dtype, out_dtype)
                if checkpointed:
                    kd, ce = checkpoint(
                        chunk_fn, *args, *dtypes, use_reentrant=False, preserve_rng_state=False
                    )
                else:
                    kd, ce = chunk_fn(*args, *dtypes)
                kd_total = kd_total + kd
                ce_total = ce_total + ce
        return kd_total, ce_total

    def _chunk(
        self,
        s_rows: torch.Tensor,
        s_weight: torch.Tensor,
        t_rows: torch.Tensor,
        t_weight: torch.Tensor,
        targets: torch.Tensor,
        s_dtype: torch.dtype,
        t_dtype: torch.dtype,
        out_dtype: torch.dtype,
        s_transform: LogitTransform | None = None,
        t_transform: LogitTransform | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Summed divergence and summed student CE of one chunk of trained rows."""
        s_logits = _head_logits(s_rows, s_weight, s_dtype, out_dtype, s_transform)
        with torch.no_grad():
            t_logits = _head_logits(t_rows, t_weight, t_dtype, out_dtype, t_transform)
            log_t = torch.log_softmax(_soften(t_logits, self.temperature), dim=-1)
        log_s = torch.log_softmax(_soften(s_logits, self.temperature), dim=-1)
        kd = _divergence_sum(log_s, log_t, self.kind, self.js_beta).sum() * self.temperature**2
        if self.temperature == 1:  # the CE's log-softmax is the divergence's
            return kd, -log_s.gather(1, targets[:, None]).sum()
        target_logits = s_logits.gather(1, targets[:, None]).squeeze(1)
        return kd, (torch.logsumexp(s_logits, dim=-1) - target_logits).sum()

    def _sharded_chunk(
        self,
        s_rows: torch.Tensor,
        s_weight: torch.Tensor,
        t_rows: torch.Tensor,
        t_weight: torch.Tensor,
        targets: torch.Tensor,
        s_dtype: torch.dtype,
        t_dtype: torch.dtype,
        out_dtype: torch.dtype,
        shard: vp.VocabShard,
        s_transform: LogitTransform | None = None,
        t_transform: LogitTransform | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`_chunk` on this rank's vocabulary rows (loss parallel): the log-sum-exps
        (softened student and teacher, student at temperature 1) and the target logit are
        combined over the ranks, the divergence is summed over the local rows, then over the
        ranks."""
        s_logits = _head_logits(s_rows, s_weight, s_dtype, out_dtype, s_transform)
        t_logits = _head_logits(t_rows, t_weight, t_dtype, out_dtype, t_transform)
        soft = [s_logits / self.temperature, t_logits / self.temperature]
        plain = [s_logits] if self.temperature != 1 else []  # the CE's log-sum-exp
        lses, (target_logits,) = vp.logsumexp_over_ranks(
            soft + plain, shard, [shard.target_logits(s_logits, targets)]
        )
        log_s = soft[0] - vp.copy_to_ranks(lses[0], shard)[:, None]  # used rank-locally
        log_t = soft[1] - lses[1][:, None]
        local = _divergence_sum(log_s, log_t, self.kind, self.js_beta)
        kd = vp.sum_over_ranks(local, shard).sum() * self.temperature**2
        ce = (lses[-1 if plain else 0] - target_logits).sum()
        return kd, ce


def _local_heads(
    student_weight: torch.Tensor, teacher_weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, vp.VocabShard | None]:
    """Both heads as plain tensors and the student's vocabulary shard (loss parallel), see
    :func:`~tunesmith.modules.losses.vocab_parallel.local_head`. A whole teacher head beside a
    sharded student is cut to the student's rows; a sharded teacher needs a student sharded
    the same way."""
    student_weight, shard = vp.local_head(student_weight)
    teacher_weight, teacher_shard = vp.local_head(teacher_weight)
    if shard is None and teacher_shard is None:
        return student_weight, teacher_weight, None
    if shard is None or (
        teacher_shard is not None
        and (teacher_shard.offset, teacher_shard.size) != (shard.offset, shard.size)
    ):
        raise ValueError(
            f"KDLoss: the teacher's lm_head weight is sharded over the vocabulary "
            f"({_rows(teacher_shard)} here) but the student's is not sharded the same way "
            f"({_rows(shard)}): shard both heads on the same tensor-parallel mesh"
        )
    if teacher_shard is None:
        teacher_weight = teacher_weight[shard.offset : shard.offset + shard.size]
    return student_weight, teacher_weight, shard


def _rows(shard: vp.VocabShard | None) -> str:
    return "whole" if shard is None else f"rows [{shard.offset}, {shard.offset + shard.size})"


def _check_shapes(
    student_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    labels: torch.Tensor,
) -> None:
    """Clear errors for inputs that do not fit together."""
    for name, hidden in (("student_hidden", student_hidden), ("teacher_hidden", teacher_hidden)):
        if hidden.shape[:-1] != labels.shape:
            raise ValueError(
                f"KDLoss: {name} {list(hidden.shape)} and labels {list(labels.shape)} must agree "
                "on every dimension but the last"
            )
    for name, weight, hidden in (
        ("student_weight", student_weight, student_hidden),
        ("teacher_weight", teacher_weight, teacher_hidden),
    ):
        if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
            raise ValueError(
                f"KDLoss: {name} must be [vocab, hidden={hidden.shape[-1]}], got "
                f"{list(weight.shape)}"
            )
    if student_weight.shape[0] != teacher_weight.shape[0]:
        raise ValueError(
            f"KDLoss: student and teacher vocabularies differ: student_weight "
            f"{list(student_weight.shape)} vs teacher_weight {list(teacher_weight.shape)} (the "
            "divergence needs the same vocabulary; pad or slice the teacher's lm_head)"
        )
