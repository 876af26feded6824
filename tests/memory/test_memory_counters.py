"""AllocatedBytes, the CPU allocator's peak read from the profiler: what it counts, where it
says the peak sits, and that (unlike a dispatch mode) it leaves autograd's behaviour alone."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tunesmith.models import llama3
from tunesmith.modules.losses import LinearCrossEntropyLoss
from tunesmith.training.memory.usage import AllocatedBytes, PeakMemory


def test_allocated_bytes_counts_blocks_allocated_inside_only():
    older = torch.randn(1000)
    doomed = torch.randn(10_000)
    with AllocatedBytes() as mem:
        del doomed  # a free of an older block is not this block's
        view = older[:10]
        older.add_(1.0)
        doubled = older * 2  # 4000 bytes
        plus_one = doubled + 1  # 4000 more, both alive
        del doubled
        tripled = plus_one * 3  # 4000: the peak stays at two 4000-byte blocks
    # scalar operands may add a few bytes of their own
    assert 8000 <= mem.peak < 8000 + 64
    assert mem.peak_op.endswith("aten::add")
    assert sorted(a.bytes for a in mem.peak_allocations if a.bytes >= 4000) == [4000, 4000]
    assert sum(a.bytes for a in mem.peak_allocations) == mem.peak
    assert view.shape == (10,) and tripled.shape == (1000,)


def test_allocated_bytes_names_the_ops_around_the_peak():
    model = torch.nn.Linear(256, 256)
    opt = torch.optim.AdamW(model.parameters(), foreach=False)
    model(torch.randn(4, 256)).sum().backward()
    opt.step()  # states exist
    model(torch.randn(4, 256)).sum().backward()
    with AllocatedBytes() as mem:
        opt.step()
    # single-tensor AdamW: the weight's sqrt(exp_avg_sq) and its division are the peak
    assert "AdamW.step" in mem.peak_op
    assert [a.bytes for a in mem.peak_allocations[:2]] == [256 * 256 * 4] * 2


def _tied_model():
    torch.manual_seed(0)
    model = llama3.llama3_tiny(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=True,
    )
    assert model.lm_head.weight is model.model.embed_tokens.weight
    return model


class _PassThrough(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("measure", ["nothing", "allocated_bytes", "dispatch_mode"])
def test_only_a_dispatch_mode_changes_how_a_tied_gradient_accumulates(measure):
    """The head's gradient of a tied weight arrives first; autograd adds the embedding's
    gradient into it in place, unless a Python dispatch mode watches the backward."""
    model = _tied_model()
    ids = torch.randint(0, 512, (2, 16))
    hidden = model(ids, return_hidden_states=True)
    loss = LinearCrossEntropyLoss()(hidden, model.lm_head.weight, ids)
    head_grad = {}
    loss.grad_fn.register_hook(lambda grads_in, _: head_grad.update(ptr=grads_in[1].data_ptr()))
    context = {
        "nothing": contextlib.nullcontext,
        "allocated_bytes": AllocatedBytes,
        "dispatch_mode": _PassThrough,
    }[measure]
    with context():
        loss.backward()
    in_place = model.lm_head.weight.grad.data_ptr() == head_grad["ptr"]
    assert in_place == (measure != "dispatch_mode")


def test_peak_memory_uses_the_allocator_on_cpu():
    with PeakMemory("cpu") as mem:
        x = torch.randn(1024, 1024).sqrt()
    assert mem.peak >= 2 * x.numel() * 4
