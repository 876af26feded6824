"""LinearCrossEntropyLoss computes its gradients in forward (``grad_in_forward``, the default):
loss and gradients still equal plain cross-entropy on the full logits (float64, ignored tokens,
tied and frozen weights, any incoming scale, accumulation over calls, bf16 autocast), the
backward pass only scales what forward stored (three matmuls per chunk, not four), the weight
gradient reaches ``.grad`` without a copy, and evaluation computes no gradient at all."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from tunesmith.modules.losses import IGNORE_INDEX, LinearCrossEntropyLoss
from tunesmith.training.memory.usage import LiveTensorBytes

MODES = [True, False]  # grad_in_forward, and the recompute-in-backward path


def _inputs(b=2, s=11, h=16, vocab=53, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(b, s, h, generator=gen, dtype=dtype).requires_grad_()
    weight = (torch.randn(vocab, h, generator=gen, dtype=dtype) * 0.5).requires_grad_()
    labels = torch.randint(0, vocab, (b, s), generator=gen)
    labels[0, :5] = IGNORE_INDEX  # a prompt
    labels[1, -3:] = IGNORE_INDEX  # padding
    return hidden, weight, labels


def _reference(hidden, weight, labels):
    """Summed CE on the full logits, written out: logsumexp minus the target logit."""
    logits = hidden @ weight.T
    keep = labels != IGNORE_INDEX
    lse = torch.logsumexp(logits, dim=-1)
    target = logits.gather(-1, labels.clamp(min=0)[..., None]).squeeze(-1)
    return ((lse - target) * keep).sum()


def _grads(loss_fn, hidden, weight, labels, scale=1.0):
    hidden.grad = weight.grad = None
    loss = loss_fn(hidden, weight, labels)
    (loss * scale).backward()
    return loss.detach(), hidden.grad.clone(), weight.grad.clone()


def _close(got, expected, rtol=1e-10, atol=1e-12):
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol)


class MatmulCounter(TorchDispatchMode):
    """Counts the aten matmul ops (mm, addmm, bmm; any overload, in place too) run inside."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__.lstrip("_").split("_")[0] in {"mm", "addmm", "bmm"}:
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("grad_in_forward", MODES)
@pytest.mark.parametrize("chunking", [{"num_chunks": 1}, {"num_chunks": 3}, {"chunk_size": 2}])
def test_float64_loss_and_grads_equal_full_logits(grad_in_forward, chunking):
    hidden, weight, labels = _inputs()
    expected = _grads(_reference, hidden, weight, labels)
    loss_fn = LinearCrossEntropyLoss(**chunking, grad_in_forward=grad_in_forward)
    got = _grads(loss_fn, hidden, weight, labels)
    _close(got, expected)
    assert got[0].dtype == torch.float64
    assert not got[1][0, :5].any() and not got[1][1, -3:].any()  # ignored rows: no gradient


