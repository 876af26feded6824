"""Packing: a packed batch gives the same loss, per-token logits and gradients as the same
samples right-padded (the recipe's own forward and loss), and a packed run trains to the same
weights as an unpacked run that sees the same samples in each step."""

from __future__ import annotations

import pytest
import torch

from tests.recipes.sft_world import (
    checkpoint_weights,
    final_weights,
    make_counting_data,
    make_equal_length_data,
    make_model_dir,
    read_metrics,
    run_sft,
)
from tunesmith.data import PackedDataset, SFTDataset, Tokenizer, collate_packed, collate_padded
from tunesmith.data.packing import assign_packs
from tunesmith.models import from_hf
from tunesmith.modules.losses import CrossEntropyLoss
from tunesmith.training.forward import forward_batch


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("packing"))


def _loss_and_grads(model, batch):
    model.zero_grad(set_to_none=True)
    logits = forward_batch(model, batch)[0]
    loss = CrossEntropyLoss()(logits, batch["labels"])
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), logits.detach(), grads


def test_packed_batch_equals_padded_batch(model_dir, tmp_path):
    data = make_counting_data(tmp_path / "count.jsonl", rows=7, seed=3)
    tokenizer = Tokenizer.from_pretrained(model_dir)
    samples = SFTDataset(tokenizer, source=str(data)).samples
    lengths = [len(s["input_ids"]) for s in samples]
    assert len(set(lengths)) > 1  # padding really happens in the padded batch
    pack_len = 2 * max(lengths) + 5  # two or three samples a pack, padding at the end
    members = assign_packs(lengths, pack_len)
    assert len(members) >= 3 and any(len(m) >= 2 for m in members)
    packed = collate_packed(PackedDataset(samples, pack_len, tokenizer.pad_id).packs)
    padded = collate_padded(samples, pad_id=tokenizer.pad_id)

    model = from_hf(model_dir)
    loss_packed, logits_packed, grads_packed = _loss_and_grads(model, packed)
    loss_padded, logits_padded, grads_padded = _loss_and_grads(model, padded)

    torch.testing.assert_close(loss_packed, loss_padded, rtol=1e-6, atol=0)
    for row, indices in enumerate(members):  # every sample's logits, wherever it sits
        start = 0
        for i in indices:
            n = lengths[i]
            torch.testing.assert_close(
                logits_packed[row, start : start + n],
                logits_padded[i, :n],
                rtol=1e-5,
                atol=1e-5,
                msg=lambda m, i=i: f"sample {i}: {m}",
            )
            start += n
    assert grads_packed.keys() == grads_padded.keys()
    for name, grad in grads_packed.items():
        torch.testing.assert_close(
            grad, grads_padded[name], rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}"
        )


def test_packed_run_equals_unpacked_run(model_dir, tmp_path):
    # Samples of one length L packed into 4L tokens: pack k holds samples 4k..4k+3, the same
    # samples as unpacked batch k of size 4 when neither run shuffles.
    rows, per_pack, steps = 16, 4, 3
    length = make_equal_length_data(tmp_path / "equal.jsonl", model_dir, rows=rows)
    data = tmp_path / "equal.jsonl"
    tokenizer = Tokenizer.from_pretrained(model_dir)
    dataset = SFTDataset(tokenizer, source=str(data))
    packs = PackedDataset(dataset, per_pack * length, tokenizer.pad_id)
    assert packs.members == [list(range(k, k + per_pack)) for k in range(0, rows, per_pack)]

    common = [
        "shuffle=false", f"max_steps={steps}", f"dataset.max_seq_len={per_pack * length}",
        "optimizer._component_=torch.optim.SGD", "~optimizer.weight_decay", "optimizer.lr=0.5",
    ]  # fmt: skip
    packed = run_sft(model_dir, data, tmp_path / "packed", "packed=true", "batch_size=1", *common)
    unpacked = run_sft(
        model_dir, data, tmp_path / "unpacked", "packed=false", f"batch_size={per_pack}", *common
    )

    logged_p, logged_u = read_metrics(packed), read_metrics(unpacked)
    assert sorted(logged_p) == sorted(logged_u) == list(range(1, steps + 1))
    for step in logged_p:
        p, u = logged_p[step], logged_u[step]
        assert p["trained_tokens_in_window"] == u["trained_tokens_in_window"]
        assert p["tokens_seen"] == u["tokens_seen"] == step * per_pack * length
        assert p["loss"] == pytest.approx(u["loss"], rel=1e-6), f"loss at step {step}"
        assert p["grad_norm"] == pytest.approx(u["grad_norm"], rel=1e-5), f"grad at step {step}"
    weights_p, weights_u = final_weights(packed), final_weights(unpacked)
    for name in weights_p:
        torch.testing.assert_close(
            weights_p[name], weights_u[name], atol=1e-6, rtol=0, msg=lambda m, n=name: f"{n}: {m}"
        )
    initial = checkpoint_weights(model_dir)
    assert max((weights_p[k] - initial[k]).abs().max().item() for k in initial) > 1e-3
