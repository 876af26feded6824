"""Hold out a deterministic validation split from a dataset of samples.

Use it when the data has no validation split of its own (otherwise build a second
dataset on that split). The recipe computes the validation loss on the held-out part
every ``val_every`` steps; the split depends only on the dataset length, the fraction and
the seed, so a resumed run holds out the same samples.

Example::

    >>> train, val = split_train_val(list(range(10)), val_fraction=0.2, seed=0)
    >>> len(train), len(val)
    (8, 2)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

import torch
from torch.utils.data import Subset

__all__ = ["split_train_val"]

T = TypeVar("T")


def split_train_val(
    dataset: Sequence[T], val_fraction: float, seed: int = 0
) -> tuple[Subset[T], Subset[T]]:
    """Split ``dataset`` into (train, validation) subsets.

    ``round(val_fraction * len)`` items, chosen by a seeded permutation, go to validation
    (at least one, and at least one item stays in train); both subsets keep dataset order.

    Example::

        >>> train, val = split_train_val(["a", "b", "c", "d"], 0.25, seed=1)
        >>> sorted(list(train) + list(val))
        ['a', 'b', 'c', 'd']
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    n = len(dataset)
    n_val = max(1, round(val_fraction * n))
    if n_val >= n:
        raise ValueError(f"val_fraction={val_fraction} of {n} samples leaves nothing to train on")
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    val_indices = sorted(order[:n_val])
    held = set(val_indices)
    train_indices = [i for i in range(n) if i not in held]
    return Subset(dataset, train_indices), Subset(dataset, val_indices)
