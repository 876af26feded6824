"""token_logprobs == log_softmax of the full logits gathered at the labels (values and
gradients), for any chunking, ignored tokens, tied or frozen weights, no_grad and autocast;
and it never holds the full logits in memory."""

from __future__ import annotations

import pytest
import torch

from tunesmith.models import llama3
from tunesmith.modules.losses import IGNORE_INDEX, token_logprobs
from tunesmith.training.memory.usage import LiveTensorBytes


def _inputs(b=3, s=7, h=6, vocab=13, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(b, s, h, generator=gen, dtype=dtype).requires_grad_()
    weight = (torch.randn(vocab, h, generator=gen, dtype=dtype) * 0.5).requires_grad_()
    labels = torch.randint(0, vocab, (b, s), generator=gen)
    labels[0, :3] = IGNORE_INDEX  # a prompt
    labels[1, -2:] = IGNORE_INDEX  # padding
    labels[2, :] = IGNORE_INDEX  # a row with no trained label
    return hidden, weight, labels


def _reference(hidden, weight, labels):
    """The full ``[b, s, V]`` log-softmax, gathered, zeroed at ignored labels."""
    logp = torch.log_softmax(hidden @ weight.T, dim=-1)
    trained = labels != IGNORE_INDEX
    picked = logp.gather(-1, torch.where(trained, labels, 0)[..., None]).squeeze(-1)
    return torch.where(trained, picked, torch.zeros_like(picked))


def _value_and_grads(fn, hidden, weight, labels, seed=1):
    """Values, and gradients of a random weighting of them (so every position counts)."""
    hidden.grad = weight.grad = None
    out = fn(hidden, weight, labels)
    cotangent = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out)
    (out * cotangent).sum().backward()
    return out.detach(), hidden.grad.clone(), weight.grad.clone()


@pytest.mark.parametrize("chunk_size", [1, 3, 10_000])
def test_equals_gathered_full_log_softmax(chunk_size):
    hidden, weight, labels = _inputs()
    expected = _value_and_grads(_reference, hidden, weight, labels)
    got = _value_and_grads(
        lambda h, w, y: token_logprobs(h, w, y, chunk_size=chunk_size), hidden, weight, labels
    )
    assert got[0].dtype == torch.float64 and got[0].shape == labels.shape
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    assert torch.all(got[0][labels == IGNORE_INDEX] == 0)
    assert torch.all(got[0][labels != IGNORE_INDEX] < 0)
    assert not got[1][2].any()  # the row with no trained label gets no gradient


def test_values_are_log_probabilities_written_out():
    """One position by hand: log(exp(z_y) / Σ_v exp(z_v))."""
    hidden, weight, labels = _inputs()
    got = token_logprobs(hidden, weight, labels, chunk_size=2)
    z = hidden[1, 0] @ weight.T
    y = int(labels[1, 0])
    expected = z[y] - torch.log(torch.exp(z).sum())
    torch.testing.assert_close(got[1, 0], expected)


def test_gradcheck_float64():
    hidden, weight, labels = _inputs(b=3, s=4, h=3, vocab=5)
    assert torch.autograd.gradcheck(
        lambda h, w: token_logprobs(h, w, labels, chunk_size=3), (hidden, weight)
    )


def test_custom_ignore_index():
    hidden, weight, labels = _inputs()
    relabelled = torch.where(labels == IGNORE_INDEX, -1, labels)
    torch.testing.assert_close(
        token_logprobs(hidden, weight, relabelled, ignore_index=-1),
        _reference(hidden, weight, labels),
    )


def test_frozen_weight_and_no_grad_reference():
    hidden, weight, labels = _inputs()
    expected = _value_and_grads(_reference, hidden, weight, labels)
    frozen = weight.detach()
    hidden.grad = None
    out = token_logprobs(hidden, frozen, labels, chunk_size=4)
    cotangent = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out)
    (out * cotangent).sum().backward()
    torch.testing.assert_close(hidden.grad, expected[1])
    with torch.no_grad():
        ref = token_logprobs(hidden, weight, labels, chunk_size=4)
    assert not ref.requires_grad
    torch.testing.assert_close(ref, expected[0])


def test_tied_weights_reach_every_parameter():
    """Hidden states + tied lm_head weight through token_logprobs == the model's logits
    through log_softmax, and every parameter (tied embedding included) gets the same grad."""
    torch.manual_seed(0)
    model = llama3.llama3_tiny(tie_word_embeddings=True).double()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    input_ids = torch.randint(0, 256, (2, 8))
    labels = torch.randint(0, 256, (2, 8))
    labels[:, :3] = IGNORE_INDEX
    cotangent = torch.randn(2, 8, dtype=torch.float64)

    (_reference(model.model(input_ids), model.lm_head.weight, labels) * cotangent).sum().backward()
    expected = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    out = token_logprobs(model.model(input_ids), model.lm_head.weight, labels, chunk_size=5)
    (out * cotangent).sum().backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], msg=name)


