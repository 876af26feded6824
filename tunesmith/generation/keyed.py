"""Keyed sampling: a row's random draws depend only on its key and the decoding step, never on
which other rows share its batch, which rank it runs on, or what ran before.

Sampling with a ``torch.Generator`` consumes one stream for the whole batch, so the same
prompt decodes differently in a batch of 8 than in a batch of 4, and a run on 2 ranks differs
from one on 1. Here each row gets Gumbel noise from a counter-based hash of ``(key, step,
token id)`` and picks ``argmax(logits + noise)`` (the Gumbel-max trick: exactly a draw from
``softmax(logits)``). RL uses it so that rollouts are the same on any number of data-parallel
ranks and after a resume. The hash is murmur3's 32-bit finaliser, computed in int64 without
overflow, so CPU and GPU give the same bits.

Example::

    >>> keys = torch.tensor([row_key(0, 7), row_key(0, 8)])
    >>> noise = keyed_gumbel(keys, step=0, vocab_size=5)
    >>> noise.shape, torch.equal(noise[0], keyed_gumbel(keys[:1], 0, 5)[0])
    (torch.Size([2, 5]), True)
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["keyed_gumbel", "keyed_sample", "row_key"]

_MASK32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9


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
            h = _fmix32((h + _GOLDEN + _mul32(torch.tensor(word, dtype=torch.int64), 0xCC9E2D51))
                        & _MASK32)  # fmt: skip
    return int(h)


def keyed_gumbel(keys: Tensor, step: int, vocab_size: int, device: torch.device | None = None
                 ) -> Tensor:  # fmt: skip
    """``[b, vocab_size]`` float32 standard Gumbel noise; row ``i`` depends only on
    ``(keys[i], step)`` (keys: ``[b]`` integers in ``[0, 2**32)``)."""
    device = device if device is not None else keys.device
    keys = keys.to(device=device, dtype=torch.int64) & _MASK32
    step_mix = _fmix32(torch.tensor((step * _GOLDEN) & _MASK32, dtype=torch.int64, device=device))
    rows = _fmix32(keys ^ step_mix)[:, None]
    tokens = _mul32(torch.arange(vocab_size, device=device, dtype=torch.int64), 0x27D4EB2F)
    bits = _fmix32(_fmix32(rows ^ tokens[None, :]) + _GOLDEN & _MASK32)
    uniform = (bits.to(torch.float64) + 0.5) / 2.0**32  # in (0, 1), never 0 or 1
    return (-torch.log(-torch.log(uniform))).to(torch.float32)


def keyed_sample(logits: Tensor, keys: Tensor, step: int) -> Tensor:
    """``[b]`` tokens drawn from ``softmax(logits)`` (``[b, V]``, ``-inf`` = excluded) with the
    rows' keyed noise at ``step``.

    >>> logits = torch.tensor([[0.0, float("-inf"), 0.0]])
    >>> int(keyed_sample(logits, torch.tensor([3]), step=0)) in (0, 2)
    True
    """
    noise = keyed_gumbel(keys, step, logits.shape[-1], device=logits.device)
    return torch.argmax(logits.float() + noise, dim=-1)