@pytest.mark.parametrize("grad_in_forward", MODES)
def test_incoming_gradient_scales_the_stored_gradients(grad_in_forward):
    """``(loss * 3).backward()``: the scalar reaching the loss is applied in backward."""
    hidden, weight, labels = _inputs()
    expected = _grads(_reference, hidden, weight, labels, scale=3.0)
    loss_fn = LinearCrossEntropyLoss(num_chunks=2, grad_in_forward=grad_in_forward)
    _close(_grads(loss_fn, hidden, weight, labels, scale=3.0), expected)
    hidden.grad = weight.grad = None
    (loss_fn(hidden, weight, labels) / 7.0 - 2.0).backward()  # the recipe's 1 / token count
    torch.testing.assert_close(weight.grad, expected[2] / 21.0, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("grad_in_forward", MODES)
def test_two_calls_accumulate_into_grad(grad_in_forward):
    """Two micro-batches, backpropagated one after the other (gradient accumulation), and two
    forwards backpropagated together == the reference on both."""
    hidden, weight, labels = _inputs(b=4)
    loss_fn = LinearCrossEntropyLoss(num_chunks=2, grad_in_forward=grad_in_forward)
    expected = _grads(_reference, hidden, weight, labels)
    hidden.grad = weight.grad = None
    for rows in (slice(0, 1), slice(1, 4)):
        loss_fn(hidden[rows], weight, labels[rows]).backward()
    _close((expected[0], hidden.grad, weight.grad), expected)
    hidden.grad = weight.grad = None
    (loss_fn(hidden[:2], weight, labels[:2]) + loss_fn(hidden[2:], weight, labels[2:])).backward()
    _close((expected[0], hidden.grad, weight.grad), expected)


@pytest.mark.parametrize("grad_in_forward", MODES)
def test_tied_weight_gets_both_gradients(grad_in_forward):
    """The head is the embedding matrix: its gradient sums the embedding lookup's and the
    projection's."""
    _, weight, labels = _inputs()
    ids = labels.clamp(min=0).roll(1, dims=1)
    scale = torch.linspace(0.5, 1.5, weight.shape[1], dtype=weight.dtype).requires_grad_()

    def run(loss):
        weight.grad = scale.grad = None
        hidden = F.embedding(ids, weight) * scale
        loss(hidden, weight, labels).backward()
        return weight.grad.clone(), scale.grad.clone()

    expected = run(_reference)
    _close(run(LinearCrossEntropyLoss(num_chunks=3, grad_in_forward=grad_in_forward)), expected)


@pytest.mark.parametrize("grad_in_forward", MODES)
def test_frozen_weight_costs_no_weight_gradient(grad_in_forward):
    """A frozen head (LoRA): hidden gradient exact, no weight gradient, and no weight-gradient
    matmul: per chunk 2 matmuls with gradients in forward (logits, d hidden), 3 when
    backward recomputes the logits."""
    hidden, weight, labels = _inputs()
    expected = _grads(_reference, hidden, weight, labels)
    weight.requires_grad_(False)
    hidden.grad = weight.grad = None
    with MatmulCounter() as counter:
        loss = LinearCrossEntropyLoss(num_chunks=3, grad_in_forward=grad_in_forward)(
            hidden, weight, labels
        )
        loss.backward()
    assert weight.grad is None
    torch.testing.assert_close(hidden.grad, expected[1], rtol=1e-10, atol=1e-12)
    assert counter.count == 3 * (2 if grad_in_forward else 3)


def test_gradients_in_forward_take_three_matmuls_per_chunk_and_backward_none():
    hidden, weight, labels = _inputs()
    loss_fn = LinearCrossEntropyLoss(num_chunks=4)
    with MatmulCounter() as forward:
        loss = loss_fn(hidden, weight, labels)
    with MatmulCounter() as backward:
        loss.backward()
    assert (forward.count, backward.count) == (3 * 4, 0)
    recompute = LinearCrossEntropyLoss(num_chunks=4, grad_in_forward=False)
    with MatmulCounter() as both:
        recompute(hidden, weight, labels).backward()
    assert both.count == 4 * 4  # logits in forward; logits again + two gradients in backward


def test_no_grad_computes_only_the_loss():
    """Evaluation: one matmul per chunk, nothing weight-sized allocated, no graph."""
    hidden, weight, labels = _inputs(s=40, h=64, vocab=512, dtype=torch.float32)
    expected = _reference(hidden, weight, labels)
    with torch.no_grad(), MatmulCounter() as counter, LiveTensorBytes() as mem:
        loss = LinearCrossEntropyLoss(num_chunks=4)(hidden, weight, labels)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-4)
    assert counter.count == 4 and not loss.requires_grad
    assert mem.peak < weight.numel() * weight.element_size() / 2


def test_weight_gradient_reaches_grad_without_a_copy():
    """Forward + backward hold one weight-sized gradient at most (the one that becomes
    ``weight.grad``): backward scales it in place and autograd keeps it as is."""
    tokens, vocab, h = 64, 4096, 256
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, tokens, h, generator=gen).requires_grad_()
    weight = torch.randn(vocab, h, generator=gen).requires_grad_()
    labels = torch.randint(0, vocab, (1, tokens), generator=gen)
    weight_bytes = vocab * h * 4
    with LiveTensorBytes() as mem:
        loss = LinearCrossEntropyLoss(num_chunks=4)(hidden, weight, labels)
        (loss / tokens).backward()
        del loss
    assert weight.grad is not None
    assert mem.peak < 1.5 * weight_bytes  # a copy (or an out-of-place scale) would be 2x
    assert mem.current < 1.2 * weight_bytes  # the stored gradients were released


def test_second_backward_through_a_retained_graph_recomputes():
    """The first backward hands the stored gradients over; a second one (retain_graph)
    recomputes them, so both add the same gradient."""
    hidden, weight, labels = _inputs()
    expected = _grads(_reference, hidden, weight, labels)
    hidden.grad = weight.grad = None
    loss = LinearCrossEntropyLoss(num_chunks=3)(hidden, weight, labels)
    loss.backward(retain_graph=True)
    (loss * 2).backward()
    _close((loss.detach(), hidden.grad, weight.grad), (expected[0], *(3 * g for g in expected[1:])))