def test_under_autocast_projects_in_autocast_dtype():
    """float32 parameters under bf16 autocast: the projection runs in bf16 like the autocast
    lm_head would; the result is float32 and the float32 weight gets a float32 gradient."""
    hidden, weight, labels = _inputs(s=16, h=32, vocab=64, dtype=torch.float32)
    with torch.autocast("cpu", torch.bfloat16):
        expected = _value_and_grads(
            lambda h, w, y: _reference(h, w, y).float(), hidden, weight, labels
        )
        got = _value_and_grads(
            lambda h, w, y: token_logprobs(h, w, y, chunk_size=5), hidden, weight, labels
        )
    assert got[0].dtype == torch.float32 and weight.grad.dtype == torch.float32
    torch.testing.assert_close(got[0], expected[0], rtol=2e-2, atol=2e-2)
    for a, b in zip(got[1:], expected[1:]):  # bf16 matmuls on both sides: compare norms
        assert ((a - b).norm() / b.norm()).item() < 2e-2
    # and it really ran in bf16: the float32 projection differs by more than float32 rounding
    exact = token_logprobs(hidden, weight, labels)
    assert (exact - got[0]).abs().max() > 1e-4


def test_nothing_trained_gives_zeros_with_a_graph():
    hidden, weight, labels = _inputs()
    labels.fill_(IGNORE_INDEX)
    out, grad_hidden, grad_weight = _value_and_grads(token_logprobs, hidden, weight, labels)
    assert out.shape == labels.shape and not out.any()
    assert not grad_hidden.any() and not grad_weight.any()


def test_bad_inputs_raise_clear_errors():
    hidden, weight, labels = _inputs(vocab=10)
    with pytest.raises(ValueError, match=r"labels must be in \[0, 10\)"):
        token_logprobs(hidden, weight, labels.clamp(min=0) + 5)
    with pytest.raises(ValueError, match="must agree"):
        token_logprobs(hidden, weight, labels[:, :-1])
    with pytest.raises(ValueError, match=r"weight must be \[vocab, hidden=6\]"):
        token_logprobs(hidden, weight.T, labels)
    with pytest.raises(ValueError, match="chunk_size"):
        token_logprobs(hidden, weight, labels, chunk_size=0)


def test_peak_memory_far_below_full_logits():
    """Forward + backward on 2048 tokens x 4096 vocab: the full path holds [tokens, vocab]
    tensors; token_logprobs never more than a chunk's, in forward or backward."""
    tokens, vocab, h = 2048, 4096, 16
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, tokens, h, generator=gen).requires_grad_()
    weight = torch.randn(vocab, h, generator=gen).requires_grad_()
    labels = torch.randint(0, vocab, (1, tokens), generator=gen)
    logits_bytes = tokens * vocab * 4

    def peak(fn) -> tuple[int, int]:
        hidden.grad = weight.grad = None
        with LiveTensorBytes() as mem:
            out = fn(hidden, weight, labels)
            after_forward = mem.current
            out.sum().backward()
            del out
        return mem.peak, after_forward

    full_peak, full_kept = peak(_reference)
    chunked_peak, chunked_kept = peak(lambda h, w, y: token_logprobs(h, w, y, chunk_size=128))
    assert full_peak >= 2 * logits_bytes and full_kept >= logits_bytes
    chunk_bytes = logits_bytes // 16
    assert chunked_kept < logits_bytes / 20  # rows, targets and per-token values only
    # one chunk's logits and the few same-sized temporaries of its backward, never 16 chunks
    assert chunked_peak < 6 * chunk_bytes


def test_one_chunk_is_kept_at_no_extra_peak():
    """A single chunk keeps its logits from forward to backward (no second head matmul) and
    peaks no higher than recomputing them; the result and gradients are the same."""
    tokens, vocab, h = 512, 4096, 16
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, tokens, h, generator=gen).requires_grad_()
    weight = torch.randn(vocab, h, generator=gen).requires_grad_()
    labels = torch.randint(0, vocab, (1, tokens), generator=gen)
    logits_bytes = tokens * vocab * 4

    def run(recompute):
        hidden.grad = weight.grad = None
        with LiveTensorBytes() as mem:
            out = token_logprobs(hidden, weight, labels, recompute=recompute)
            kept = mem.current
            out.sum().backward()
        return out.detach(), hidden.grad.clone(), weight.grad.clone(), mem.peak, kept

    *kept_run, kept_peak, kept_bytes = run(None)
    *recomputed, recomputed_peak, recomputed_bytes = run(True)
    assert kept_bytes >= logits_bytes > 20 * recomputed_bytes
    assert kept_peak <= 1.05 * recomputed_peak
    for a, b in zip(kept_run, recomputed, strict=True):
        assert torch.equal(a, b)


def test_a_second_backward_through_a_retained_graph_recomputes():
    """The kept logits turn into gradients in place; a second backward recomputes them."""
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 9, 8, generator=gen).requires_grad_()
    weight = torch.randn(40, 8, generator=gen).requires_grad_()
    labels = torch.randint(0, 40, (2, 9), generator=gen)
    out = token_logprobs(hidden, weight, labels)
    out.sum().backward(retain_graph=True)
    once = hidden.grad.clone(), weight.grad.clone()
    out.sum().backward()
    torch.testing.assert_close(hidden.grad, 2 * once[0])
    torch.testing.assert_close(weight.grad, 2 * once[1])
