"""Keyed sampling: a row's random draws depend only on its key and the decoding step, never on
which other rows share its batch, which rank it runs on, or what ran before.

Sampling with a ``torch.Generator`` consumes one stream for the whole batch, so the same
prompt decodes differently in a batch of 8 than in a batch of 4, and a run on 2 ranks differs
from one on 1. Here each row draws one uniform number from a counter-based hash of ``(key,
step)`` and takes the token where it falls in the row's cumulative distribution (inverse-CDF
sampling: exactly a draw from ``softmax(logits)``). RL uses it so that rollouts are the same
on any number of data-parallel ranks and after a resume. The hash is murmur3's 32-bit
finaliser, computed in int64 without overflow, so CPU and GPU give the same bits; one hash
per row and a cumulative sum make it cheaper than ``torch.multinomial``
(``benchmarks/results/rl_step.md``).

Example::

    >>> keys = torch.tensor([row_key(0, 7), row_key(0, 8)])
    >>> u = keyed_uniform(keys, step=0)
    >>> u.shape, bool(((0 < u) & (u < 1)).all()), torch.equal(u[:1], keyed_uniform(keys[:1], 0))
    (torch.Size([2]), True, True)
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["keyed_sample", "keyed_sample_probs", "keyed_uniform", "row_key"]

_MASK32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9
_CHUNK = 256


def _mul32(x: Tensor, c: int) -> Tensor:
    """``x * c mod 2**32`` for ``0 <= x < 2**32`` in int64 without overflow (16-bit halves)."""
    lo, hi = x & 0xFFFF, x >> 16
    return (lo * c + (((hi * c) & 0xFFFF) << 16)) & _MASK32


def _fmix32(h: Tensor) -> Tensor:
    """murmur3's 32-bit finaliser: a bijection of ``[0, 2**32)`` that mixes every bit."""
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def row_key(*parts: int) -> int:
    """One 32-bit key from any integers (e.g. seed, round, prompt index, sample number).

    >>> row_key(1, 2) != row_key(2, 1)
    True
    """
    h = torch.tensor(len(parts), dtype=torch.int64)
    for part in parts:
        value = int(part)
        for word in (value & _MASK32, (value >> 32) & _MASK32):
            h = _fmix32(
                (h + _GOLDEN + _mul32(torch.tensor(word, dtype=torch.int64), 0xCC9E2D51)) & _MASK32
            )
    return int(h)


def keyed_uniform(keys: Tensor, step: int | Tensor) -> Tensor:
    """``[b]`` float64 uniform numbers in ``(0, 1)``; row ``i``'s depends only on
    ``(keys[i], step)`` (keys: ``[b]`` integers in ``[0, 2**32)``; ``step``: one decoding step
    for every row, or ``[b]`` steps, one per row, as a continuous-batching engine has them).

    >>> keys = torch.tensor([5, 6])
    >>> torch.equal(keyed_uniform(keys, torch.tensor([2, 9]))[1:], keyed_uniform(keys[1:], 9))
    True
    """
    keys = keys.to(torch.int64) & _MASK32
    steps = torch.as_tensor(step, dtype=torch.int64, device=keys.device) & _MASK32
    step_mix = _fmix32(_mul32(steps, _GOLDEN))
    bits = _fmix32(_fmix32(keys ^ step_mix) + _GOLDEN & _MASK32)
    return (bits.to(torch.float64) + 0.5) / 2.0**32


def keyed_sample(logits: Tensor, keys: Tensor, step: int | Tensor) -> Tensor:
    """``[b]`` tokens drawn from ``softmax(logits)`` (``[b, V]``, ``-inf`` = excluded): row
    ``i`` takes the first token whose cumulative probability exceeds its keyed uniform
    number at ``step`` (one for all rows, or ``[b]``). A token of probability 0 is never
    drawn.

    >>> logits = torch.tensor([[0.0, float("-inf"), 0.0]])
    >>> int(keyed_sample(logits, torch.tensor([3]), step=0)) in (0, 2)
    True
    """
    return keyed_sample_probs(torch.softmax(logits.float(), dim=-1), keys, step)


def keyed_sample_probs(probs: Tensor, keys: Tensor, step: int | Tensor) -> Tensor:
    """:func:`keyed_sample` from probabilities ``[b, V]`` already computed (e.g. the softmax
    whose entry at the drawn token the caller keeps as its probability).

    >>> int(keyed_sample_probs(torch.tensor([[0.0, 1.0, 0.0]]), torch.tensor([3]), step=0))
    1
    """
    # Two levels: find the chunk of 256 tokens the draw falls in from the chunks' sums, then
    # the token inside it; the same draw as one cumulative sum over the vocabulary, at a
    # fraction of its cost on a large one.
    b, vocab = probs.shape
    chunk = min(_CHUNK, vocab)
    full = vocab - vocab % chunk
    sums = probs[:, :full].reshape(b, -1, chunk).sum(-1)
    if full < vocab:
        sums = torch.cat([sums, probs[:, full:].sum(-1, keepdim=True)], dim=1)
    chunk_cdf = torch.cumsum(sums, dim=-1)  # [b, chunks]
    u = keyed_uniform(keys.to(probs.device), step).to(probs.dtype)[:, None] * chunk_cdf[:, -1:]
    # A draw rounded up to the total (u cast to the probabilities' dtype) would fall past the
    # last chunk or token with any mass: it takes that last one instead, never a zero.
    which = torch.minimum(torch.searchsorted(chunk_cdf, u, right=True), _last_positive(sums))
    before = torch.where(which > 0, chunk_cdf.gather(1, (which - 1).clamp(min=0)), 0.0)
    columns = which * chunk + torch.arange(chunk, device=probs.device)  # [b, chunk]
    inside = probs.gather(1, columns.clamp(max=vocab - 1)) * (columns < vocab)
    offset = torch.searchsorted(inside.cumsum(-1), u - before, right=True)
    offset = torch.minimum(offset, _last_positive(inside))
    return (which * chunk + offset).squeeze(-1)


def _last_positive(x: Tensor) -> Tensor:
    """``[b, 1]``: the index of each row's last entry > 0 (0 when there is none)."""
    last = x.shape[-1] - 1 - (x > 0).flip(-1).to(torch.int8).argmax(-1, keepdim=True)
    return torch.where((x > 0).any(-1, keepdim=True), last, 0)
