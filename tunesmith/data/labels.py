"""From token ids and a "train on this token" mask to a training sample.

Label convention (used by every sample, pack and batch in tunesmith): labels are
**already shifted**. ``labels[i]`` is the target of position ``i``, i.e.
``labels[i] == input_ids[i + 1]`` when token ``i + 1`` is trained, else ``IGNORE_INDEX``
(-100); the last position is always ``IGNORE_INDEX``. The loss is then a plain
``cross_entropy(logits.view(-1, V), labels.view(-1), ignore_index=-100)`` with no shift,
and concatenating samples (packing) never makes one document predict the next one's
first token.

Example::

    >>> make_labels([1, 5, 6, 2], [0, 0, 1, 1])
    [-100, 6, 2, -100]
"""

from __future__ import annotations

from collections.abc import Sequence

from tunesmith.modules.losses import IGNORE_INDEX  # defined once, with the losses that use it

__all__ = [
    "IGNORE_INDEX",
    "TRUNCATION_SIDES",
    "count_trained",
    "make_labels",
    "truncate",
]


TRUNCATION_SIDES = ("right", "left")


def make_labels(input_ids: Sequence[int], trained: Sequence[int]) -> list[int]:
    """Shifted labels: ``labels[i] = input_ids[i+1] if trained[i+1] else IGNORE_INDEX``.

    ``trained[j]`` says whether token ``j`` is a target (1) or context only (0).
    Token 0 is never a target (nothing precedes it).

    Example::

        >>> make_labels([7, 8, 9], [1, 1, 1])
        [8, 9, -100]
    """
    if len(input_ids) != len(trained):
        raise ValueError(f"input_ids ({len(input_ids)}) and mask ({len(trained)}) lengths differ")
    labels = [
        int(nxt) if keep else IGNORE_INDEX
        for nxt, keep in zip(input_ids[1:], trained[1:], strict=True)
    ]
    labels.append(IGNORE_INDEX)
    return labels


def count_trained(labels: Sequence[int]) -> int:
    """Number of positions with a target.

    Example::

        >>> count_trained([-100, 6, 2, -100])
        2
    """
    return sum(1 for label in labels if label != IGNORE_INDEX)


def truncate(
    input_ids: Sequence[int], mask: Sequence[int], max_len: int, side: str = "right"
) -> tuple[list[int], list[int]]:
    """Cut ids and mask to at most ``max_len`` tokens, keeping the start (``"right"``
    drops the tail) or the end (``"left"`` drops the head).

    Example::

        >>> truncate([1, 2, 3, 4], [0, 0, 1, 1], 3, "left")
        ([2, 3, 4], [0, 1, 1])
    """
    if side not in TRUNCATION_SIDES:
        raise ValueError(f"truncation side must be one of {TRUNCATION_SIDES}, got {side!r}")
    if max_len < 1:
        raise ValueError(f"max_len must be >= 1, got {max_len}")
    if side == "right":
        return list(input_ids[:max_len]), list(mask[:max_len])
    return list(input_ids[-max_len:]), list(mask[-max_len:])
