"""Activation checkpointing gives the same loss and gradients as none, in every mode, while
keeping fewer activations between forward and backward; offloading is a no-op on CPU."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from tunesmith.models import llama3
from tunesmith.modules.losses import IGNORE_INDEX, CrossEntropyLoss
from tunesmith.training.memory.activations import (
    activation_offloading,
    apply_activation_checkpointing,
    is_checkpointed,
)
from tunesmith.training.memory.optim_in_backward import OptimizerInBackward
from tunesmith.training.memory.usage import LiveTensorBytes


@pytest.fixture(scope="module")
def base():
    torch.manual_seed(0)
    return llama3.llama3_tiny(num_hidden_layers=4)


def _batch():
    gen = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, 256, (2, 24), generator=gen)
    labels = input_ids.roll(-1, dims=1)
    labels[:, :6] = IGNORE_INDEX
    return input_ids, labels


def _loss_and_grads(model):
    input_ids, labels = _batch()
    model.zero_grad(set_to_none=True)
    saved = []

    def pack(tensor):
        saved.append(tensor)
        return tensor

    with LiveTensorBytes() as mem, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = CrossEntropyLoss()(model(input_ids), labels)
        kept = mem.current  # activations held for backward
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return loss.detach(), grads, kept, len(saved)


@pytest.mark.parametrize(
    "mode, every_k, wrapped",
    [("full", 1, 4), ("full", 2, 2), ("full", 3, 2), ("selective", 1, 4), ("selective", 2, 2)],
)
def test_same_loss_and_gradients_fewer_activations(base, mode, every_k, wrapped):
    ref_loss, ref_grads, ref_kept, ref_saved = _loss_and_grads(base)
    model = copy.deepcopy(base)
    assert apply_activation_checkpointing(model, mode=mode, every_k=every_k) == wrapped
    layers = model.model.layers
    assert [is_checkpointed(layer) for layer in layers] == [i % every_k == 0 for i in range(4)]
    loss, grads, kept, saved = _loss_and_grads(model)
    assert torch.equal(loss, ref_loss)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=0, atol=1e-7, msg=name)
    assert kept < ref_kept and saved < ref_saved
    assert list(model.state_dict()) == list(base.state_dict())  # HF names untouched


def test_full_keeps_less_than_selective_keeps_less_than_none(base):
    kept = {}
    for mode in (None, "selective", "full"):
        model = copy.deepcopy(base)
        if mode is not None:
            apply_activation_checkpointing(model, mode=mode)
        kept[mode] = _loss_and_grads(model)[2]
    assert kept["full"] < kept["selective"] < kept[None]


def test_no_checkpointing_without_autograd(base):
    """Under no_grad (evaluation, generation) a checkpointed layer runs plainly."""
    model = copy.deepcopy(base)
    apply_activation_checkpointing(model, mode="full")
    input_ids, _ = _batch()
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids), base(input_ids), rtol=0, atol=0)


def test_combines_with_optimizer_in_backward(base):
    """Recompute happens before any of the layer's own parameters is updated, so the
    checkpointed model ends where the plain one does."""
    models = [copy.deepcopy(base), copy.deepcopy(base)]
    apply_activation_checkpointing(models[1], mode="full")
    input_ids, labels = _batch()
    for model in models:
        OptimizerInBackward(model.parameters(), lambda groups: torch.optim.AdamW(groups, lr=1e-2))
        for _ in range(2):
            CrossEntropyLoss()(model(input_ids), labels).backward()
    for p, q in zip(models[0].parameters(), models[1].parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)


def test_copy_keeps_checkpointing_bound_to_the_copy(base):
    model = copy.deepcopy(base)
    apply_activation_checkpointing(model, mode="selective")
    twin = copy.deepcopy(model)
    assert twin.model.layers[0].forward.module is twin.model.layers[0]


def test_bad_arguments_raise(base):
    model = copy.deepcopy(base)
    with pytest.raises(ValueError, match="mode must be one of"):
        apply_activation_checkpointing(model, mode="some")
    with pytest.raises(ValueError, match="every_k must be an int >= 1"):
        apply_activation_checkpointing(model, every_k=0)
    with pytest.raises(ValueError, match="found no decoder layer in Linear"):
        apply_activation_checkpointing(torch.nn.Linear(2, 2))
    apply_activation_checkpointing(model)
    with pytest.raises(ValueError, match="already applied"):
        apply_activation_checkpointing(model)


def test_offloading_is_a_warned_noop_on_cpu():
    x = torch.randn(4, 4, requires_grad=True)
    with (
        pytest.warns(UserWarning, match="offloading is a no-op"),
        activation_offloading(True, device="cpu"),
    ):
        y = (x * x).sum()
    with torch.no_grad():
        x.add_(1.0)  # autograd saved x itself: backward must notice the change
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()


def test_offloading_on_cuda_moves_saved_tensors_to_host_copies():
    """The CUDA path stores host copies of what autograd saves (here the tensors are already
    on the host, and pinning needs CUDA, so a plain copy is made): changing the original
    after forward no longer reaches backward."""
    x = torch.randn(4, 4, requires_grad=True)
    original = x.detach().clone()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with activation_offloading(True, device="cuda"):
            y = (x * x).sum()
        with activation_offloading(False, device="cpu"):
            pass
    with torch.no_grad():
        x.add_(1.0)
    y.backward()
    torch.testing.assert_close(x.grad, 2 * original)
