"""Batch samples into tensors: right-padded batches and fixed-length packed batches.

Labels are already shifted (see ``labels.py``): the loss needs no further shift.

Example::

    >>> batch = collate_padded([{"input_ids": [5, 6, 7], "labels": [6, 7, -100]},
    ...                         {"input_ids": [8, 9], "labels": [9, -100]}], pad_id=0)
    >>> batch["input_ids"].tolist(), batch["attention_mask"].tolist()
    ([[5, 6, 7], [8, 9, 0]], [[1, 1, 1], [1, 1, 0]])
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from tunesmith.data.labels import IGNORE_INDEX

__all__ = ["collate_packed", "collate_padded", "collate_preference"]

_PACK_KEYS = ("input_ids", "labels", "position_ids", "document_ids")


def collate_padded(
    batch: Sequence[Mapping[str, Sequence[int]]],
    pad_id: int,
    pad_to_multiple_of: int | None = None,
) -> dict[str, Tensor]:
    """Right-pad samples to the longest one (rounded up to ``pad_to_multiple_of``).

    Returns int64 tensors of shape ``[batch, T]``: ``input_ids`` (``pad_id`` at padding),
    ``labels`` (``IGNORE_INDEX`` at padding), ``attention_mask`` (1 on tokens, 0 on
    padding) and ``position_ids`` (``0..T-1`` in every row; padding positions are
    masked out and have no label, so their values do not matter).

    Example::

        >>> collate_padded([{"input_ids": [1], "labels": [-100]}], pad_id=0,
        ...                pad_to_multiple_of=4)["labels"].tolist()
        [[-100, -100, -100, -100]]
    """
    if not batch:
        raise ValueError("collate_padded got an empty batch")
    if pad_id is None:
        raise ValueError("collate_padded needs an integer pad_id (the tokenizer has none?)")
    for i, sample in enumerate(batch):
        if len(sample["input_ids"]) != len(sample["labels"]):
            raise ValueError(
                f"sample {i}: {len(sample['input_ids'])} input_ids but "
                f"{len(sample['labels'])} labels"
            )
    length = max(len(s["input_ids"]) for s in batch)
    if pad_to_multiple_of:
        length = -(-length // pad_to_multiple_of) * pad_to_multiple_of
    input_ids = torch.full((len(batch), length), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), length), IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros((len(batch), length), dtype=torch.long)
    for i, sample in enumerate(batch):
        n = len(sample["input_ids"])
        input_ids[i, :n] = torch.as_tensor(sample["input_ids"], dtype=torch.long)
        labels[i, :n] = torch.as_tensor(sample["labels"], dtype=torch.long)
        attention_mask[i, :n] = 1
    position_ids = torch.arange(length, dtype=torch.long).expand(len(batch), length).clone()
    return {
        "input_ids": input_ids,
        "labels": labels,
        "attention_mask": attention_mask,
        "position_ids": position_ids,
    }


def collate_packed(batch: Sequence[Mapping[str, Sequence[int]]]) -> dict[str, Tensor]:
    """Stack packs (see ``packing.py``) into int64 ``[batch, max_seq_len]`` tensors:
    ``input_ids``, ``labels``, ``position_ids`` and ``document_ids``.

    Example::

        >>> pack = {"input_ids": [1, 2], "labels": [2, -100],
        ...         "position_ids": [0, 1], "document_ids": [0, 0]}
        >>> collate_packed([pack, pack])["document_ids"].shape
        torch.Size([2, 2])
    """
    if not batch:
        raise ValueError("collate_packed got an empty batch")
    length = len(batch[0]["input_ids"])
    for i, pack in enumerate(batch):
        for key in _PACK_KEYS:
            if key not in pack:
                raise ValueError(f"pack {i} has no {key!r} (is it a packed sample?)")
            if len(pack[key]) != length:
                raise ValueError(
                    f"pack {i}: {key} has length {len(pack[key])}, expected {length} "
                    f"(packs must all be max_seq_len long)"
                )
    return {
        key: torch.tensor([list(pack[key]) for pack in batch], dtype=torch.long)
        for key in _PACK_KEYS
    }


_PAIR_KEYS = ("chosen_input_ids", "chosen_labels", "rejected_input_ids", "rejected_labels")


def _pair_sides(index: int, sample: object) -> list[dict[str, Sequence[int]]]:
    """The chosen and rejected sequences of one preference sample, checked."""
    if not isinstance(sample, Mapping):
        raise ValueError(f"preference sample {index} is {type(sample).__name__}, expected a dict")
    for key in _PAIR_KEYS:
        if key not in sample:
            raise ValueError(
                f"preference sample {index} has no {key!r} (keys: {sorted(sample)}); "
                "is it a PreferenceDataset sample?"
            )
    sides = []
    for side in ("chosen", "rejected"):
        ids, labels = sample[f"{side}_input_ids"], sample[f"{side}_labels"]
        if len(ids) != len(labels):
            raise ValueError(
                f"preference sample {index}: {len(ids)} {side}_input_ids but "
                f"{len(labels)} {side}_labels"
            )
        if not ids:
            raise ValueError(f"preference sample {index}: {side}_input_ids is empty")
        sides.append({"input_ids": ids, "labels": labels})
    return sides


def collate_preference(
    batch: Sequence[Mapping[str, object]],
    pad_id: int,
    pad_to_multiple_of: int | None = None,
) -> dict[str, Tensor]:
    """One right-padded batch of ``2 * B`` rows from ``B`` preference samples.

    Rows ``0..B-1`` are the chosen sequences and rows ``B..2B-1`` the rejected ones, in
    the same order (row ``i`` and row ``B + i`` are one pair), all padded to one length as
    in :func:`collate_padded`: ``input_ids``, ``labels`` (``IGNORE_INDEX`` at padding),
    ``attention_mask`` and ``position_ids``.

    Example::

        >>> pair = {"chosen_input_ids": [1, 2, 3], "chosen_labels": [-100, 3, -100],
        ...         "rejected_input_ids": [1, 4], "rejected_labels": [4, -100], "prompt_len": 1}
        >>> collate_preference([pair], pad_id=0)["input_ids"].tolist()
        [[1, 2, 3], [1, 4, 0]]
    """
    if not batch:
        raise ValueError("collate_preference got an empty batch")
    pairs = [_pair_sides(i, sample) for i, sample in enumerate(batch)]
    rows = [sides[0] for sides in pairs] + [sides[1] for sides in pairs]
    return collate_padded(rows, pad_id, pad_to_multiple_of)