@pytest.mark.parametrize("grad_in_forward", MODES)
def test_bf16_autocast_matches_autocast_full_logits(grad_in_forward):
    """float32 parameters under bf16 autocast: the projection and gradient matmuls run in bf16
    like the autocast lm_head; the loss is float32, the weight gradient float32."""
    hidden, weight, labels = _inputs(s=24, h=32, vocab=96, dtype=torch.float32)

    def full_logits(hidden, weight, labels):
        logits = F.linear(hidden, weight)
        return F.cross_entropy(
            logits.flatten(0, 1).float(),
            labels.flatten(),
            ignore_index=IGNORE_INDEX,
            reduction="sum",
        )

    loss_fn = LinearCrossEntropyLoss(num_chunks=3, grad_in_forward=grad_in_forward)
    with torch.autocast("cpu", torch.bfloat16):
        expected = _grads(full_logits, hidden, weight, labels, scale=0.5)
        got = _grads(loss_fn, hidden, weight, labels, scale=0.5)
    assert got[0].dtype == torch.float32 and weight.grad.dtype == torch.float32
    torch.testing.assert_close(got[0], expected[0], rtol=2e-3, atol=1e-3)
    for a, b in zip(got[1:], expected[1:]):  # bf16 matmuls on both sides: compare norms
        assert ((a - b).norm() / b.norm()).item() < 1e-2


def test_extreme_logits_stay_finite():
    """float32, targets far below the best logit (hundreds of nats per token): the loss is
    finite and as close to a float64 reference as full-logits float32 CE, as the log-sum-exp
    never divides by an underflowed probability."""
    hidden, weight, labels = _inputs(s=8, dtype=torch.float32)
    with torch.no_grad():
        hidden.mul_(40.0)
    h64 = hidden.detach().double().requires_grad_()
    w64 = weight.detach().double().requires_grad_()
    exact = _grads(_reference, h64, w64, labels)
    plain = _grads(_reference, hidden, weight, labels)
    got = _grads(LinearCrossEntropyLoss(num_chunks=2), hidden, weight, labels)
    assert torch.isfinite(got[0]) and exact[0] > 300
    for a, p, b in zip(got, plain, exact):
        error, plain_error = (
            ((a.double() - b).norm() / b.norm()),
            ((p.double() - b).norm() / b.norm()),
        )
        assert error < max(2 * plain_error, 1e-6)


def test_double_backward_is_refused():
    """The stored gradients are constants: differentiating them again raises instead of
    silently giving zero."""
    hidden, weight, labels = _inputs()
    scale = torch.tensor(2.0, dtype=hidden.dtype, requires_grad=True)
    loss = LinearCrossEntropyLoss()(hidden, weight, labels) * scale
    (grad_hidden,) = torch.autograd.grad(loss, hidden, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        grad_hidden.sum().backward()


def test_grad_in_forward_must_be_a_bool():
    with pytest.raises(ValueError, match="grad_in_forward"):
        LinearCrossEntropyLoss(grad_in_forward="yes")


@pytest.mark.parametrize(
    ("rows", "vocab", "kwargs", "chunks"),
    [
        (100, 8192, {}, 1),  # an 8 MiB weight: no chunk under 512 rows
        (1100, 8192, {}, 2),
        (2100, 8192, {}, 4),
        (4200, 8192, {}, 8),  # at most 8 chunks
        (100, 64, {}, 8),  # a weight that stays in cache: 8 chunks whatever their size
        (100, 8192, {"num_chunks": 3}, 3),  # an explicit count is kept whatever the size
        (100, 8192, {"chunk_size": 40}, 3),
    ],
)
def test_default_chunks_are_at_most_eight_and_at_least_512_rows_for_big_weights(
    rows, vocab, kwargs, chunks
):
    hidden, weight, labels = _inputs(b=2, s=rows // 2, h=256, vocab=vocab, dtype=torch.float32)
    labels.clamp_(min=0)  # every row trained
    loss_fn = LinearCrossEntropyLoss(**kwargs)
    assert loss_fn.num_chunks == kwargs.get("num_chunks", 8)
    expected_rows = kwargs.get("chunk_size", -(-rows // chunks))
    assert loss_fn.rows_per_chunk(rows, weight.numel() * 4) == expected_rows
    with torch.no_grad(), MatmulCounter() as counter:
        loss = loss_fn(hidden, weight, labels)
    assert counter.count == chunks  # one logits matmul per chunk
    torch.testing.assert_close(loss, _reference(hidden, weight, labels), rtol=1e-5, atol=1e-2)


def test_compile_loss_leaves_linear_cross_entropy_eager():
    from tunesmith.training.memory.compile import compile_loss

    for loss_fn in (LinearCrossEntropyLoss(), LinearCrossEntropyLoss(3, grad_in_forward=False)):
        assert compile_loss(loss_fn) is loss_fn and not loss_fn.compile
