"""Packing: documents whole and in order, positions and document ids per document, labels
never crossing documents, and a packed batch giving the same loss and grads as unpacked."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from tunesmith.data.collate import collate_packed, collate_padded
from tunesmith.data.labels import IGNORE_INDEX, make_labels
from tunesmith.data.packing import PackedDataset, assign_packs, pack_greedy

PAD = 0


def random_samples(n: int, max_len: int, seed: int = 0) -> list[dict[str, list[int]]]:
    rng = random.Random(seed)
    samples = []
    for _ in range(n):
        length = rng.randint(1, max_len)
        ids = [rng.randint(1, 49) for _ in range(length)]
        mask = [rng.random() < 0.6 for _ in range(length)]
        samples.append({"input_ids": ids, "labels": make_labels(ids, mask)})
    return samples


def test_best_fit_assignment_by_hand():
    # room after each step (max 10): 6 -> p0 (4 left); 5 -> p1 (5 left); 4 -> best fit p0
    # (4 left, exact) -> p0 full; 3 -> p1 (2 left); 7 -> p2 (3 left); 2 -> p1 (fits 2) full;
    # 3 -> p2 full.
    assert assign_packs([6, 5, 4, 3, 7, 2, 3], 10) == [[0, 2], [1, 3, 5], [4, 6]]


def test_packs_layout_by_hand():
    a = {"input_ids": [11, 12, 13], "labels": [12, -100, -100]}
    b = {"input_ids": [21, 22], "labels": [22, -100]}
    c = {"input_ids": [31, 32, 33, 34], "labels": [-100, 33, 34, -100]}
    packs = pack_greedy([a, b, c], 6, pad_id=PAD)
    assert packs == [
        {
            "input_ids": [11, 12, 13, 21, 22, PAD],
            "labels": [12, -100, -100, 22, -100, -100],
            "position_ids": [0, 1, 2, 0, 1, 0],
            "document_ids": [0, 0, 0, 1, 1, -1],
        },
        {
            "input_ids": [31, 32, 33, 34, PAD, PAD],
            "labels": [-100, 33, 34, -100, -100, -100],
            "position_ids": [0, 1, 2, 3, 0, 1],
            "document_ids": [0, 0, 0, 0, -1, -1],
        },
    ]


@pytest.mark.parametrize("max_seq_len", [8, 17, 32])
def test_packing_invariants_on_random_samples(max_seq_len):
    samples = random_samples(60, max_seq_len, seed=max_seq_len)
    packed = PackedDataset(samples, max_seq_len, pad_id=PAD)
    # every sample in exactly one pack, in increasing order inside the pack
    flat = [i for members in packed.members for i in members]
    assert sorted(flat) == list(range(len(samples)))
    assert all(m == sorted(m) for m in packed.members)
    assert len(packed) < len(samples)  # it did pack something
    for members, pack in zip(packed.members, packed, strict=True):
        assert all(len(pack[k]) == max_seq_len for k in pack)
        start = 0
        for d, i in enumerate(members):
            n = len(samples[i]["input_ids"])
            span = slice(start, start + n)
            # the document is whole and contiguous, with its own ids and positions
            assert pack["input_ids"][span] == samples[i]["input_ids"]
            assert pack["labels"][span] == samples[i]["labels"]
            assert pack["position_ids"][span] == list(range(n))
            assert pack["document_ids"][span] == [d] * n
            start += n
        pad = max_seq_len - start
        assert pack["input_ids"][start:] == [PAD] * pad
        assert pack["labels"][start:] == [IGNORE_INDEX] * pad
        assert pack["document_ids"][start:] == [-1] * pad
        # a label always targets the next token of the same document
        for t, label in enumerate(pack["labels"]):
            if label != IGNORE_INDEX:
                assert pack["document_ids"][t + 1] == pack["document_ids"][t]
                assert label == pack["input_ids"][t + 1]
    tokens = sum(len(s["input_ids"]) for s in samples)
    assert packed.fill == pytest.approx(tokens / (len(packed) * max_seq_len))
    # deterministic
    assert pack_greedy(samples, max_seq_len, PAD) == packed.packs


def test_too_long_or_unshifted_sample_is_refused():
    with pytest.raises(ValueError, match="sample 1 has 5 tokens > max_seq_len=4"):
        pack_greedy(
            [{"input_ids": [1], "labels": [-100]}, {"input_ids": [1] * 5, "labels": [-100] * 5}],
            4,
            PAD,
        )
    with pytest.raises(ValueError, match="sample 0: last label is 3"):
        pack_greedy([{"input_ids": [1, 2], "labels": [2, 3]}], 4, PAD)
    with pytest.raises(ValueError, match="sample 0: 2 input_ids but 1 labels"):
        pack_greedy([{"input_ids": [1, 2], "labels": [-100]}], 4, PAD)


class TinyLM(torch.nn.Module):
    """One attention layer that takes explicit positions and a boolean attention mask."""

    def __init__(self, vocab: int = 50, dim: int = 16, max_pos: int = 32) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.pos = torch.nn.Embedding(max_pos, dim)
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.out = torch.nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids) + self.pos(pos)
        q, k, v = self.qkv(h).chunk(3, dim=-1)
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out(h + attn)


def loss_and_grads(model, logits, labels):
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
    loss = loss / (labels != IGNORE_INDEX).sum()
    grads = torch.autograd.grad(loss, list(model.parameters()))
    return loss, grads


def test_packed_batch_gives_same_loss_and_grads_as_padded_batch():
    torch.manual_seed(0)
    samples = random_samples(12, 12, seed=3)
    model = TinyLM()

    padded = collate_padded(samples, pad_id=PAD)
    t = padded["input_ids"].shape[1]
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    keys = padded["attention_mask"].bool()[:, None, :]
    # padded query rows attend to themselves only, so no row is fully masked
    mask = (causal & keys) | torch.eye(t, dtype=torch.bool)
    logits = model(padded["input_ids"], padded["position_ids"], mask)
    loss_ref, grads_ref = loss_and_grads(model, logits, padded["labels"])

    packs = collate_packed(pack_greedy(samples, 24, pad_id=PAD))
    assert packs["input_ids"].shape[0] < len(samples)
    doc = packs["document_ids"]
    causal = torch.ones(24, 24, dtype=torch.bool).tril()
    block = (doc[:, :, None] == doc[:, None, :]) & causal
    logits = model(packs["input_ids"], packs["position_ids"], block)
    loss, grads = loss_and_grads(model, logits, packs["labels"])

    assert (packs["labels"] != IGNORE_INDEX).sum() == (padded["labels"] != IGNORE_INDEX).sum()
    torch.testing.assert_close(loss, loss_ref)
    for g, g_ref in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(g, g_ref)
