"""Logits processors and token sampling for decoding.

Processors are small callables on ``[b, V]`` logits that return new logits; tokens a
processor removes get ``-inf``. :func:`sample` picks one token per row and also returns
the *policy* log-probability of that token (see :func:`sample` for the exact definition),
which is what RL trainers compare against their own forward pass.

Example::

    >>> logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    >>> out = sample(logits, temperature=0.7, top_k=3, top_p=0.9, min_p=0.05,
    ...              generator=torch.Generator().manual_seed(0))
    >>> out.tokens.shape, out.logprobs.shape
    (torch.Size([1]), torch.Size([1]))
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from tunesmith.generation.keyed import keyed_sample, keyed_sample_probs

__all__ = [
    "LogitsProcessor",
    "MinP",
    "SampleOutput",
    "Temperature",
    "TopK",
    "TopP",
    "apply_processors",
    "build_processors",
    "policy_logprobs",
    "sample",
]

LogitsProcessor = Callable[[Tensor], Tensor]
"""Any callable mapping ``[b, V]`` logits to ``[b, V]`` logits."""


def _check_logits(logits: Tensor) -> None:
    if logits.dim() != 2:
        raise ValueError(f"logits must be 2-D [batch, vocab], got shape {tuple(logits.shape)}")


class Temperature:
    """Divide logits by ``temperature`` (> 0).

    Example::

        >>> Temperature(0.5)(torch.tensor([[1.0, 2.0]]))
        tensor([[2., 4.]])
    """

    def __init__(self, temperature: float) -> None:
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0 for Temperature, got {temperature}")
        self.temperature = float(temperature)

    def __call__(self, logits: Tensor) -> Tensor:
        _check_logits(logits)
        return logits / self.temperature


class TopK:
    """Keep the ``k`` largest logits per row; set the rest to ``-inf``.

    Logits tied with the k-th largest value are kept as well, so a row can keep more
    than ``k`` tokens when there are exact ties.

    Example::

        >>> TopK(2)(torch.tensor([[1.0, 3.0, 2.0]]))
        tensor([[-inf, 3., 2.]])
    """

    def __init__(self, k: int) -> None:
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"top_k must be a positive int, got {k!r}")
        self.k = k

    def __call__(self, logits: Tensor) -> Tensor:
        _check_logits(logits)
        k = min(self.k, logits.shape[-1])
        kth = torch.topk(logits, k, dim=-1).values[:, -1:]
        return logits.masked_fill(logits < kth, float("-inf"))


class TopP:
    """Nucleus filtering: keep the smallest set of most likely tokens whose total
    probability (under ``softmax`` of the incoming logits) is ``>= p``.

    The most likely token is always kept. With ``p = 1`` nothing is removed.

    Example::

        >>> logits = torch.tensor([[0.5, 0.3, 0.2]]).log()
        >>> TopP(0.7)(logits).isfinite()
        tensor([[ True,  True, False]])
    """

    def __init__(self, p: float) -> None:
        if not 0.0 < p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {p}")
        self.p = float(p)

    def __call__(self, logits: Tensor) -> Tensor:
        _check_logits(logits)
        if self.p >= 1.0:
            return logits
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits.float(), dim=-1)
        # Mass of all strictly more likely tokens: a token is needed while that mass is < p.
        mass_before = torch.cumsum(probs, dim=-1) - probs
        drop_sorted = mass_before >= self.p
        drop_sorted[:, 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        return logits.masked_fill(drop, float("-inf"))


class MinP:
    """Min-p filtering: keep the tokens whose probability (under ``softmax`` of the incoming
    logits) is at least ``p`` times that of the most likely token; set the rest to ``-inf``.

    The most likely token is always kept; ``p = 0`` removes nothing, ``p = 1`` keeps only
    the tokens tied with the maximum. Applied after :class:`Temperature`, the threshold is
    relative to the temperature-scaled distribution.

    Example::

        >>> logits = torch.tensor([[0.5, 0.3, 0.1, 0.1]]).log()
        >>> MinP(0.5)(logits).isfinite()  # keeps probabilities >= 0.5 * 0.5
        tensor([[ True,  True, False, False]])
    """

    def __init__(self, p: float) -> None:
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {p}")
        self.p = float(p)

    def __call__(self, logits: Tensor) -> Tensor:
        _check_logits(logits)
        if self.p <= 0.0:
            return logits
        probs = torch.softmax(logits.float(), dim=-1)
        threshold = self.p * probs.amax(dim=-1, keepdim=True)
        return logits.masked_fill(probs < threshold, float("-inf"))


def build_processors(
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
) -> list[LogitsProcessor]:
    """The processors for the usual settings, in the order they apply:
    temperature, then top-k, then top-p, then min-p (top-p and min-p see the
    temperature-scaled distribution).

    ``temperature == 0`` means greedy decoding and yields no processors at all (the settings
    are still validated). ``top_p = 1`` and ``min_p = 0`` add nothing.

    Example::

        >>> [type(p).__name__ for p in build_processors(0.8, top_k=50, top_p=0.95, min_p=0.1)]
        ['Temperature', 'TopK', 'TopP', 'MinP']
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if top_k is not None and (not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1):
        raise ValueError(f"top_k must be a positive int or None, got {top_k!r}")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1] or None, got {top_p}")
    if min_p is not None and not 0.0 <= min_p <= 1.0:
        raise ValueError(f"min_p must be in [0, 1] or None, got {min_p}")
    if temperature == 0:
        return []
    processors: list[LogitsProcessor] = [Temperature(temperature)]
    if top_k is not None:
        processors.append(TopK(top_k))
    if top_p is not None and top_p < 1.0:
        processors.append(TopP(top_p))
    if min_p is not None and min_p > 0.0:
        processors.append(MinP(min_p))
    return processors


