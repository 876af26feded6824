"""Collate: shapes, dtypes and padding values of padded and packed batches."""

from __future__ import annotations

import pytest
import torch

from tunesmith.data.collate import collate_packed, collate_padded
from tunesmith.data.packing import pack_greedy

A = {"input_ids": [5, 6, 7], "labels": [6, 7, -100]}
B = {"input_ids": [8, 9], "labels": [-100, -100]}
C = {"input_ids": [4, 3, 2, 1, 9], "labels": [3, -100, 1, 9, -100]}


def test_collate_padded_values():
    batch = collate_padded([A, B, C], pad_id=99)
    assert set(batch) == {"input_ids", "labels", "attention_mask", "position_ids"}
    assert all(t.dtype == torch.long and t.shape == (3, 5) for t in batch.values())
    assert batch["input_ids"].tolist() == [[5, 6, 7, 99, 99], [8, 9, 99, 99, 99], [4, 3, 2, 1, 9]]
    assert batch["labels"].tolist() == [
        [6, 7, -100, -100, -100],
        [-100, -100, -100, -100, -100],
        [3, -100, 1, 9, -100],
    ]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1]]
    assert batch["position_ids"].tolist() == [list(range(5))] * 3


def test_collate_padded_pad_to_multiple_of():
    batch = collate_padded([A, C], pad_id=0, pad_to_multiple_of=4)
    assert batch["input_ids"].shape == (2, 8)
    assert batch["labels"][:, 5:].eq(-100).all()
    assert batch["attention_mask"].sum(1).tolist() == [3, 5]
    assert collate_padded([A], pad_id=0, pad_to_multiple_of=3)["input_ids"].shape == (1, 3)


def test_collate_padded_errors():
    with pytest.raises(ValueError, match="empty batch"):
        collate_padded([], pad_id=0)
    with pytest.raises(ValueError, match="integer pad_id"):
        collate_padded([A], pad_id=None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="sample 1: 2 input_ids but 1 labels"):
        collate_padded([A, {"input_ids": [1, 2], "labels": [-100]}], pad_id=0)


def test_collate_packed_stacks_packs():
    packs = pack_greedy([A, B, C], 6, pad_id=0)
    batch = collate_packed(packs)
    assert set(batch) == {"input_ids", "labels", "position_ids", "document_ids"}
    assert all(t.dtype == torch.long and t.shape == (len(packs), 6) for t in batch.values())
    for key, tensor in batch.items():
        assert tensor.tolist() == [p[key] for p in packs]


def test_collate_packed_errors():
    pack = pack_greedy([A], 4, pad_id=0)[0]
    short = {k: v[:3] for k, v in pack.items()}
    with pytest.raises(ValueError, match="pack 1: input_ids has length 3, expected 4"):
        collate_packed([pack, short])
    with pytest.raises(ValueError, match="pack 0 has no 'document_ids'"):
        collate_packed([{k: v for k, v in pack.items() if k != "document_ids"}])
