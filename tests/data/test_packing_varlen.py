"""Packing on variable-length data, through a real decoder and the packed rows' attention
backend (``varlen``, the CPU default for packed rows):

- a packed batch gives the padded batch's loss per real (trained) token and its gradients,
  with the linear cross-entropy the configs ship and with full logits;
- the varlen backend's attention work (the padded ``[docs, len, len]`` score blocks it runs)
  is set by the documents alone: packing the same documents into rows 4x longer runs the same
  blocks, and their size stays within ``bucket_ratio ** 2`` of ``sum(len ** 2)``, far below the
  ``rows x row ** 2`` of a dense row mask.
"""

from __future__ import annotations

import random

import pytest
import torch

from tunesmith.data.collate import collate_packed, collate_padded
from tunesmith.data.labels import IGNORE_INDEX, make_labels
from tunesmith.data.packing import pack_greedy
from tunesmith.models import llama3
from tunesmith.modules.attention_backends import resolve_attention_backend, varlen_layout
from tunesmith.modules.losses import CrossEntropyLoss, LinearCrossEntropyLoss
from tunesmith.training.forward import forward_batch, head_weight

PAD = 0


def variable_length_samples(n: int, seed: int = 0) -> list[dict[str, list[int]]]:
    """``n`` samples of 3..40 tokens (a long tail: most short), prompt untrained."""
    rng = random.Random(seed)
    samples = []
    for _ in range(n):
        length = min(40, max(3, int(rng.lognormvariate(2.4, 0.6))))
        ids = [rng.randint(1, 255) for _ in range(length)]
        prompt = rng.randint(1, length - 1)
        samples.append(
            {
                "input_ids": ids,
                "labels": make_labels(ids, [False] * prompt + [True] * (length - prompt)),
            }
        )
    return samples


def _loss_per_token_and_grads(model, batch, loss_fn):
    model.zero_grad(set_to_none=True)
    if getattr(loss_fn, "needs_hidden_states", False):
        hidden, _ = forward_batch(model, batch, return_hidden_states=True)
        total = loss_fn(hidden, head_weight(model), batch["labels"])
    else:
        logits, _ = forward_batch(model, batch)
        total = loss_fn(logits, batch["labels"])
    per_token = total / (batch["labels"] != IGNORE_INDEX).sum()
    per_token.backward()
    return per_token.detach(), {k: p.grad.clone() for k, p in model.named_parameters()}


@pytest.mark.parametrize(
    "loss_fn", [LinearCrossEntropyLoss(), CrossEntropyLoss()], ids=["linear_ce", "full_logits"]
)
def test_packed_loss_per_real_token_equals_padded(loss_fn):
    torch.manual_seed(0)
    model = llama3.llama3_tiny()
    samples = variable_length_samples(24)
    padded = collate_padded(samples, pad_id=PAD)
    packed = collate_packed(pack_greedy(samples, 64, pad_id=PAD))
    real_padded = int(padded["attention_mask"].sum())
    assert packed["input_ids"].numel() < padded["input_ids"].numel()  # packing saves positions
    assert (
        int((packed["document_ids"] >= 0).sum())
        == real_padded
        == sum(len(s["input_ids"]) for s in samples)
    )
    backend = resolve_attention_backend(
        model.model.attention_backend, device="cpu", packed=True, cached=False
    )
    assert backend == "varlen"

    want, want_grads = _loss_per_token_and_grads(model, padded, loss_fn)
    got, got_grads = _loss_per_token_and_grads(model, packed, loss_fn)
    # the same per-token loss, and not by accident: computed independently of the batch layout
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    assert want.item() == pytest.approx(float(torch.log(torch.tensor(256.0))), rel=0.2)
    for key, grad in want_grads.items():
        torch.testing.assert_close(got_grads[key], grad, atol=2e-6, rtol=1e-4, msg=key)


def _score_elements(document_ids: torch.Tensor) -> int:
    """Query-key pairs the varlen backend's SDPA calls cover (per head)."""
    layout = varlen_layout(document_ids)
    return sum(g.shape[0] * g.shape[1] ** 2 for g in layout.gather)


def _document_ids(samples, row: int) -> torch.Tensor:
    return collate_packed(pack_greedy(samples, row, pad_id=PAD))["document_ids"]


def test_varlen_attention_work_follows_documents_not_row_length():
    samples = variable_length_samples(200, seed=1)
    lengths = [len(s["input_ids"]) for s in samples]
    short_rows, long_rows = _document_ids(samples, 64), _document_ids(samples, 256)
    work_short, work_long = _score_elements(short_rows), _score_elements(long_rows)
    assert work_short == work_long  # the same documents: the same score blocks
    exact = sum(n * n for n in lengths)
    assert exact <= work_long <= 4 * exact  # bucket_ratio 2: padded to at most 2x each length
    dense = long_rows.shape[0] * long_rows.shape[1] ** 2  # a block-causal mask over the row
    assert work_long < dense / 4