def apply_processors(logits: Tensor, processors: Sequence[LogitsProcessor]) -> Tensor:
    """Apply ``processors`` to ``[b, V]`` logits from left to right."""
    _check_logits(logits)
    for processor in processors:
        logits = processor(logits)
    return logits


def policy_logprobs(logits: Tensor, temperature: float = 0.0) -> Tensor:
    """Log-probabilities of the raw policy, in float32: ``log_softmax(logits / temperature)``
    when ``temperature > 0``, else ``log_softmax(logits)``. Top-k/top-p are *not* applied.

    Works on any leading shape (``[..., V]``), so a trainer can call it on ``[b, s, V]``
    logits of its own forward pass and get the numbers :func:`sample` returns.

    Example::

        >>> policy_logprobs(torch.zeros(1, 4)).exp()
        tensor([[0.2500, 0.2500, 0.2500, 0.2500]])
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    return torch.log_softmax(_tempered(logits, temperature), dim=-1)


def _tempered(logits: Tensor, temperature: float) -> Tensor:
    """``logits / temperature`` in float32 (as they are for 0, greedy, and for 1)."""
    logits = logits.float()
    if temperature > 0 and temperature != 1:  # dividing by 1 changes nothing: skip the pass
        logits = logits / temperature
    return logits


@dataclass
class SampleOutput:
    """One sampled token per row and its policy log-prob (both ``[b]``)."""

    tokens: Tensor
    logprobs: Tensor


def sample(
    logits: Tensor,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    processors: Sequence[LogitsProcessor] = (),
    generator: torch.Generator | None = None,
    keys: Tensor | None = None,
    step: int | Tensor = 0,
) -> SampleOutput:
    """Pick one token per row of ``[b, V]`` logits.

    * ``temperature == 0``: greedy (``argmax``; first index on ties). ``top_k``/``top_p``/
      ``min_p`` cannot change the argmax and are ignored.
    * ``temperature > 0``: draw from ``softmax`` of the processed logits (temperature, top-k,
      top-p, min-p, then any extra ``processors``) with ``torch.multinomial`` and ``generator``
      (which must live on the logits' device), so a seeded generator gives repeatable draws;
      or, with ``keys`` (``[b]``), by keyed sampling (:mod:`tunesmith.generation.keyed`): row
      ``i``'s draw depends only on ``(keys[i], step)``, not on the other rows (``step``: one
      for every row, or ``[b]``).

    Returned ``logprobs`` are those of the **raw policy**, not of the filtered distribution
    (top-k, top-p and min-p never change them):
    ``log_softmax(logits.float() / temperature)[token]`` when ``temperature > 0``, else
    ``log_softmax(logits.float())[token]`` (see :func:`policy_logprobs`). Extra
    ``processors`` do not change them either.

    Example::

        >>> sample(torch.tensor([[0.0, 5.0, 1.0]])).tokens
        tensor([1])
    """
    _check_logits(logits)
    built = build_processors(temperature, top_k, top_p, min_p)
    scaled = _tempered(logits, temperature)
    if temperature == 0:
        processed = apply_processors(logits, processors) if processors else logits
        tokens = torch.argmax(processed, dim=-1)
    else:
        if generator is not None and generator.device.type != logits.device.type:
            raise ValueError(
                f"generator is on {generator.device} but logits are on {logits.device}; "
                "create the generator on the model's device"
            )
        if keys is not None and len(built) == 1 and not processors:
            # Temperature alone: the draw is from the policy itself, whose probability of the
            # drawn token gives its log-prob (never 0: a token of probability 0 is not drawn).
            probs = torch.softmax(scaled, dim=-1)
            tokens = keyed_sample_probs(probs, keys, step)
            logprobs = probs.gather(-1, tokens[:, None]).squeeze(-1).log()
            return SampleOutput(tokens=tokens, logprobs=logprobs)
        elif keys is not None:
            tokens = keyed_sample(apply_processors(logits, [*built, *processors]), keys, step)
        else:
            processed = apply_processors(logits, [*built, *processors])
            probs = torch.softmax(processed.float(), dim=-1)
            tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    # log_softmax at the sampled tokens only: their logit less the row's log-sum-exp.
    picked = scaled.gather(-1, tokens[:, None]).squeeze(-1)
    logprobs = picked - torch.logsumexp(scaled, dim=-1)
    return SampleOutput(tokens=tokens, logprobs=logprobs)
