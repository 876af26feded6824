"""Pack several samples into fixed-length rows that never attend across documents.

A pack is a dict of equal-length lists (all ``max_seq_len`` long):

- ``input_ids``: the samples' tokens back to back, then ``pad_id`` padding;
- ``labels``: the samples' (already shifted, see ``labels.py``) labels; padding is
  ``IGNORE_INDEX``. Every sample's last label is ``IGNORE_INDEX``, so no position ever
  predicts the next document's first token;
- ``position_ids``: ``0, 1, 2, ...`` restarting at 0 at each document (and at the padding);
- ``document_ids``: ``0, 1, 2, ...`` per document in the pack; padding is ``-1``.

The model turns ``document_ids`` into a block-causal mask (a token attends only to
earlier tokens with the same document id; the padding attends only to padding), so a
packed batch gives the same per-token losses and gradients as the same samples unpacked.

Packing is best-fit in dataset order, deterministic: each sample goes into the open
pack with the least room that still fits it (the oldest such pack on ties), else into a
new pack. Samples keep their order inside a pack; samples are never split (one longer
than ``max_seq_len`` is an error: truncate or drop it first).

Example::

    >>> packs = pack_greedy([{"input_ids": [5, 6, 7], "labels": [6, 7, -100]},
    ...                      {"input_ids": [8, 9], "labels": [9, -100]}], 6, pad_id=0)
    >>> packs[0]["position_ids"], packs[0]["document_ids"]
    ([0, 1, 2, 0, 1, 0], [0, 0, 0, 1, 1, -1])
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any

from torch import Tensor
from torch.utils.data import Dataset

from tunesmith.data.collate import collate_packed, collate_padded
from tunesmith.data.labels import IGNORE_INDEX

__all__ = ["PAD_DOCUMENT_ID", "PackedDataset", "assign_packs", "pack_greedy", "packed_or_padded"]

PAD_DOCUMENT_ID = -1
"""``document_ids`` value of padding positions in a pack."""

Sample = Mapping[str, Sequence[int]]


def _check_sample(index: int, sample: Sample, max_seq_len: int) -> int:
    ids, labels = sample["input_ids"], sample["labels"]
    n = len(ids)
    if n == 0:
        raise ValueError(f"sample {index} is empty")
    if len(labels) != n:
        raise ValueError(f"sample {index}: {n} input_ids but {len(labels)} labels")
    if n > max_seq_len:
        raise ValueError(
            f"sample {index} has {n} tokens > max_seq_len={max_seq_len}; packing never splits "
            f"a sample (truncate or drop long samples when building the dataset)"
        )
    if labels[-1] != IGNORE_INDEX:
        raise ValueError(
            f"sample {index}: last label is {labels[-1]}, expected {IGNORE_INDEX} "
            f"(labels are shifted: the last position has no target)"
        )
    return n


def assign_packs(lengths: Sequence[int], max_seq_len: int) -> list[list[int]]:
    """Best-fit assignment of items (by length) to bins of size ``max_seq_len``.

    Returns, for each pack in creation order, the indices of its items in input order.

    Example::

        >>> assign_packs([4, 3, 2, 3], 6)
        [[0, 2], [1, 3]]
    """
    packs: list[list[int]] = []
    open_packs: list[tuple[int, int]] = []  # sorted (room left, pack index)
    for i, n in enumerate(lengths):
        if not 0 < n <= max_seq_len:
            raise ValueError(f"item {i} has length {n}, expected 1..{max_seq_len}")
        pos = bisect.bisect_left(open_packs, (n, -1))
        if pos < len(open_packs):
            room, p = open_packs.pop(pos)
        else:
            room, p = max_seq_len, len(packs)
            packs.append([])
        packs[p].append(i)
        if room - n > 0:
            bisect.insort(open_packs, (room - n, p))
    return packs


def _build_pack(docs: Sequence[Sample], max_seq_len: int, pad_id: int) -> dict[str, list[int]]:
    input_ids: list[int] = []
    labels: list[int] = []
    position_ids: list[int] = []
    document_ids: list[int] = []
    for d, doc in enumerate(docs):
        n = len(doc["input_ids"])
        input_ids.extend(int(t) for t in doc["input_ids"])
        labels.extend(int(t) for t in doc["labels"])
        position_ids.extend(range(n))
        document_ids.extend([d] * n)
    pad = max_seq_len - len(input_ids)
    input_ids.extend([pad_id] * pad)
    labels.extend([IGNORE_INDEX] * pad)
    position_ids.extend(range(pad))
    document_ids.extend([PAD_DOCUMENT_ID] * pad)
    return {
        "input_ids": input_ids,
        "labels": labels,
        "position_ids": position_ids,
        "document_ids": document_ids,
    }


def _pack(
    samples: Sequence[Sample], max_seq_len: int, pad_id: int
) -> tuple[list[list[int]], list[dict[str, list[int]]], int]:
    if max_seq_len < 1:
        raise ValueError(f"max_seq_len must be >= 1, got {max_seq_len}")
    lengths = [_check_sample(i, s, max_seq_len) for i, s in enumerate(samples)]
    members = assign_packs(lengths, max_seq_len)
    packs = [_build_pack([samples[i] for i in m], max_seq_len, pad_id) for m in members]
    return members, packs, sum(lengths)


def pack_greedy(
    samples: Sequence[Sample], max_seq_len: int, pad_id: int
) -> list[dict[str, list[int]]]:
    """Pack ``samples`` (dicts with ``input_ids`` and shifted ``labels``) into rows of
    exactly ``max_seq_len`` tokens; see the module docstring for the layout.

    Example::

        >>> [p["input_ids"] for p in pack_greedy(
        ...     [{"input_ids": [1, 2], "labels": [2, -100]}] * 3, 4, pad_id=0)]
        [[1, 2, 1, 2], [1, 2, 0, 0]]
    """
    return _pack(samples, max_seq_len, pad_id)[1]


class PackedDataset(Dataset):
    """A map-style dataset of packs built once from any sized dataset of samples.

    ``members[k]`` lists the indices (into ``dataset``) of the samples in pack ``k``.

    Example::

        >>> from torch.utils.data import DataLoader
        >>> packed = PackedDataset([{"input_ids": [1, 2], "labels": [2, -100]}] * 3, 4, pad_id=0)
        >>> packed.members, packed.fill
        ([[0, 1], [2]], 0.75)
        >>> loader = DataLoader(packed, batch_size=2, collate_fn=collate_packed)
        >>> next(iter(loader))["document_ids"]  # -1: padding
        tensor([[ 0,  0,  1,  1],
                [ 0,  0, -1, -1]])
    """

    def __init__(self, dataset: Sequence[Sample], max_seq_len: int, pad_id: int) -> None:
        samples = [dataset[i] for i in range(len(dataset))]
        self.max_seq_len = max_seq_len
        self.members, self.packs, tokens = _pack(samples, max_seq_len, pad_id)
        self.fill = tokens / max(1, len(self.packs) * max_seq_len)
        """Fraction of pack positions holding real tokens (1.0 = no padding)."""

    def __len__(self) -> int:
        return len(self.packs)

    def __getitem__(self, index: int) -> dict[str, list[int]]:
        return self.packs[index]


def packed_or_padded(
    dataset: Sequence[Sample], *, packed: bool, max_seq_len: int | None, pad_id: int
) -> tuple[Sequence[Any], Callable[[list[Any]], dict[str, Tensor]]]:
    """The samples a loader should draw and how to collate them: fixed-length packs of
    ``max_seq_len`` tokens (:class:`PackedDataset`, :func:`collate_packed`), or the samples
    themselves right-padded per batch (:func:`collate_padded`).

    Example::

        >>> samples = [{"input_ids": [1, 2, 3], "labels": [2, 3, -100]},
        ...            {"input_ids": [4], "labels": [-100]}]
        >>> data, collate = packed_or_padded(samples, packed=False, max_seq_len=None, pad_id=0)
        >>> collate(list(data))["input_ids"]
        tensor([[1, 2, 3],
                [4, 0, 0]])
        >>> data, collate = packed_or_padded(samples, packed=True, max_seq_len=4, pad_id=0)
        >>> collate(list(data))["input_ids"]
        tensor([[1, 2, 3, 4]])
    """
    if not packed:
        return dataset, partial(collate_padded, pad_id=pad_id)
    if max_seq_len is None:
        raise ValueError("packing needs the dataset's max_seq_len (the length of each pack)")
    return PackedDataset(dataset, max_seq_len, pad_id), collate_packed
