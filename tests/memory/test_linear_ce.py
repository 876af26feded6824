"""LinearCrossEntropyLoss == CrossEntropyLoss on the full logits (values and gradients), for any
chunking, tied weights, bf16 and autocast; and it never holds the full logits in memory."""

from __future__ import annotations

import pytest
import torch

from tunesmith.models import llama3
from tunesmith.modules.losses import IGNORE_INDEX, CrossEntropyLoss, LinearCrossEntropyLoss
from tunesmith.training.memory.usage import LiveTensorBytes


def _inputs(b=2, s=9, h=32, vocab=97, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(b, s, h, generator=gen, dtype=dtype).requires_grad_()
    weight = (torch.randn(vocab, h, generator=gen, dtype=dtype) * 0.2).requires_grad_()
    labels = torch.randint(0, vocab, (b, s), generator=gen)
    labels[0, :4] = IGNORE_INDEX  # a prompt
    labels[1, -2:] = IGNORE_INDEX  # padding
    return hidden, weight, labels


def _value_and_grads(loss_fn, hidden, weight, labels):
    hidden.grad = weight.grad = None
    loss = loss_fn(hidden, weight, labels)
    loss.backward()
    return loss.detach(), hidden.grad.clone(), weight.grad.clone()


def _full_logits(hidden, weight, labels):
    return CrossEntropyLoss()(hidden @ weight.T, labels)


@pytest.mark.parametrize(
    "kwargs", [{"num_chunks": 1}, {"num_chunks": 3}, {"num_chunks": 100}, {"chunk_size": 4}]
)
def test_equals_cross_entropy_on_full_logits(kwargs):
    hidden, weight, labels = _inputs()
    expected = _value_and_grads(_full_logits, hidden, weight, labels)
    got = _value_and_grads(LinearCrossEntropyLoss(**kwargs), hidden, weight, labels)
    torch.testing.assert_close(got[0], expected[0], rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(got[1], expected[1], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[2], expected[2], rtol=1e-5, atol=1e-6)
    assert got[0].dtype == torch.float32
    assert torch.all(got[1][0, :4] == 0) and torch.all(got[1][1, -2:] == 0)  # ignored rows


def test_chunking_does_not_change_the_result():
    hidden, weight, labels = _inputs(s=31)
    results = [
        _value_and_grads(LinearCrossEntropyLoss(**kw), hidden, weight, labels)
        for kw in ({"num_chunks": 1}, {"num_chunks": 7}, {"chunk_size": 5}, {"chunk_size": 1})
    ]
    for other in results[1:]:
        for a, b in zip(other, results[0]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_frozen_weight_gets_no_gradient():
    hidden, weight, labels = _inputs()
    expected = _value_and_grads(_full_logits, hidden, weight, labels)
    weight.requires_grad_(False)
    hidden.grad = weight.grad = None
    loss = LinearCrossEntropyLoss(num_chunks=3)(hidden, weight, labels)
    loss.backward()
    assert weight.grad is None
    torch.testing.assert_close(hidden.grad, expected[1], rtol=1e-5, atol=1e-6)


def test_gradcheck_float64():
    hidden, weight, labels = _inputs(b=2, s=6, h=5, vocab=11, dtype=torch.float64)
    loss_fn = LinearCrossEntropyLoss(num_chunks=2)
    assert torch.autograd.gradcheck(lambda h, w: loss_fn(h, w, labels), (hidden, weight))


@pytest.mark.parametrize("tied", [True, False])
def test_transformer_lm_with_tied_or_untied_head(tied):
    """Hidden states + lm_head weight through the loss == the model's logits through CE, and
    every parameter (the tied embedding included) gets the same gradient."""
    torch.manual_seed(0)
    model = llama3.llama3_tiny(tie_word_embeddings=tied)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    input_ids = torch.randint(0, 256, (2, 12))
    labels = torch.randint(0, 256, (2, 12))
    labels[:, :5] = IGNORE_INDEX

    CrossEntropyLoss()(model(input_ids), labels).backward()
    expected = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    loss = LinearCrossEntropyLoss(num_chunks=4)(
        model.model(input_ids), model.lm_head.weight, labels
    )
    loss.backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], rtol=1e-4, atol=1e-6, msg=name)


def test_bf16_inputs_accumulate_in_float32():
    """bf16 hidden/weight: the loss (float32) and gradients are as close to a float64
    reference as the plain bf16 path is, or closer."""
    hidden, weight, labels = _inputs(s=64, h=64, vocab=512, dtype=torch.bfloat16)
    h64 = hidden.detach().double().requires_grad_()
    w64 = weight.detach().double().requires_grad_()
    ref = _value_and_grads(_full_logits, h64, w64, labels)
    got = _value_and_grads(LinearCrossEntropyLoss(num_chunks=4), hidden, weight, labels)
    plain = _value_and_grads(_full_logits, hidden, weight, labels)
    assert got[0].dtype == torch.float32
    assert got[1].dtype == got[2].dtype == torch.bfloat16

    def rel(a, b):
        return ((a.double() - b).norm() / b.norm()).item()

    assert rel(got[0], ref[0]) < 1e-3
    for i in (1, 2):
        assert rel(got[i], ref[i]) < 2e-2
        assert rel(got[i], ref[i]) <= rel(plain[i], ref[i]) * 1.5


def test_under_autocast_matches_autocast_logits():
    """float32 parameters under bf16 autocast (the recipe's mixed precision): the projection
    runs in bf16 like the autocast lm_head would, gradients reach the float32 weight."""
    hidden, weight, labels = _inputs(s=16, h=32, vocab=64)
    with torch.autocast("cpu", torch.bfloat16):
        expected = _value_and_grads(_full_logits, hidden, weight, labels)
        got = _value_and_grads(LinearCrossEntropyLoss(num_chunks=3), hidden, weight, labels)
    assert weight.grad.dtype == torch.float32
    torch.testing.assert_close(got[0], expected[0], rtol=2e-3, atol=1e-3)
    for a, b in zip(got[1:], expected[1:]):  # bf16 matmuls on both sides: compare norms
        assert ((a - b).norm() / b.norm()).item() < 1e-2


def test_token_sum_reduction_composes_with_gradient_accumulation():
    """Micro-batches with different trained-token counts, each loss divided by the global
    count and backpropagated in turn == the token-mean CE of the whole batch."""
    hidden, weight, labels = _inputs(b=4, s=10)
    labels[2, :8] = IGNORE_INDEX
    loss_fn = LinearCrossEntropyLoss(num_chunks=2)
    num_tokens = (labels != IGNORE_INDEX).sum()
    for rows in (slice(0, 1), slice(1, 4)):
        (loss_fn(hidden[rows], weight, labels[rows]) / num_tokens).backward()
    accumulated = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    torch.nn.functional.cross_entropy(
        (hidden @ weight.T).flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX
    ).backward()
    torch.testing.assert_close(accumulated[0], hidden.grad, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(accumulated[1], weight.grad, rtol=1e-5, atol=1e-7)


def test_nothing_trained_gives_zero_loss_and_gradients():
    hidden, weight, labels = _inputs()
    labels.fill_(IGNORE_INDEX)
    loss, grad_hidden, grad_weight = _value_and_grads(
        LinearCrossEntropyLoss(), hidden, weight, labels
    )
    assert loss.item() == 0.0
    assert not grad_hidden.any() and not grad_weight.any()


def test_bad_inputs_raise_clear_errors():
    hidden, weight, labels = _inputs(vocab=10)
    loss_fn = LinearCrossEntropyLoss()
    with pytest.raises(ValueError, match=r"labels must be in \[0, 10\)"):
        loss_fn(hidden, weight, labels.clamp(min=0) + 5)
    with pytest.raises(ValueError, match="must agree"):
        loss_fn(hidden, weight, labels[:, :-1])
    with pytest.raises(ValueError, match=r"weight must be \[vocab, hidden=32\]"):
        loss_fn(hidden, weight.T, labels)
    with pytest.raises(ValueError, match="num_chunks"):
        LinearCrossEntropyLoss(num_chunks=0)
    with pytest.raises(ValueError, match="chunk_size"):
        LinearCrossEntropyLoss(chunk_size=0)


def test_interface_flag_tells_recipes_what_to_pass():
    assert LinearCrossEntropyLoss.needs_hidden_states is True
    assert getattr(CrossEntropyLoss(), "needs_hidden_states", False) is False


def test_peak_memory_far_below_full_logits():
    """Forward + backward on 2048 tokens x 8192 vocab: the full-logits path holds several
    [tokens, vocab] float32 tensors at once (logits, log-softmax, their gradient); the
    linear loss never more than a chunk's, in forward or backward."""
    tokens, vocab, h = 2048, 8192, 32
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, tokens, h, generator=gen).requires_grad_()
    weight = torch.randn(vocab, h, generator=gen).requires_grad_()
    labels = torch.randint(0, vocab, (1, tokens), generator=gen)
    logits_bytes = tokens * vocab * 4

    def peak(loss_fn) -> tuple[int, int]:
        hidden.grad = weight.grad = None
        with LiveTensorBytes() as mem:
            loss = loss_fn(hidden, weight, labels)
            after_forward = mem.current
            loss.backward()
            del loss
        return mem.peak, after_forward

    full_peak, full_kept = peak(_full_logits)
    linear_peak, linear_kept = peak(LinearCrossEntropyLoss(num_chunks=16))
    assert full_peak >= 2 * logits_bytes  # the reference really materialises the logits
    assert full_kept >= logits_bytes  # ... and keeps them for backward
    assert linear_kept < logits_bytes / 20  # only rows, targets and log-sum-exps are kept
    assert linear_peak < 0.2 * full_peak
    assert linear_peak < 0.5 * logits_bytes  # never the whole logits, backward included


@pytest.mark.slow
def test_compiled_chunks_match_eager():
    hidden, weight, labels = _inputs(s=20)
    expected = _value_and_grads(LinearCrossEntropyLoss(num_chunks=3), hidden, weight, labels)
    got = _value_and_grads(
        LinearCrossEntropyLoss(num_chunks=3, compile=True), hidden, weight, labels
    )
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
